"""Deterministic 2nd-order sampler of the flow ODE: multistep DPM-Solver++(2M) in data prediction.

What
    ``dpm_solver_2m_step`` takes one step ``x (sigma) -> x_next (sigma_next)`` from the current and the previous
    data predictions ``x0_hat = x - sigma v``; ``dpm_solver_2_update`` is step ``i`` of a schedule from the velocity
    (what a denoising loop calls, :func:`flowforge.rollout.denoise` with ``RolloutSpec(solver="dpm2")``);
    ``dpm_solver_2_sample`` runs a whole schedule from noise with a velocity callable and returns the sample
    (optionally every iterate).

Why
    DiffusionNFT trains on the forward process, so its rollouts need only clean samples, not per-step likelihoods;
    NVlabs samples them deterministically with this 2nd-order solver, which is more accurate than Euler at the same
    number of model calls (one per step).

Equations (flow matching as a diffusion with ``alpha = 1 - sigma``; half log-SNR ``lambda(sigma) = log((1 - sigma) /
sigma)``, ``-inf`` at ``sigma = 1``, ``+inf`` at ``sigma = 0``; step ``sigma -> sigma_next``, previous level
``sigma_prev``)::

    h      = lambda(sigma_next) - lambda(sigma)          h_0 = lambda(sigma) - lambda(sigma_prev)      r0 = h_0 / h
    E      = -(1 - sigma_next) * (exp(-h) - 1)           (= 1 - sigma_next / sigma)
    1st    x_next = (sigma_next / sigma) x + E * x0_hat              (= the Euler step x + (sigma_next - sigma) v)
    2nd    x_next = (sigma_next / sigma) x + E * x0_hat + 0.5 E * (x0_hat - x0_hat_prev) / r0

Schedule handling (as diffusers with ``lower_order_final`` and ``final_sigmas_type="zero"``, and NVlabs ``dpm_step``):
the first step is 1st order (no previous prediction); the last step (``sigma_next == 0``) is 1st order and returns
``x0_hat`` exactly; every other step is 2nd order. A previous level ``sigma_prev == 1`` has ``h_0 = inf``, so the
2nd-order correction of step 1 vanishes (also in the references): with a schedule starting at 1 the solver is 2nd
order from step 2 on. Coefficients are computed in float64 (python floats, as NVlabs' ``sigmas.to(float64)``) and
applied in the compute dtype.

Which schedule: NVlabs' released path (``scripts/train_nft_sd3.py``, SD3 only, ``model_type="sd3"``) calls
``pipeline_with_logprob``, which takes ``retrieve_timesteps(scheduler, T, sigmas=None)`` and then
``scheduler.sigmas``: the SD3 ``FlowMatchEulerDiscreteScheduler``'s static shifted schedule (shift 3), flowforge's
``flow_match_sigmas(T, shift, kind="static")``. A shifted ``linspace(1, 1 / T, T)`` appears there only in the FLUX
branch (with a dynamic ``mu``), which no released script runs. flowforge's own measurement, not a claim about NVlabs:
the static schedule's last nonzero level is tiny (0.009 for 10 steps, shift 3), so its next-to-last step spans a
log-SNR gap 4.6 times the step before it (``h / h_0``, the weight of the 2nd-order term), which amplifies the
data-prediction error: on N(0, 1) data with the exact velocity, 10 steps, shift 3, the final error is 1.15
("static") against 0.14 ("wan", the shifted ``linspace(1, 0, T + 1)[:-1]``; Euler 0.57 / 0.53). With a trained
model's (smaller) error the difference is smaller; preflight warns so the choice is a deliberate one.

Notation
    ================  =========================================================================================
    ``x``             latent at ``sigma``, ``[B, *latent]``; ``v`` the velocity (``noise - x0`` convention)
    ``x0_hat``        data prediction ``x - sigma v`` at ``sigma``; ``x0_hat_prev`` the one at ``sigma_prev``
    ``sigmas``        schedule ``[T + 1]``, strictly decreasing, ``sigmas[0] <= 1``, ``sigmas[T] == 0``
    ================  =========================================================================================

Dtypes: float32 whatever the input dtype (bf16 / fp16 upcast), float64 inputs stay float64.

Sources: Lu et al. 2022, "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion Probabilistic Models"
(arXiv 2211.01095, Algorithm 2, multistep 2nd order); diffusers ``DPMSolverMultistepScheduler`` (``algorithm_type=
"dpmsolver++"``, ``solver_order=2``, ``solver_type="midpoint"``, ``use_flow_sigmas=True``, ``prediction_type=
"flow_prediction"``: ``dpm_solver_first_order_update`` / ``multistep_dpm_solver_second_order_update``);
NVlabs/DiffusionNFT ``flow_grpo/diffusers_patch/solver.py`` (``run_sampling`` with ``solver="dpm2"``, ``dpm_step``:
the sampler of every ``config/nft.py`` configuration).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import torch

from .common import compute_dtype

__all__ = ["data_prediction", "dpm_solver_2m_step", "dpm_solver_2_update", "dpm_solver_2_sample"]

Scalar = Union[float, torch.Tensor]
VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _scalar(value: Scalar, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a python float or a 1-element tensor (one level for the batch), got "
                             f"shape {tuple(value.shape)}")
        value = value.item()
    value = float(value)
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a noise level in [0, 1], got {value}")
    return value


def _half_log_snr(sigma: float) -> float:
    """``lambda(sigma) = log((1 - sigma) / sigma)``; ``-inf`` at 1 and ``+inf`` at 0 (where ``math.log`` raises)."""
    if sigma == 1.0:
        return -math.inf
    if sigma == 0.0:
        return math.inf
    return math.log(1.0 - sigma) - math.log(sigma)


def data_prediction(x: torch.Tensor, velocity: torch.Tensor, sigma: Scalar) -> torch.Tensor:
    """``x0_hat = x - sigma * v`` (the flow model's data prediction), ``[B, *latent]`` in the compute dtype.

    Raises: ValueError if ``x`` and ``velocity`` differ in shape, or ``sigma`` is not one level in [0, 1].
    Source: diffusers ``DPMSolverMultistepScheduler.convert_model_output`` (``flow_prediction``).
    """
    if x.shape != velocity.shape:
        raise ValueError(f"x and velocity must have the same shape, got {tuple(x.shape)} and {tuple(velocity.shape)}")
    dtype = compute_dtype(x, velocity)
    return x.to(dtype) - _scalar(sigma, "sigma") * velocity.to(dtype)


def dpm_solver_2m_step(
    x: torch.Tensor,
    x0_hat: torch.Tensor,
    sigma: Scalar,
    sigma_next: Scalar,
    *,
    x0_hat_prev: Optional[torch.Tensor] = None,
    sigma_prev: Optional[Scalar] = None,
) -> torch.Tensor:
    """One DPM-Solver++(2M) step ``x (sigma) -> x_next (sigma_next)`` (equations in the module docstring).

    Args:
        x: ``[B, *latent]`` latent at ``sigma``. x0_hat: same shape, its data prediction (:func:`data_prediction`).
        sigma, sigma_next: python floats or 1-element tensors, ``0 <= sigma_next < sigma <= 1``.
        x0_hat_prev, sigma_prev: the previous step's data prediction and level (``sigma < sigma_prev <= 1``);
            both None gives the 1st-order step (the first step of a schedule). Ignored when ``sigma_next == 0``
            (the last step is 1st order and returns ``x0_hat``).
    Returns:
        ``x_next`` ``[B, *latent]``, float32 (float64 if an input is float64).
    Raises:
        ValueError: shape mismatch; levels outside [0, 1] or not decreasing; only one of ``x0_hat_prev`` /
            ``sigma_prev`` given.
    Source: diffusers ``DPMSolverMultistepScheduler`` (``dpmsolver++``, order 2, midpoint, flow sigmas); Lu et al.
        2022 (arXiv 2211.01095); NVlabs/DiffusionNFT ``solver.py`` ``dpm_step``.
    """
    s, sn = _scalar(sigma, "sigma"), _scalar(sigma_next, "sigma_next")
    if not sn < s:
        raise ValueError(f"need sigma_next < sigma (a denoising step), got sigma={s}, sigma_next={sn}")
    if (x0_hat_prev is None) != (sigma_prev is None):
        raise ValueError("pass both x0_hat_prev and sigma_prev (2nd order) or neither (1st order)")
    tensors = [x, x0_hat] + ([] if x0_hat_prev is None else [x0_hat_prev])
    if any(t.shape != x.shape for t in tensors) or x.ndim < 2:
        raise ValueError(f"x, x0_hat and x0_hat_prev must share a [B, *latent] shape, got "
                         f"{[tuple(t.shape) for t in tensors]}")
    dtype = compute_dtype(*tensors)
    h = _half_log_snr(sn) - _half_log_snr(s)
    e = -(1.0 - sn) * (math.exp(-h) - 1.0)
    x_next = (sn / s) * x.to(dtype) + e * x0_hat.to(dtype)
    if x0_hat_prev is None or sn == 0.0:
        return x_next
    sp = _scalar(sigma_prev, "sigma_prev")
    if not s < sp:
        raise ValueError(f"need sigma < sigma_prev, got sigma={s}, sigma_prev={sp}")
    h_0 = _half_log_snr(s) - _half_log_snr(sp)
    if math.isinf(h_0):
        # sigma_prev == 1: r0 = inf, the finite difference has no weight (diffusers and NVlabs get 0 the same way).
        return x_next
    return x_next + (0.5 * e * h / h_0) * (x0_hat.to(dtype) - x0_hat_prev.to(dtype))


def dpm_solver_2_update(
    x: torch.Tensor, velocity: torch.Tensor, sigmas: torch.Tensor, i: int, x0_hat_prev: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step ``i`` (``sigmas[i] -> sigmas[i + 1]``) of DPM-Solver++(2M) sampling from the velocity at ``x``.

    Args:
        x: ``[B, *latent]`` iterate at ``sigmas[i]``. velocity: its velocity (same shape, ``noise - x0`` convention).
        sigmas: the ``[T + 1]`` schedule (keep it on the CPU: its entries are read as python floats).
        i: the step index, ``0 <= i < T``.
        x0_hat_prev: the data prediction step ``i - 1`` returned (None at step 0, or after a step that was not a
            DPM-Solver step: this step is then 1st order).
    Returns:
        ``(x_next, x0_hat)``: the iterate at ``sigmas[i + 1]`` and this step's data prediction (pass it as the next
        step's ``x0_hat_prev``), float32 (float64 for float64 input).
    Raises:
        ValueError: as :func:`dpm_solver_2m_step`; ``i`` outside ``[0, T)``; ``x0_hat_prev`` given at step 0.
    Source: as :func:`dpm_solver_2m_step`.
    """
    if not 0 <= i < sigmas.shape[0] - 1:
        raise ValueError(f"step index {i} outside [0, {sigmas.shape[0] - 1})")
    if i == 0 and x0_hat_prev is not None:
        raise ValueError("step 0 has no previous data prediction (x0_hat_prev must be None)")
    x0_hat = data_prediction(x, velocity, sigmas[i])
    prev = {} if x0_hat_prev is None else {"x0_hat_prev": x0_hat_prev, "sigma_prev": sigmas[i - 1]}
    return dpm_solver_2m_step(x, x0_hat, sigmas[i], sigmas[i + 1], **prev), x0_hat


def dpm_solver_2_sample(
    velocity_fn: VelocityFn, x: torch.Tensor, sigmas: torch.Tensor, *, return_trajectory: bool = False
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic DPM-Solver++(2M) sampling of the flow ODE from ``x`` at ``sigmas[0]`` down to ``sigmas[T] = 0``.

    Args:
        velocity_fn: ``(x [B, *latent], sigma 0-d tensor) -> v [B, *latent]``, called once per step with the current
            iterate (compute dtype) and the schedule's ``sigmas[i]`` (broadcast it to ``[B]`` for an adapter).
        x: ``[B, *latent]`` start latent (pure noise when ``sigmas[0] == 1``).
        sigmas: ``[T + 1]`` schedule, strictly decreasing, in [0, 1], ending in 0 (``schedules.flow_match_sigmas``).
        return_trajectory: also return every iterate.
    Returns:
        ``x0`` ``[B, *latent]`` (float32, float64 for float64 input), or ``(x0, states)`` with ``states``
        ``[B, T + 1, *latent]`` (``states[:, 0] = x``, ``states[:, T] = x0``).
    Raises:
        ValueError: ``sigmas`` not 1-d with at least 2 entries, not strictly decreasing, outside [0, 1], or not
            ending in 0; a velocity of the wrong shape.
    Source: NVlabs/DiffusionNFT ``solver.py`` ``run_sampling(solver="dpm2", determistic=True)``; diffusers
        ``DPMSolverMultistepScheduler`` (same trajectory, checked in the tests).
    """
    sig = sigmas.detach().cpu()
    if sig.ndim != 1 or sig.numel() < 2 or not bool((sig[1:] < sig[:-1]).all()) or sig[-1].item() != 0.0:
        raise ValueError(f"sigmas must be a strictly decreasing [T + 1] schedule ending in 0, got {sig.tolist()}")
    dtype = compute_dtype(x)
    cur = x.to(dtype)
    states = [cur]
    x0_prev: Optional[torch.Tensor] = None
    for i in range(sig.numel() - 1):
        cur, x0_prev = dpm_solver_2_update(cur, velocity_fn(cur, sigmas[i]), sig, i, x0_prev)
        states.append(cur)
    if return_trajectory:
        return cur, torch.stack(states, dim=1)
    return cur
