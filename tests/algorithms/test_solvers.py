"""DPM-Solver++(2M): trajectory parity with diffusers' DPMSolverMultistepScheduler in its flow-matching mode and with
NVlabs DiffusionNFT's ``dpm_step`` (transcribed here), the 1st-order step is Euler, accuracy on a Gaussian, errors."""
import math

import numpy as np
import pytest
import torch

from flowforge.algorithms import flow_match_sigmas
from flowforge.algorithms.sde import euler_step
from flowforge.algorithms.solvers import data_prediction, dpm_solver_2_sample, dpm_solver_2m_step

diffusers = pytest.importorskip("diffusers")

SHAPE = (3, 2, 4, 4)


def _diffusers_trajectory(velocity_fn, x, sigmas):
    """diffusers' DPM-Solver++(2M), flow-matching mode, run on ``sigmas`` (written over its own schedule)."""
    sched = diffusers.DPMSolverMultistepScheduler(
        num_train_timesteps=1000, use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction",
        algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint", lower_order_final=True,
        final_sigmas_type="zero")
    sched.set_timesteps(sigmas.numel() - 1)
    assert sched.sigmas.shape == sigmas.shape
    sched.sigmas = sigmas.to(torch.float32).clone()  # its set_timesteps takes no sigmas; step() reads only these
    states = [x]
    for i, t in enumerate(sched.timesteps):
        x = sched.step(velocity_fn(x, sigmas[i]), t, x).prev_sample
        states.append(x)
    return torch.stack(states, dim=1)


def _nvlabs_trajectory(velocity_fn, x, sigmas):
    """NVlabs/DiffusionNFT ``solver.py`` ``run_sampling(solver="dpm2", determistic=True)``, transcribed: DDIM (eta 0)
    at the first and the last step, the log-SNR multistep update otherwise, coefficients in float64."""
    s64, preds, states = sigmas.to(torch.float64), [], [x]
    num = sigmas.numel() - 1
    for i in range(num):
        x0 = x - sigmas[i] * velocity_fn(x, sigmas[i])
        preds.append(x0)
        t, s = s64[i + 1], s64[i]
        if i == 0 or i == num - 1:
            x = (1 - t) * x0 + t * ((x - (1 - s) * x0) / s)
        else:
            lam = [torch.log(1 - u) - torch.log(u) for u in (t, s, s64[i - 1])]
            h, h_0 = lam[0] - lam[1], lam[1] - lam[2]
            d1 = (1.0 / (h_0 / h)) * (preds[-1] - preds[-2])
            x = (t / s) * x - ((1 - t) * (torch.exp(-h) - 1.0)) * x0 - 0.5 * ((1 - t) * (torch.exp(-h) - 1.0)) * d1
        states.append(x)
    return torch.stack(states, dim=1)


def _linear_fn():
    b = torch.randn(SHAPE[1:], generator=torch.Generator().manual_seed(7))
    return lambda x, s: -0.7 * x + b.to(x.dtype) + 0.3 * float(s)


def _mlp_fn():
    g = torch.Generator().manual_seed(8)
    n = math.prod(SHAPE[1:])
    w1, w2, c = torch.randn(16, n, generator=g) / 4, torch.randn(n, 16, generator=g) / 4, torch.randn(16, generator=g)

    def fn(x, s):
        h = torch.tanh(x.reshape(x.shape[0], -1) @ w1.T.to(x.dtype) + float(s) * c.to(x.dtype))
        return (h @ w2.T.to(x.dtype)).reshape(x.shape) + 0.5 * x
    return fn


def _schedules():
    # flowforge's default SD3 schedule, and NVlabs' (shifted linspace(1, 1/T, T), flowforge kind "wan").
    return [flow_match_sigmas(10, 3.0), flow_match_sigmas(12, 3.0, kind="wan"), flow_match_sigmas(25, 3.0, kind="wan")]


@pytest.mark.parametrize("make_fn", [_linear_fn, _mlp_fn])
def test_dpm_solver_2_trajectory_matches_diffusers(make_fn):
    fn = make_fn()
    for k, sigmas in enumerate(_schedules()):
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(k))
        ref = _diffusers_trajectory(fn, x, sigmas)
        x0, states = dpm_solver_2_sample(fn, x, sigmas, return_trajectory=True)
        assert states.shape == ref.shape and states.dtype == torch.float32
        torch.testing.assert_close(x0, states[:, -1], rtol=0, atol=0)
        # float32 rounding only (diffusers forms its coefficients in float32, flowforge in float64): measured
        # max |diff| 3.6e-7 .. 3.8e-6 on trajectories of magnitude 2.8 .. 7.5.
        torch.testing.assert_close(states, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("make_fn", [_linear_fn, _mlp_fn])
def test_dpm_solver_2_trajectory_matches_nvlabs_dpm_step_in_float64(make_fn):
    fn = make_fn()
    for k, sigmas in enumerate(_schedules()):
        sig = sigmas.to(torch.float64)
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
        _, states = dpm_solver_2_sample(fn, x, sig, return_trajectory=True)
        assert states.dtype == torch.float64
        torch.testing.assert_close(states, _nvlabs_trajectory(fn, x, sig), rtol=1e-12, atol=1e-12)


def test_nvlabs_schedule_is_flowforge_wan_kind():
    sched = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 10, 10))  # NVlabs pipeline_with_logprob, SD3
    torch.testing.assert_close(sched.sigmas, flow_match_sigmas(10, 3.0, kind="wan"), rtol=0, atol=1.2e-7)


def test_first_order_step_is_euler_and_last_step_returns_the_data_prediction():
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(SHAPE, generator=g, dtype=torch.float64), torch.randn(SHAPE, generator=g, dtype=torch.float64)
    for s, sn in ((1.0, 0.9), (0.6, 0.45), (0.3, 0.0)):
        x0 = data_prediction(x, v, s)
        torch.testing.assert_close(dpm_solver_2m_step(x, x0, s, sn), euler_step(x, v, s, sn), rtol=1e-14, atol=1e-14)
    x0 = data_prediction(x, v, 0.2)
    assert torch.equal(dpm_solver_2m_step(x, x0, 0.2, 0.0, x0_hat_prev=x0 + 1, sigma_prev=0.4), x0)
    # sigma_prev == 1 (step 1 of a schedule from pure noise): the 2nd-order correction has no weight.
    torch.testing.assert_close(dpm_solver_2m_step(x, x0, 0.8, 0.6, x0_hat_prev=x0 + 1, sigma_prev=1.0),
                               dpm_solver_2m_step(x, x0, 0.8, 0.6), rtol=0, atol=0)


def test_dpm_solver_2_beats_euler_on_a_gaussian_with_the_nvlabs_schedule():
    # Data N(0, 1) per element: the exact velocity is v(x, s) = x (2 s - 1) / r^2 with r^2 = (1 - s)^2 + s^2, and the
    # ODE carries pure noise x_T to x_0 = x_T exactly.
    f64 = torch.float64

    def v_exact(x, s):
        s = float(s)
        return x * (2 * s - 1) / ((1 - s) ** 2 + s**2)

    x_t = torch.randn(4, 1, 8, 8, dtype=f64, generator=torch.Generator().manual_seed(0))
    sig = flow_match_sigmas(10, 1.0, kind="wan").to(f64)
    err_dpm = (dpm_solver_2_sample(v_exact, x_t, sig) - x_t).abs().max().item()
    xe = x_t
    for i in range(10):
        xe = euler_step(xe, v_exact(xe, sig[i]), sig[i], sig[i + 1])
    err_euler = (xe - x_t).abs().max().item()
    assert err_dpm < 0.01 < 0.3 < err_euler  # measured 2.3e-3 vs 0.38


def test_dpm_solver_errors():
    x = torch.zeros(SHAPE)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        dpm_solver_2m_step(x, x, 0.5, 0.5)
    with pytest.raises(ValueError, match="both"):
        dpm_solver_2m_step(x, x, 0.5, 0.4, x0_hat_prev=x)
    with pytest.raises(ValueError, match="sigma_prev"):
        dpm_solver_2m_step(x, x, 0.5, 0.4, x0_hat_prev=x, sigma_prev=0.45)
    with pytest.raises(ValueError, match="shape"):
        dpm_solver_2m_step(x, x[:1], 0.5, 0.4)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dpm_solver_2m_step(x, x, 1.5, 0.4)
    with pytest.raises(ValueError, match="one level"):
        dpm_solver_2m_step(x, x, torch.tensor([0.5, 0.5]), 0.4)
    with pytest.raises(ValueError, match="ending in 0"):
        dpm_solver_2_sample(lambda z, s: z, x, torch.tensor([1.0, 0.5, 0.1]))
    with pytest.raises(ValueError, match="decreasing"):
        dpm_solver_2_sample(lambda z, s: z, x, torch.tensor([1.0, 0.5, 0.6, 0.0]))
