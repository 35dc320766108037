"""The one denoising loop on the tiny SD3 model: a zero-noise SDE step is the Euler step, replay of a stored step is
exact, candidate noise ignores chunking, trained steps store the right shapes, the last step is never stochastic."""

import pytest
import torch

from flowforge.algorithms import schedules
from flowforge.algorithms.sde import euler_step
from flowforge.data.preprocess import encode_cached
from flowforge.models import build_adapter
from flowforge.rollout import loop as loop_module
from flowforge.rollout import (RolloutSpec, candidate_noise, decode_media, denoise, generate, replay_log_prob,
                               rollout, rollout_chunked, video_frames)

PROMPTS = ["a handwritten seven", "the number 3, written neatly", "a neat two", "the digit zero"]
IDS = [101, 202, 303, 404]  # stable candidate ids (noise seeds)
SEED = 7
NUM_STEPS = 4


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    return build_adapter("sd3", str(tiny_model_dir), task="t2i", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def cond(adapter, encode_cache_dir):
    return encode_cached(adapter.encode, adapter.encoder_id, PROMPTS, encode_cache_dir)


@pytest.fixture(scope="module")
def shape(adapter):
    return tuple(adapter.latent_shape(32, 32))


@pytest.fixture(scope="module")
def sigmas():
    return schedules.flow_match_sigmas(NUM_STEPS, 3.0)


def _rollout(adapter, cond, sigmas, shape, spec, ids=IDS):
    return rollout(adapter, cond, ids, sigmas, spec, latent_shape=shape, seed=SEED)


@pytest.mark.parametrize("kind", ["sde", "dance"])
def test_zero_noise_sde_step_is_the_euler_step(adapter, cond, sigmas, shape, kind):
    steps = (0, 1, 2)
    zero = _rollout(adapter, cond, sigmas, shape, RolloutSpec(kind=kind, noise_level=0.0, trained_steps=steps,
                                                              log_probs=False))
    ode = _rollout(adapter, cond, sigmas, shape, RolloutSpec(kind="ode", noise_level=0.0, trained_steps=steps,
                                                             log_probs=False))
    assert torch.equal(zero.next_latents, ode.next_latents) and torch.equal(zero.final, ode.final)
    x_T = candidate_noise(IDS, shape, SEED, -1)
    assert torch.equal(zero.final, generate(adapter, cond, x_T, sigmas))
    with torch.no_grad():  # one step by hand: diffusers' Euler update of the same velocity
        for slot, i in enumerate(steps):
            x = zero.latents[:, slot]
            v = adapter.velocity(x, sigmas[i].expand(len(IDS)), cond, 1.0)
            assert torch.equal(zero.next_latents[:, slot], euler_step(x, v, sigmas[i], sigmas[i + 1]))


def test_zero_noise_cps_matches_euler_up_to_rounding(adapter, cond, sigmas, shape):
    """CPS with eta = 0 is the Euler step in exact arithmetic (a different but equal expression)."""
    spec = RolloutSpec(kind="cps", noise_level=0.0, trained_steps=(0, 1, 2), log_probs=False)
    x_T = candidate_noise(IDS, shape, SEED, -1)
    torch.testing.assert_close(_rollout(adapter, cond, sigmas, shape, spec).final,
                               generate(adapter, cond, x_T, sigmas), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["sde", "dance", "cps"])
def test_replay_of_a_stored_step_gives_the_stored_log_prob_exactly(adapter, cond, sigmas, shape, kind):
    spec = RolloutSpec(kind=kind, noise_level=0.7, trained_steps=(0, 2))
    traj = _rollout(adapter, cond, sigmas, shape, spec)
    for slot in range(len(spec.trained_steps)):
        tr = replay_log_prob(adapter, traj, slot, cond, spec)
        assert torch.equal(tr.log_prob.detach(), traj.log_probs[:, slot])
        ratio = torch.exp(tr.log_prob.detach() - traj.log_probs[:, slot])
        assert torch.equal(ratio, torch.ones_like(ratio))


def test_noise_does_not_depend_on_chunking_or_batch_position(adapter, cond, sigmas, shape, monkeypatch):
    assert torch.equal(candidate_noise(IDS[2:], shape, SEED, 1), candidate_noise(IDS, shape, SEED, 1)[2:])
    assert torch.equal(candidate_noise(IDS[::-1], shape, SEED, -1), candidate_noise(IDS, shape, SEED, -1).flip(0))
    assert not torch.equal(candidate_noise(IDS, shape, SEED, 0), candidate_noise(IDS, shape, SEED, 1))

    def chunked(batch_size):
        drawn = {}  # (candidate id, slot) -> the noise that candidate received

        def recording(ids, latent_shape, seed, slot):
            noise = candidate_noise(ids, latent_shape, seed, slot)
            drawn.update({(c, slot): n for c, n in zip(ids, noise)})
            return noise

        monkeypatch.setattr(loop_module, "candidate_noise", recording)
        spec = RolloutSpec(kind="sde", noise_level=0.7, trained_steps=(0, 1, 2))
        traj = rollout_chunked(adapter, cond, IDS, sigmas, spec, latent_shape=shape, seed=SEED, batch_size=batch_size)
        return traj, drawn

    (two, noise_two), (four, noise_four) = chunked(2), chunked(4)
    assert noise_two.keys() == noise_four.keys() == {(c, i) for c in IDS for i in (-1, 0, 1, 2)}
    assert all(torch.equal(noise_two[k], noise_four[k]) for k in noise_two)
    # same noise, same model: the trajectories agree up to the rounding of batch-2 vs batch-4 GEMMs (bitwise equality
    # needs equal batch shapes, which is why the trainer chunks the rollout exactly like its micro-batches)
    for name in ("final", "latents", "next_latents", "log_probs"):
        torch.testing.assert_close(getattr(two, name), getattr(four, name), rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(two.latents[:, 0], four.latents[:, 0])  # x_T itself is exact


def test_trained_steps_store_inputs_samples_and_log_probs(adapter, cond, sigmas, shape):
    steps = (0, 1, 2)
    b, s = len(IDS), len(steps)
    traj = _rollout(adapter, cond, sigmas, shape, RolloutSpec(kind="sde", noise_level=0.7, trained_steps=steps,
                                                              store_means=True))
    assert traj.final.shape == (b, *shape) and traj.final.dtype == torch.float32
    assert traj.latents.shape == traj.next_latents.shape == traj.means.shape == (b, s, *shape)
    assert traj.latents.dtype == traj.next_latents.dtype == torch.float32
    assert traj.log_probs.shape == (b, s) and traj.log_probs.dtype == torch.float32
    assert traj.trained_steps == steps and torch.equal(traj.sigmas, sigmas)
    assert torch.equal(traj.latents[:, 0], candidate_noise(IDS, shape, SEED, -1))  # step 0 starts at x_T
    assert torch.equal(traj.latents[:, 1:], traj.next_latents[:, :-1])  # consecutive steps chain
    assert not torch.equal(traj.next_latents, traj.means)  # x_next is sampled around the mean, not the mean
    bare = _rollout(adapter, cond, sigmas, shape, RolloutSpec(kind="sde", noise_level=0.7, trained_steps=steps,
                                                              store_steps=False, log_probs=False))
    assert bare.latents is None and bare.next_latents is None and bare.log_probs is None and bare.means is None
    assert torch.equal(bare.final, traj.final)
    picked = traj.select(torch.tensor([3, 1]))
    assert torch.equal(picked.log_probs, traj.log_probs[[3, 1]]) and picked.latents.shape == (2, s, *shape)


def test_the_last_step_is_never_stochastic(adapter, cond, sigmas, shape):
    last = NUM_STEPS - 1
    for window in ((0.0, 1.0), (0.5, 1.0), (0.9, 1.0)):
        assert last not in schedules.resolve_trained_steps(NUM_STEPS, num_sde_steps=0, fraction=window)
    for seed in range(20):
        assert last not in schedules.resolve_trained_steps(NUM_STEPS, pool=[0, 1, 2], resample_seed=seed, count=2)
    with pytest.raises(ValueError):
        schedules.resolve_trained_steps(NUM_STEPS, indices=[last])
    steps = tuple(schedules.resolve_trained_steps(NUM_STEPS))  # every trainable step
    drawn = []

    def step_noise(i):
        drawn.append(i)
        return candidate_noise(IDS, shape, SEED, i)

    x_T = candidate_noise(IDS, shape, SEED, -1)
    traj = denoise(adapter, cond, x_T, sigmas, RolloutSpec(kind="sde", noise_level=0.7, trained_steps=steps),
                   step_noise)
    assert steps == tuple(range(last)) and drawn == list(steps)  # no noise drawn for the last step
    with torch.no_grad():  # the last step is the deterministic Euler step from the last stored sample
        x = traj.next_latents[:, -1]
        v = adapter.velocity(x, sigmas[last].expand(len(IDS)), cond, 1.0)
        assert torch.equal(traj.final, euler_step(x, v, sigmas[last], sigmas[last + 1]))


def test_decode_media_is_chunk_independent_and_in_unit_range(adapter, cond, sigmas, shape):
    x_T = candidate_noise(IDS, shape, SEED, -1)
    final = generate(adapter, cond, x_T, sigmas)
    media = decode_media(adapter, final, batch_size=3)
    assert media.shape[0] == len(IDS) and media.ndim == 4 and not media.requires_grad
    assert torch.equal(media, decode_media(adapter, final, batch_size=len(IDS)))
    assert float(media.min()) >= 0.0 and float(media.max()) <= 1.0
    with pytest.raises(ValueError):
        decode_media(adapter, final, batch_size=0)
    video = torch.arange(2 * 3 * 4 * 2 * 2, dtype=torch.float32).view(2, 3, 4, 2, 2)  # [B, 3, F, H, W]
    frames = video_frames(video)
    assert frames.shape == (8, 3, 2, 2) and torch.equal(frames[5], video[1, :, 1])
