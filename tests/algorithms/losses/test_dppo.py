"""Flow-DPPO loss: parity with the paper / reference formula written here in float64 loops, a hand-computed case,
the first update (ratio 1, nothing masked), the threshold, the asymmetric direction rule, zero gradient where masked.
"""
import math

import pytest
import torch

from flowforge.algorithms.losses import dppo_loss, grpo_clip_loss
from flowforge.algorithms.sde import transition
from tests.algorithms.losses.helpers import F64, randn

torch.set_num_threads(1)


def _reference(log_prob, old_log_prob, adv, mean, old_mean, std, delta):
    """Arithmetic straight from Flow-DPPO (arXiv 2606.11025, Eq. 14 with a mean over elements as in UniRL's
    ``_flowdppo_kl_adv_loss``, Eq. 18), one (sample, step) element at a time in python floats.

    Returns (loss, d loss / d log_prob as nested lists, masked flags, step KLs).
    """
    b, s = log_prob.shape
    n = b * s
    total, grad, masked, kls = 0.0, [[0.0] * s for _ in range(b)], [[False] * s for _ in range(b)], []
    for i in range(b):
        for k in range(s):
            ratio = math.exp(float(log_prob[i, k]) - float(old_log_prob[i, k]))
            diff = (mean[i, k] - old_mean[i, k]).flatten().tolist()
            sd = float(std[i, k])
            kl = sum(d * d for d in diff) / len(diff) / (2.0 * sd * sd)
            kls.append(kl)
            a = float(adv[i])
            drop = kl >= delta and ((ratio > 1.0 and a > 0) or (ratio < 1.0 and a < 0))
            masked[i][k] = drop
            if not drop:
                total += -a * ratio
                grad[i][k] = -a * ratio / n
    return total / n, grad, masked, kls


def _inputs(seed, b=6, s=3, dtype=F64):
    old_lp = -1.0 + 0.1 * randn(seed, b, s)
    lp = old_lp + 0.02 * randn(seed + 1, b, s)
    old_mean = randn(seed + 2, b, s, 2, 4)
    # per-sample shift sizes spread the KL across the threshold
    scale = torch.tensor([0.0, 0.01, 0.03, 0.05, 0.08, 0.12], dtype=F64)[:b].view(b, 1, 1, 1)
    mean = old_mean + scale * randn(seed + 3, b, s, 2, 4)
    std = 0.2 + 0.3 * torch.rand(b, s, generator=torch.Generator().manual_seed(seed + 4), dtype=F64)
    adv = torch.tensor([1.0, -1.5, 0.7, -0.3, 2.0, -0.8], dtype=F64)[:b]
    return tuple(t.to(dtype) for t in (lp, old_lp, adv, mean, old_mean, std))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_parity_with_the_reference_formula_on_random_inputs(dtype):
    worst_loss, worst_grad, any_masked, any_kept_outside = 0.0, 0.0, False, False
    for seed in range(5):
        lp, old_lp, adv, mean, old_mean, std = _inputs(10 * seed, dtype=dtype)
        delta = 0.01
        lp = lp.clone().requires_grad_(True)
        loss, m = dppo_loss(lp, old_lp, adv, mean=mean, old_mean=old_mean, std=std, delta=delta)
        loss.backward()
        f64 = [t.detach().double() for t in (lp, old_lp, adv, mean, old_mean, std)]
        ref_loss, ref_grad, ref_masked, kls = _reference(*f64, delta)
        worst_loss = max(worst_loss, abs(loss.item() - ref_loss))
        worst_grad = max(worst_grad, (lp.grad.double() - torch.tensor(ref_grad, dtype=F64)).abs().max().item())
        flat_masked = [x for row in ref_masked for x in row]
        any_masked |= any(flat_masked)
        any_kept_outside |= any(kl >= delta and not x for kl, x in zip(kls, flat_masked))
        assert m["masked_fraction"].item() == pytest.approx(sum(flat_masked) / len(flat_masked), abs=1e-7)
        assert m["step_kl_max"].item() == pytest.approx(max(kls), rel=1e-5)
        assert m["step_kl_mean"].item() == pytest.approx(sum(kls) / len(kls), rel=1e-5)
    print(f"dppo parity {dtype}: max |loss - ref| = {worst_loss:.3e}, max |grad - ref| = {worst_grad:.3e}")
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert worst_loss <= tol and worst_grad <= tol
    assert any_masked and any_kept_outside  # the inputs exercise both branches of the mask


def test_hand_computed_case():
    # std 0.5 and 2 latent elements: KL = mean(shift^2) / (2 * 0.25) = mean(shift^2) * 2
    old_mean = torch.zeros(4, 2, dtype=F64)
    mean = torch.tensor([[0.1, 0.0], [0.0, 0.0], [0.2, 0.0], [0.0, 0.3]], dtype=F64)  # KL 0.01, 0, 0.04, 0.09
    lp = torch.log(torch.tensor([1.2, 0.9, 0.8, 0.7], dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5], dtype=F64)
    loss, m = dppo_loss(lp, torch.zeros(4, dtype=F64), adv, mean=mean, old_mean=old_mean, std=0.5, delta=0.005)
    # 0: outside, ratio > 1, A > 0 -> masked     1: inside -> -(-1)(0.9) = 0.9
    # 2: outside but corrective (A > 0, ratio < 1) -> -(2)(0.8) = -1.6     3: outside, ratio < 1, A < 0 -> masked
    assert loss.item() == pytest.approx((0.0 + 0.9 - 1.6 + 0.0) / 4, abs=1e-15)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, 0.9 / 4, -1.6 / 4, 0.0], dtype=F64), rtol=0, atol=1e-15)
    assert m["masked_fraction"].item() == 0.5
    assert m["masked_positive_fraction"].item() == 0.25 and m["masked_negative_fraction"].item() == 0.25
    assert m["step_kl_exceeded_fraction"].item() == 0.75
    assert m["step_kl_mean"].item() == pytest.approx(0.035, abs=1e-15)
    assert m["step_kl_max"].item() == pytest.approx(0.09, abs=1e-15)
    assert m["ratio_min"].item() == pytest.approx(0.7) and m["ratio_max"].item() == pytest.approx(1.2)
    assert all(not t.requires_grad and t.ndim == 0 for t in m.values())


@pytest.mark.parametrize("two_d", [False, True])
def test_first_update_ratio_is_exactly_one_and_nothing_is_masked(two_d):
    x = randn(0, 4, 2, 3, 3)
    v = randn(1, 4, 2, 3, 3)
    old = transition("sde", x, v, 0.7, 0.55, 0.8, noise=randn(2, 4, 2, 3, 3))
    live = transition("sde", x, v.clone().requires_grad_(True), 0.7, 0.55, 0.8, x_next=old.x_next)
    lp_live, lp_old, mean, old_mean, std = live.log_prob, old.log_prob, live.mean, old.mean, old.std
    if two_d:
        lp_live, lp_old, std = lp_live[:, None], lp_old[:, None], std[:, None]
        mean, old_mean = mean[:, None], old_mean[:, None]
    adv = torch.tensor([1.0, -2.0, 0.5, -0.1], dtype=F64)
    lp = lp_live.detach().clone().requires_grad_(True)
    loss, m = dppo_loss(lp, lp_old, adv, mean=mean, old_mean=old_mean, std=std, delta=1e-30)
    assert m["ratio_mean"].item() == 1.0 and m["ratio_min"].item() == 1.0 and m["ratio_max"].item() == 1.0
    assert m["approx_kl"].item() == 0.0 and m["step_kl_max"].item() == 0.0
    assert m["masked_fraction"].item() == 0.0 and m["step_kl_exceeded_fraction"].item() == 0.0
    loss.backward()
    lp_g = lp.detach().clone().requires_grad_(True)
    g_loss, _ = grpo_clip_loss(lp_g, lp_old, adv, 1e-4)
    g_loss.backward()
    assert loss.item() == g_loss.item() == pytest.approx(-adv.mean().item(), abs=1e-15)
    torch.testing.assert_close(lp.grad, lp_g.grad, rtol=0, atol=0)


def test_mask_starts_exactly_at_the_threshold():
    # one element per step, std 1: KL = shift^2 / 2
    delta = 0.02
    kls = torch.tensor([0.5, 0.99, 1.0, 1.01, 2.0], dtype=F64) * delta
    mean = torch.sqrt(2 * kls)[:, None]
    lp = torch.full((5,), 0.01, dtype=F64, requires_grad=True)  # ratio > 1 with A > 0: the outward direction
    loss, m = dppo_loss(lp, torch.zeros(5, dtype=F64), torch.ones(5, dtype=F64), mean=mean,
                        old_mean=torch.zeros(5, 1, dtype=F64), std=1.0, delta=delta)
    loss.backward()
    computed = (mean[:, 0] ** 2) / 2  # the KL as the loss computes it (rounding decides the == case)
    expected_masked = computed >= delta
    assert expected_masked.tolist()[:2] == [False, False] and expected_masked.tolist()[3:] == [True, True]
    assert (lp.grad == 0).tolist() == expected_masked.tolist()
    assert m["masked_fraction"].item() == pytest.approx(expected_masked.double().mean().item())


@pytest.mark.parametrize("lp_value,adv_value,masked", [
    (0.01, 1.0, True),     # pushing a good step's probability up: outward
    (-0.01, -1.0, True),   # pushing a bad step's probability down: outward
    (-0.01, 1.0, False),   # good step whose probability fell: corrective, kept
    (0.01, -1.0, False),   # bad step whose probability rose: corrective, kept
    (0.01, 0.0, False),    # zero advantage: never masked
    (0.0, 1.0, False),     # ratio exactly 1: never masked
])
def test_only_outward_moves_beyond_the_threshold_are_masked(lp_value, adv_value, masked):
    mean = torch.full((1, 4), 10.0, dtype=F64)  # KL 50, far beyond delta
    lp = torch.tensor([lp_value], dtype=F64, requires_grad=True)
    adv = torch.tensor([adv_value], dtype=F64)
    loss, m = dppo_loss(lp, torch.zeros(1, dtype=F64), adv, mean=mean, old_mean=torch.zeros(1, 4, dtype=F64),
                        std=1.0, delta=1e-3)
    loss.backward()
    assert m["masked_fraction"].item() == float(masked)
    expected = 0.0 if masked else -adv_value * math.exp(lp_value)
    assert lp.grad.item() == pytest.approx(expected, abs=1e-15)
    assert loss.item() == pytest.approx(expected, abs=1e-15)


def test_masked_overflowing_ratio_stays_finite_and_no_gradient_reaches_the_mean():
    lp = torch.tensor([[200.0, 0.0]], requires_grad=True)  # exp(200) is inf in float32
    mean = torch.ones(1, 2, 3, requires_grad=True)
    loss, m = dppo_loss(lp, torch.zeros(1, 2), torch.ones(1), mean=mean, old_mean=torch.zeros(1, 2, 3), std=0.1,
                        delta=1e-3)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(-0.5)
    loss.backward()
    assert lp.grad.tolist() == [[0.0, -0.5]] and mean.grad is None
    assert m["masked_fraction"].item() == 0.5 and m["ratio_max"].item() == math.inf


def test_advantages_per_step_adv_clip_dtype_and_errors():
    lp, old_lp, adv, mean, old_mean, std = _inputs(3)
    a, _ = dppo_loss(lp, old_lp, adv, mean=mean, old_mean=old_mean, std=std, delta=0.01)
    b, _ = dppo_loss(lp, old_lp, adv[:, None].expand_as(lp), mean=mean, old_mean=old_mean, std=std, delta=0.01)
    assert a.item() == b.item()
    c, _ = dppo_loss(lp, old_lp, adv, mean=mean, old_mean=old_mean, std=std, delta=0.01, adv_clip=0.5)
    d, _ = dppo_loss(lp, old_lp, adv.clamp(-0.5, 0.5), mean=mean, old_mean=old_mean, std=std, delta=0.01)
    assert c.item() == d.item() != a.item()
    loss, m = dppo_loss(lp.to(torch.bfloat16), old_lp.float(), adv.float(), mean=mean.float(),
                        old_mean=old_mean.float(), std=0.3, delta=math.inf)
    assert loss.dtype == torch.float32 and m["masked_fraction"].item() == 0.0
    kw = dict(mean=mean, old_mean=old_mean, std=std)
    with pytest.raises(ValueError, match="delta"):
        dppo_loss(lp, old_lp, adv, **kw, delta=0.0)
    with pytest.raises(ValueError, match="std must be > 0"):
        dppo_loss(lp, old_lp, adv, mean=mean, old_mean=old_mean, std=0.0, delta=0.01)
    with pytest.raises(ValueError, match="std must be a float"):
        dppo_loss(lp, old_lp, adv, mean=mean, old_mean=old_mean, std=std[:, :1], delta=0.01)
    with pytest.raises(ValueError, match="mean and old_mean"):
        dppo_loss(lp, old_lp, adv, mean=mean, old_mean=old_mean[:, :2], std=std, delta=0.01)
    with pytest.raises(ValueError, match="advantages"):
        dppo_loss(lp, old_lp, adv[:3], **kw, delta=0.01)
    with pytest.raises(ValueError, match="adv_clip"):
        dppo_loss(lp, old_lp, adv, **kw, delta=0.01, adv_clip=0.0)
