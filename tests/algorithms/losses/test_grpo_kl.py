"""flow_grpo's KL loss: parity with flow_grpo's formula (written out here), a hand-computed case, its relation to the
exact transition KL, the per-kind ``std_dev_t``, errors."""
import math

import pytest
import torch

from flowforge.algorithms import flow_match_sigmas, transition
from flowforge.algorithms.losses import flow_grpo_kl, transition_mean_kl
from flowforge.algorithms.sde import reference_std_dev_t, sde_diffusion_coefficient

diffusers = pytest.importorskip("diffusers")


def _flow_grpo_kl(mean, mean_ref, sigmas, step_index, noise_level):
    """flow_grpo, transcribed: ``sde_step_with_logprob`` (sde_type "sde") returns ``std_dev_t`` and
    ``scripts/train_sd3.py`` forms the KL loss from it. Returns the per-sample ``[B, 1, 1, 1]`` term before
    ``torch.mean``."""
    sigma = sigmas[step_index].view(-1, 1, 1, 1)
    sigma_max = sigmas[1].item()
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    return ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t ** 2)


def _means(dtype, b=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(b, 4, 6, 6, generator=g, dtype=dtype)
    return mean, mean + 0.05 * torch.randn(b, 4, 6, 6, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flow_grpo_kl_equals_flow_grpo_formula_bit_for_bit(dtype):
    sched = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    sched.set_timesteps(10)
    sigmas = sched.sigmas.to(dtype)
    step_index = torch.tensor([0, 1, 4, 7, 8])  # per-sample steps, step 0 has sigma == 1 (sigma_max branch)
    assert sigmas[0].item() == 1.0
    mean, mean_ref = _means(dtype)
    eta = 0.7
    ref = _flow_grpo_kl(mean, mean_ref, sigmas, step_index, eta)
    got = flow_grpo_kl(mean, mean_ref, sigmas[step_index], sigmas[step_index + 1], eta, sigma_max=sigmas[1])
    assert got.shape == (5,) and got.dtype == dtype
    torch.testing.assert_close(got, ref.flatten(), rtol=0, atol=0)
    torch.testing.assert_close(got.mean(), torch.mean(ref), rtol=0, atol=0)  # flow_grpo's kl_loss, beta's factor
    # sigma_max defaults to sigma_next, the same number at step 0.
    torch.testing.assert_close(flow_grpo_kl(mean, mean_ref, sigmas[step_index], sigmas[step_index + 1], eta), got,
                               rtol=0, atol=0)


def test_flow_grpo_kl_hand_computed():
    d = torch.tensor([0.1, -0.3], dtype=torch.float64).repeat(2, 1, 1, 1)  # [2, 1, 1, 2]: mean_el(d^2) = 0.05
    mean_ref = torch.zeros_like(d)
    # sigma 0.5 -> 0.25, eta 0.5: g = 0.5 sqrt(0.5 / 0.5) = 0.5, g^2 = 0.25: 0.05 / (2 * 0.25) = 0.1
    kl = flow_grpo_kl(d, mean_ref, 0.5, 0.25, 0.5)
    torch.testing.assert_close(kl, torch.full((2,), 0.1, dtype=torch.float64), rtol=1e-15, atol=0)
    # The exact transition KL divides by the transition variance g^2 (-dt) = 0.0625: 0.4 = 0.1 / (-dt).
    tv = sde_diffusion_coefficient(torch.tensor([0.5], dtype=torch.float64), 0.5)[0] ** 2 * 0.25
    torch.testing.assert_close(transition_mean_kl(d, mean_ref, tv.sqrt()), torch.full((2,), 0.4, dtype=torch.float64))
    # Step 0: sigma 1, sigma_next = sigma_max = 0.8, eta 0.7: g^2 = 0.49 / 0.2 = 2.45 -> 0.05 / 4.9
    kl0 = flow_grpo_kl(d, mean_ref, 1.0, 0.8, 0.7)
    torch.testing.assert_close(kl0, torch.full((2,), 0.05 / 4.9, dtype=torch.float64), rtol=1e-14, atol=0)


def test_flow_grpo_kl_is_minus_dt_times_the_transition_kl_for_sde_and_equal_for_cps_and_dance():
    f64 = torch.float64
    sig = flow_match_sigmas(12, 3.0).to(f64)
    g = torch.Generator().manual_seed(4)
    x, v = torch.randn(3, 2, 4, 4, generator=g, dtype=f64), torch.randn(3, 2, 4, 4, generator=g, dtype=f64)
    v_ref = v + 0.1 * torch.randn(3, 2, 4, 4, generator=g, dtype=f64)
    for i in (0, 3, 10):
        for kind, eta in (("sde", 0.7), ("cps", 0.6), ("dance", 0.9)):
            tr = transition(kind, x, v, sig[i], sig[i + 1], eta, x_next=x, sigma_max=sig[1])
            ref = transition(kind, x, v_ref, sig[i], sig[i + 1], eta, x_next=x, sigma_max=sig[1])
            exact = transition_mean_kl(tr.mean, ref.mean, tr.std)
            kl = flow_grpo_kl(tr.mean, ref.mean, sig[i], sig[i + 1], eta, kind=kind, sigma_max=sig[1])
            factor = -(sig[i + 1] - sig[i]).item() if kind == "sde" else 1.0
            torch.testing.assert_close(kl, exact * factor, rtol=1e-12, atol=0)
            if kind != "sde":  # std_dev_t is the transition std: the same numbers
                std_dev_t = reference_std_dev_t(kind, sig[i].expand(3), sig[i + 1].expand(3), eta)
                torch.testing.assert_close(std_dev_t, tr.std, rtol=0, atol=0)


def test_reference_std_dev_t_per_kind_and_errors():
    s, sn = torch.tensor([1.0, 0.5]), torch.tensor([0.8, 0.25])
    torch.testing.assert_close(reference_std_dev_t("sde", s, sn, 0.7),
                               torch.tensor([0.7 * math.sqrt(1 / 0.2), 0.7]), rtol=1e-6, atol=0)
    torch.testing.assert_close(reference_std_dev_t("cps", s, sn, 0.5), sn * math.sin(0.25 * math.pi))
    torch.testing.assert_close(reference_std_dev_t("dance", s, sn, 0.5), 0.5 * torch.sqrt(s - sn))
    with pytest.raises(ValueError, match="ode"):
        reference_std_dev_t("ode", s, sn, 0.5)
    mean = torch.zeros(2, 1, 2, 2)
    with pytest.raises(ValueError, match="std_dev_t"):
        flow_grpo_kl(mean, mean, 0.5, 0.25, 0.0)
    with pytest.raises(ValueError, match="std_dev_t"):
        flow_grpo_kl(mean, mean, 0.5, 0.0, 0.5, kind="cps")  # cps at the last step: std 0
    with pytest.raises(ValueError, match="shape"):
        flow_grpo_kl(mean, mean[:1], 0.5, 0.25, 0.7)
    with pytest.raises(ValueError, match="kind"):
        flow_grpo_kl(mean, mean, 0.5, 0.25, 0.7, kind="ode")


def test_flow_grpo_kl_gradient_flows_through_mean_only():
    mean, mean_ref = _means(torch.float64, b=2)
    mean.requires_grad_(True)
    mean_ref.requires_grad_(True)
    flow_grpo_kl(mean, mean_ref, 0.5, 0.25, 0.5).sum().backward()
    n = mean[0].numel()
    torch.testing.assert_close(mean.grad, (mean - mean_ref).detach() / (n * 0.25), rtol=1e-14, atol=0)
    assert mean_ref.grad is None
