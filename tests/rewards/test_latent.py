"""Latent rewards (``takes_latents``): what the processor hands a latent scorer, what a training step must decode
(:meth:`RewardProcessor.inputs`), the ``latent_reference`` scorer and latent scoring functions by import path, and the
rollout boundary's :func:`decode_needed` that decodes nothing when nothing reads pixels."""

import math

import pytest
import torch
from safetensors.torch import save_file

from flowforge.rewards.processor import RewardProcessor
from flowforge.rewards.registry import SCORERS, build_scorer
from flowforge.rollout.media import decode_needed

MOD = "tests.rewards.byo_scorers"


class _Recorder:
    """Records the first argument of every call; scores its per-sample mean."""

    needs_group = False

    def __init__(self, name, latent=False, group=False):
        self.name, self.takes_latents, self.needs_group, self.seen = name, latent, group, []

    def __call__(self, x, prompts, metadata):
        self.seen.append(x)
        return x.float().flatten(1).mean(1)


def _prompts(n):
    return [f"p{i}" for i in range(n)], [{"i": i} for i in range(n)]


def test_a_latent_scorer_gets_the_latents_whole_and_a_pixel_scorer_the_frames():
    video = torch.rand(4, 3, 2, 8, 8)  # [B, 3, F, H, W]
    latents = torch.randn(4, 5, 2, 3, 3)  # [B, C, F, h, w]
    lat, pix = _Recorder("lat", latent=True), _Recorder("pix")
    processor = RewardProcessor({"lat": lat, "pix": pix}, {"lat": 1.0, "pix": 1.0}, batch_size=4)
    components, _ = processor(video, *_prompts(4), latents=latents)
    assert len(lat.seen) == 1 and torch.equal(lat.seen[0], latents)  # whole, never split into frames
    assert torch.equal(torch.cat(pix.seen), video.permute(0, 2, 1, 3, 4).flatten(0, 1))  # frame by frame
    torch.testing.assert_close(components["lat"], latents.flatten(1).mean(1))


def test_inputs_name_what_the_weighted_scorers_read_and_monitors_never_force_a_decode():
    lat, pix = _Recorder("lat", latent=True), _Recorder("pix")
    only_latent = RewardProcessor({"lat": lat, "pix": pix}, {"lat": 1.0})  # pix: monitor-only (eval.scorers)
    assert only_latent.inputs() == {"latents"}
    assert only_latent.inputs(evaluation=True) == {"latents", "pixels"}
    assert RewardProcessor({"lat": lat, "pix": pix}, {"lat": 1.0, "pix": 1.0}).inputs() == {"latents", "pixels"}
    # a training step with latents alone: the latent component is scored, the pixel monitor left for evaluation
    components, metrics = only_latent(None, *_prompts(3), latents=torch.randn(3, 1, 4, 4))
    assert list(components) == ["lat"] and "reward/pix_mean" not in metrics
    assert pix.seen == []
    # evaluation (paid_groups set) scores every component with what it reads
    components, _ = only_latent(torch.rand(3, 3, 4, 4), *_prompts(3), torch.arange(3), paid_groups=0,
                                latents=torch.randn(3, 1, 4, 4))
    assert list(components) == ["lat", "pix"]


def test_a_weighted_scorer_without_its_input_is_an_error():
    processor = RewardProcessor({"pix": _Recorder("pix")}, {"pix": 1.0})
    with pytest.raises(ValueError, match="'pix' scores decoded media but none were given"):
        processor(None, *_prompts(2), latents=torch.randn(2, 1, 4, 4))
    processor = RewardProcessor({"lat": _Recorder("lat", latent=True)}, {"lat": 1.0})
    with pytest.raises(ValueError, match="'lat' scores latents"):
        processor(torch.rand(2, 3, 4, 4), *_prompts(2))
    with pytest.raises(ValueError, match="needs media or latents"):
        processor(None, *_prompts(2))


def test_a_latent_group_scorer_streams_without_media():
    lat = _Recorder("lat", latent=True, group=True)
    processor = RewardProcessor({"lat": lat}, {"lat": 1.0})
    latents = torch.randn(4, 2, 3, 3)
    stream = processor.stream(*_prompts(4), torch.tensor([0, 0, 1, 1]), given={"latents"})
    stream.add(torch.tensor([2, 3]), None, latents[2:])
    stream.add(torch.tensor([0, 1]), None, latents[:2])
    media, components, _ = stream.finish()
    assert media is None
    torch.testing.assert_close(components["lat"], latents.flatten(1).mean(1))
    assert sorted(x.shape[0] for x in lat.seen) == [2, 2]  # one call per whole group


class _CountingAdapter:
    def __init__(self):
        self.decodes = 0

    def decode(self, latents):
        self.decodes += 1
        return (latents[:, :3] + 1) / 2


def test_decode_needed_decodes_only_what_is_read():
    adapter, latents = _CountingAdapter(), torch.zeros(5, 3, 4, 4)
    assert decode_needed(adapter, latents, 2, {"latents"}) == (None, None)
    assert adapter.decodes == 0
    media, audio = decode_needed(adapter, latents, 2, {"latents", "pixels", "audio"})
    assert media.shape == (5, 3, 4, 4) and audio is None  # no sound: the adapter makes none
    assert adapter.decodes == 3  # in chunks of 2


@pytest.fixture
def references(tmp_path):
    refs = {"0": torch.zeros(1, 4, 4), "1": torch.ones(1, 4, 4)}
    save_file(refs, str(tmp_path / "refs.safetensors"))
    save_file({"only": torch.full((1, 4, 4), 0.5)}, str(tmp_path / "one.safetensors"))
    return tmp_path


def test_latent_reference_scores_mse_and_cosine_by_hand(references):
    assert SCORERS["latent_reference"] is type(build_scorer("latent_reference",
                                                           reference=str(references / "one.safetensors")))
    x = torch.stack([torch.full((1, 4, 4), 2.0), torch.full((1, 4, 4), -1.0), torch.zeros(1, 4, 4)])
    meta = [{"digit": 1}, {"digit": 0}, {"digit": 7}]  # no reference for 7: not applicable
    mse = build_scorer("latent_reference", reference=str(references / "refs.safetensors"), key="digit")
    assert mse.takes_latents and not mse.needs_group
    out = mse(x, ["a", "b", "c"], meta)
    assert out.dtype == torch.float32 and out.shape == (3,)
    assert out[0].item() == -1.0 and out[1].item() == -1.0 and math.isnan(out[2].item())  # -(2-1)^2, -(-1-0)^2
    cos = build_scorer("latent_reference", reference=str(references / "one.safetensors"), metric="cosine")
    x = torch.stack([torch.full((1, 4, 4), 3.0), torch.full((1, 4, 4), -3.0)])
    torch.testing.assert_close(cos(x, ["a", "b"], [{}, {}]), torch.tensor([1.0, -1.0]))


def test_latent_reference_refuses_bad_options_and_shapes(references):
    with pytest.raises(ValueError, match="metric must be one of"):
        build_scorer("latent_reference", reference=str(references / "one.safetensors"), metric="l1")
    with pytest.raises(ValueError, match="exactly one"):
        build_scorer("latent_reference", reference=str(references / "refs.safetensors"))
    with pytest.raises(ValueError, match="no file"):
        build_scorer("latent_reference", reference=str(references / "missing.safetensors"))
    scorer = build_scorer("latent_reference", reference=str(references / "one.safetensors"))
    with pytest.raises(ValueError, match=r"reference of shape \(1, 4, 4\) for latents of shape \(1, 8, 8\)"):
        scorer(torch.zeros(2, 1, 8, 8), ["a", "b"], [{}, {}])


def test_a_scoring_function_whose_first_argument_is_latents_is_a_latent_scorer():
    spec = f"{MOD}:latent_energy"
    scorer = build_scorer(spec, scale=2.0)
    assert scorer.takes_latents is True
    assert build_scorer(f"{MOD}:make_brightness").__class__.__name__ == "Brightness"
    assert getattr(build_scorer("jpeg_compressibility"), "takes_latents", False) is False
    latents = torch.randn(3, 2, 4, 4)
    processor = RewardProcessor({spec: scorer}, {spec: 1.0})
    assert processor.inputs() == {"latents"}
    components, _ = processor(None, *_prompts(3), latents=latents)
    torch.testing.assert_close(components[spec], -2.0 * latents.pow(2).flatten(1).mean(1))


def test_the_reward_and_judge_servers_refuse_latent_scorers():
    from flowforge.runtime.errors import UserError
    from flowforge.serve.judge_backends import ScorerBackend
    from flowforge.serve.reward_server import check_hosted

    with pytest.raises(ValueError, match=r"latent scorers \['lat'\].*requests carry pixels"):
        check_hosted({"lat": _Recorder("lat", latent=True)})
    with pytest.raises(UserError, match="takes latents"):
        ScorerBackend(_Recorder("lat", latent=True), "m")
