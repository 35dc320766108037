"""Schedules: parity with diffusers, purity, Wan / dynamic shift, trained-step resolution, integer step addressing."""
import math

import pytest
import torch

from flowforge.algorithms import calculate_shift, flow_match_sigmas, resolve_trained_steps

diffusers = pytest.importorskip("diffusers")
Sched = diffusers.FlowMatchEulerDiscreteScheduler


@pytest.mark.parametrize("num_steps", [1, 2, 6, 10, 12, 28, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 7.3])
def test_static_shift_equals_diffusers(num_steps, shift):
    ref = Sched(num_train_timesteps=1000, shift=shift)
    ref.set_timesteps(num_steps)
    ours = flow_match_sigmas(num_steps, shift)
    assert ours.dtype == torch.float32 and ours.shape == (num_steps + 1,)
    assert ours[-1] == 0
    assert torch.equal(ours, ref.sigmas)


@pytest.mark.parametrize("num_steps", [4, 20, 28])
@pytest.mark.parametrize("image_seq_len", [256, 1024, 4096])
def test_dynamic_shift_equals_diffusers(num_steps, image_seq_len):
    mu = calculate_shift(image_seq_len)
    ref = Sched(num_train_timesteps=1000, use_dynamic_shifting=True)
    ref.set_timesteps(num_steps, mu=mu)
    ours = flow_match_sigmas(num_steps, mu=mu)
    assert torch.equal(ours, ref.sigmas)
    assert torch.equal(ours, flow_match_sigmas(num_steps, mu=mu, kind="dynamic"))


def test_calculate_shift_endpoints_and_linearity():
    assert calculate_shift(256) == pytest.approx(0.5, abs=1e-12)
    assert calculate_shift(4096) == pytest.approx(1.15, abs=1e-12)
    assert calculate_shift(2176) == pytest.approx(0.825, abs=1e-12)


def test_wan_schedule_formula():
    n, shift = 8, 5.0
    ours = flow_match_sigmas(n, kind="wan")  # shift defaults to 5 for wan
    base = torch.linspace(1, 0, n + 1, dtype=torch.float64)[:-1]
    expected = torch.cat([(shift * base / (1 + (shift - 1) * base)).float(), torch.zeros(1)])
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-7)
    assert ours[0] == 1 and ours[-1] == 0 and bool((ours[:-1] > 0).all())
    assert torch.equal(ours, flow_match_sigmas(n, 5.0, kind="wan"))
    assert not torch.equal(ours, flow_match_sigmas(n, 3.0, kind="wan"))


def test_schedule_is_pure_calling_twice_does_not_shift_twice():
    a = flow_match_sigmas(10, 3.0)
    b = flow_match_sigmas(10, 3.0)
    assert torch.equal(a, b)
    ref = Sched(num_train_timesteps=1000, shift=3.0)
    ref.set_timesteps(10)
    assert torch.equal(b, ref.sigmas)
    # an accidental second shift would differ from the single shift
    twice = 3.0 * a / (1 + 2.0 * a)
    assert not torch.equal(twice, a)
    a[:] = 0  # mutating a result does not leak into the next call
    assert torch.equal(flow_match_sigmas(10, 3.0), b)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_steps=10, kind="karras"), "static"),
    (dict(num_steps=0), "num_steps"),
    (dict(num_steps=10, shift=-1.0), "shift"),
    (dict(num_steps=10, mu=0.5, kind="wan"), "wan"),
    (dict(num_steps=10, kind="dynamic"), "mu"),
    (dict(num_steps=10, shift=3.0, mu=0.5), "mu"),
])
def test_schedule_bad_input_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        flow_match_sigmas(**kwargs)


def test_step_indices_survive_bf16_but_float_lookup_does_not():
    sigmas = flow_match_sigmas(1000, 3.0)
    t = sigmas[:-1] * 1000  # SD3-style native timesteps, 1000 of them
    stored = torch.arange(1000, dtype=torch.int64)
    t_bf16 = t.to(torch.bfloat16).float()
    looked_up = (t_bf16[:, None] - t[None, :]).abs().argmin(dim=1)
    wrong = (looked_up != stored).sum().item()
    assert wrong > 0, "expected bf16 rounding to break float lookup for some steps"
    # the stored integer index is exact: it addresses the original timestep and survives any integer round trip
    assert torch.equal(stored.to(torch.int32).to(torch.int64), stored)
    assert torch.equal(t[stored], t)


def test_resolve_stride_window():
    assert resolve_trained_steps(10) == list(range(9))
    assert resolve_trained_steps(10, num_sde_steps=3) == [0, 3, 6]
    assert resolve_trained_steps(10, num_sde_steps=2, fraction=(0.0, 0.5)) == [0, 2]
    assert resolve_trained_steps(10, fraction=(0.5, 1.0)) == [4, 5, 6, 7, 8]
    assert resolve_trained_steps(2) == [0]
    for n in range(2, 30):
        for k in range(1, n):
            out = resolve_trained_steps(n, num_sde_steps=k)
            assert out == sorted(set(out)) and len(out) == k and out[-1] < n - 1


def test_resolve_explicit_indices_sorted_dedup_and_last_step_rejected():
    assert resolve_trained_steps(10, indices=[5, 1, 5, 3], num_sde_steps=2) == [1, 3, 5]
    with pytest.raises(ValueError, match="degenerate"):
        resolve_trained_steps(10, indices=[2, 9])
    with pytest.raises(ValueError, match="allowed 0..8"):
        resolve_trained_steps(10, indices=[-1])
    with pytest.raises(ValueError):
        resolve_trained_steps(10, indices=[10])


def test_resolve_pool_resample_is_rank_consistent_and_seeded():
    pool = [0, 1, 2, 3, 4, 5, 6, 7]
    a = resolve_trained_steps(10, pool=pool, resample_seed=123, count=3, indices=[8])
    b = resolve_trained_steps(10, pool=pool, resample_seed=123, count=3)
    assert a == b and len(a) == 3 and a == sorted(set(a)) and set(a) <= set(pool)
    draws = {tuple(resolve_trained_steps(10, pool=pool, resample_seed=s, count=3)) for s in range(20)}
    assert len(draws) > 5
    assert len(resolve_trained_steps(10, pool=pool, resample_seed=1, num_sde_steps=2)) == 2
    assert resolve_trained_steps(10, pool=pool, resample_seed=1) == pool
    with pytest.raises(ValueError, match="resample_seed"):
        resolve_trained_steps(10, pool=pool)
    with pytest.raises(ValueError, match="degenerate"):
        resolve_trained_steps(10, pool=[0, 9], resample_seed=0)
    with pytest.raises(ValueError, match="count"):
        resolve_trained_steps(10, pool=pool, resample_seed=0, count=9)


def test_resolve_bad_fraction_and_too_many_steps():
    with pytest.raises(ValueError, match="fraction"):
        resolve_trained_steps(10, fraction=(0.6, 0.4))
    with pytest.raises(ValueError, match="exceeds"):
        resolve_trained_steps(10, num_sde_steps=10)
    assert not math.isnan(calculate_shift(1))
