"""Transition kernels of the stochastic / deterministic flow-matching samplers, with their log-densities.

What
    One denoising step ``x (at sigma) -> x_next (at sigma_next)`` given the model's velocity, as a Gaussian
    ``x_next ~ N(mean, std^2 I)``. ``transition`` either samples ``x_next`` or scores a given one (the training-time
    re-evaluation of a stored rollout step) and returns ``Transition(x_next, mean, std, log_prob)``.

Why
    Policy-gradient methods (FlowGRPO, DanceGRPO, ...) need the log-probability of each stored step under the current
    policy. The log-prob is the Gaussian log-density **averaged (mean over elements)** over all non-batch elements, in
    fp32: a sum over a 16x16x16 latent would make ``exp(logp - logp_old)`` overflow; the mean sets the clip scale
    (~1e-4).

Equations (``dt = sigma_next - sigma < 0``; ``x0_hat = x - sigma v``; per-element, broadcast over ``[B, *latent]``)
    kind "sde" (FlowGRPO, the reverse SDE of the flow ODE)::

        g       = eta * sqrt(sigma / (1 - sigma'))     sigma' = sigma, except sigma' = sigma_max when sigma == 1
        mean    = x * (1 + g^2 / (2 sigma) * dt) + v * (1 + g^2 (1 - sigma) / (2 sigma)) * dt
        std     = g * sqrt(-dt)                          # the per-step transition std

      ``g`` (flow_grpo's ``std_dev_t``) is the SDE diffusion coefficient, NOT the transition std. At step 0
      (``sigma == 1``) with ``sigma_max = sigmas[1] = sigma_next``: ``std = eta * sqrt(1 / (1 - sigma_next)) *
      sqrt(1 - sigma_next) = eta`` exactly (up to rounding), while ``g = eta / sqrt(1 - sigma_next)`` is large
      (3.90 for 12 steps, shift 3, eta 0.7).
    kind "dance" (DanceGRPO ``flux_step``, ``sde_solver=True``)::

        score   = -(x - (1 - sigma) x0_hat) / sigma^2
        mean    = x + v dt - 0.5 eta^2 score dt
        std     = eta * sqrt(sigma - sigma_next)
    kind "cps" (flow_grpo coefficients-preserving sampling)::

        std     = sigma_next * sin(eta * pi / 2)
        mean    = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2) * (x + (1 - sigma) v)
    kind "ode" (Euler, the deterministic sampler)::

        mean    = x + v dt,   std = 0,   log_prob = None

    Log-density (kinds "sde", "dance", and "cps" with ``cps_log_prob="gaussian"``)::

        log_prob = mean_over_elements( -(x_next - mean)^2 / (2 std^2) - log(std) - log(sqrt(2 pi)) )
    No epsilon is added to ``std`` (flow_grpo adds none here; the golden vectors confirm).
    CPS reference mode (``cps_log_prob="unnormalized"``, the default, as flow_grpo codes it)::

        log_prob = -mean_over_elements( (x_next - mean)^2 )
    which is NOT a normalized density: it drops ``1 / (2 std^2)`` and the constants. The ratio
    ``exp(logp - logp_old)`` is then a different quantity from the Gaussian likelihood ratio; it is kept because it is
    what flow_grpo trains with (and it is defined at the last step, where ``std == 0``).

Degenerate steps
    The last step of a schedule (``sigma_next == 0``) is never trained. For "cps" its std is 0 (so is every step's
    std with ``eta == 0``, and every "ode" step). Asking for a Gaussian log-prob with ``std == 0`` raises
    ``ValueError``; pass ``compute_log_prob=False`` (or use kind "ode") to sample such a step. "sde" and "dance" keep a
    nonzero std at the last step (flow_grpo's log-prob there is huge and negative: still never train it).

Notation
    ==================  ==================================================================================
    ``x``               latent at ``sigma``, ``[B, *latent]`` (``[B, C, H, W]`` image, ``[B, C, F, H, W]`` video)
    ``v``/``velocity``  model output, ``noise - x0`` convention, same shape as ``x``
    ``sigma``           noise level in [0, 1], 1 = pure noise; ``[B]``, 0-d tensor or python float
    ``eta``             ``noise_level``, the sampler's stochasticity knob (kind-specific meaning above)
    ``g``               flow_grpo ``std_dev_t``, SDE diffusion coefficient (``sde_diffusion_coefficient``; per
                        kind: ``reference_std_dev_t``)
    ``std``             transition std of ``x_next`` given ``x``, ``[B]``
    ==================  ==================================================================================

Dtypes: every quantity is computed in float32 whatever the input dtype (bf16 / fp16 inputs are upcast), except
that float64 inputs are computed in float64 (for golden-vector tests). Outputs carry the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from .common import compute_dtype, per_sample

__all__ = [
    "Transition",
    "transition",
    "euler_step",
    "sde_diffusion_coefficient",
    "reference_std_dev_t",
    "TRANSITION_KINDS",
    "CPS_LOG_PROB_MODES",
]

TRANSITION_KINDS = ("sde", "dance", "cps", "ode")
CPS_LOG_PROB_MODES = ("unnormalized", "gaussian")
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)

Sigma = Union[float, torch.Tensor]


@dataclass(frozen=True)
class Transition:
    """One sampler step ``x -> x_next``, a Gaussian ``N(mean, std^2 I)`` (std 0 for "ode")."""

    x_next: torch.Tensor  # [B, *latent] sampled or the given (detached) x_next, compute dtype
    mean: torch.Tensor  # [B, *latent] transition mean (carries the velocity's autograd graph)
    std: torch.Tensor  # [B] transition std (per-step, NOT flow_grpo's std_dev_t), compute dtype
    log_prob: Optional[torch.Tensor]  # [B] log-density, mean over elements; None for "ode" / compute_log_prob=False


def _expand(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """``[B]`` -> ``[B, 1, ..., 1]`` with ``ndim`` dims in total."""
    return t.reshape(t.shape[0], *([1] * (ndim - 1)))


def _check_pair(x: torch.Tensor, velocity: torch.Tensor) -> None:
    if x.shape != velocity.shape:
        raise ValueError(f"x and velocity must have the same shape, got {tuple(x.shape)} and {tuple(velocity.shape)}")
    if x.ndim < 2:
        raise ValueError(f"x must be [B, *latent] with at least 2 dims, got shape {tuple(x.shape)}")


def euler_step(x: torch.Tensor, velocity: torch.Tensor, sigma: Sigma, sigma_next: Sigma) -> torch.Tensor:
    """Deterministic Euler step of the flow ODE: ``x + v * (sigma_next - sigma)``.

    Args:
        x, velocity: ``[B, *latent]``, any float dtype.
        sigma, sigma_next: ``[B]``, 0-d tensor or python float, noise levels in [0, 1].
    Returns:
        ``[B, *latent]`` in float32 (float64 if an input is float64).
    Raises:
        ValueError: shape mismatch.
    Source: diffusers ``FlowMatchEulerDiscreteScheduler.step`` (``prev = sample + (sigma_next - sigma) * v``).
    """
    _check_pair(x, velocity)
    dtype = compute_dtype(x, velocity)
    b, nd = x.shape[0], x.ndim
    s = _expand(per_sample(sigma, "sigma", (b,), dtype, x.device), nd)
    sn = _expand(per_sample(sigma_next, "sigma_next", (b,), dtype, x.device), nd)
    return x.to(dtype) + (sn - s) * velocity.to(dtype)


def sde_diffusion_coefficient(
    sigma: torch.Tensor, noise_level: float, sigma_max: Optional[Sigma] = None, sigma_next: Optional[Sigma] = None
) -> torch.Tensor:
    """FlowGRPO's SDE diffusion coefficient ``g = eta * sqrt(sigma / (1 - sigma'))`` (flow_grpo ``std_dev_t``).

    ``sigma' = sigma`` except where ``sigma == 1``, where it is ``sigma_max`` (the schedule's ``sigmas[1]``); when
    ``sigma_max`` is None, ``sigma_next`` is used there, which is the same number at step 0 (``sigmas[1]``).

    Args:
        sigma: ``[B]`` float tensor. sigma_max / sigma_next: float, 0-d or ``[B]`` (broadcast).
    Returns:
        ``[B]`` tensor, dtype of ``sigma``. This is NOT the transition std: that is ``g * sqrt(sigma - sigma_next)``.
    Raises:
        ValueError: ``sigma == 1`` somewhere and neither ``sigma_max`` nor ``sigma_next`` given.
    Source: flow_grpo ``sde_step_with_logprob`` (sde_type "sde"); SGLang's flow-GRPO sampler does the same.
    """
    if sigma_max is None:
        sigma_max = sigma_next
    if sigma_max is None:
        if bool((sigma == 1).any()):
            raise ValueError("sigma == 1 needs sigma_max (the schedule's sigmas[1]) or sigma_next")
        den = 1 - sigma
    else:
        sm = torch.as_tensor(sigma_max, device=sigma.device).to(sigma.dtype)
        den = 1 - torch.where(sigma == 1, sm, sigma)
    return torch.sqrt(sigma / den) * noise_level


def reference_std_dev_t(kind: str, sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float, *,
                        sigma_max: Optional[Sigma] = None) -> torch.Tensor:
    """The ``std_dev_t`` that the reference step function of ``kind`` returns (and flow_grpo's KL divides by).

    - "sde":   ``eta * sqrt(sigma / (1 - sigma'))`` (``sigma'`` as in :func:`sde_diffusion_coefficient`), the SDE
      diffusion coefficient ``g``, NOT the transition std ``g * sqrt(-dt)``;
    - "cps":   ``sigma_next * sin(eta * pi / 2)``, the transition std (equal to ``Transition.std``);
    - "dance": ``eta * sqrt(sigma - sigma_next)``, the transition std (equal to ``Transition.std``).

    Computed with the same operations as :func:`transition` (so "sde" gives bit for bit flow_grpo's ``std_dev_t``).

    Args:
        kind: "sde" | "cps" | "dance". sigma, sigma_next: ``[B]`` float tensors (``0 <= sigma_next < sigma <= 1``).
        noise_level: ``eta``. sigma_max: the schedule's ``sigmas[1]`` for "sde" at ``sigma == 1`` (default
            ``sigma_next``, the same number at step 0).
    Returns:
        ``[B]`` tensor, dtype of ``sigma``.
    Raises:
        ValueError: ``kind`` "ode" (no noise, no ``std_dev_t``) or unknown.
    Sources: flow_grpo ``sd3_sde_with_logprob.sde_step_with_logprob`` (``sde_type`` "sde" / "cps": its returned
    ``std_dev_t``); DanceGRPO ``train_grpo_flux.flux_step`` (``std_dev_t = eta * sqrt(delta_t)``).
    """
    if kind == "sde":
        sm = sigma_next if sigma_max is None else sigma_max
        return sde_diffusion_coefficient(sigma, noise_level, sigma_max=sm)
    if kind == "cps":
        return sigma_next * math.sin(noise_level * math.pi / 2)
    if kind == "dance":
        return noise_level * torch.sqrt(sigma - sigma_next)
    raise ValueError(f"kind={kind!r} has no std_dev_t; allowed: ('sde', 'cps', 'dance')")


def _gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, kind: str) -> torch.Tensor:
    if bool((std <= 0).any()):
        raise ValueError(
            f"kind={kind!r}: the transition std is 0 for some sample (noise_level 0, or a degenerate last step), so "
            "its log-density is undefined; pass compute_log_prob=False or use kind='ode' for such steps"
        )
    s = _expand(std, x_next.ndim)
    lp = -((x_next - mean) ** 2) / (2 * s**2) - torch.log(s) - _LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def transition(
    kind: str,
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    noise_level: float,
    *,
    x_next: Optional[torch.Tensor] = None,
    noise: Optional[torch.Tensor] = None,
    sigma_max: Optional[Sigma] = None,
    generator: Optional[torch.Generator] = None,
    compute_log_prob: bool = True,
    cps_log_prob: str = "unnormalized",
) -> Transition:
    """One sampler step ``x (sigma) -> x_next (sigma_next)`` of ``kind`` (equations in the module docstring).

    Args:
        kind: "sde" (FlowGRPO) | "dance" (DanceGRPO) | "cps" (flow_grpo CPS) | "ode" (Euler).
        x, velocity: ``[B, *latent]``, any float dtype (computed in fp32; float64 stays float64).
        sigma, sigma_next: ``[B]``, 0-d tensor or python float (broadcast to ``[B]``); ``0 <= sigma_next < sigma``.
        noise_level: ``eta >= 0`` (for "cps", ``0 <= eta <= 1``); ignored by "ode".
        x_next: if given, this step is scored (not sampled); it is detached, gradients flow through ``mean`` only.
        noise: ``[B, *latent]`` standard normal used to sample ``x_next = mean + std * noise`` (ignored if
            ``x_next`` is given). If both are None, fresh noise is drawn from ``generator``.
        sigma_max: the schedule's ``sigmas[1]``, used by "sde" in place of ``sigma`` in ``1 - sigma`` where
            ``sigma == 1``; default: ``sigma_next`` (equal at step 0).
        compute_log_prob: False skips the log-prob (``log_prob=None``), e.g. for eta-0 rollouts.
        cps_log_prob: "unnormalized" (flow_grpo reference, ``-mean((x_next - mean)^2)``) | "gaussian".

    Returns:
        ``Transition``: ``x_next, mean`` ``[B, *latent]``, ``std`` ``[B]`` (the per-step transition std),
        ``log_prob`` ``[B]`` (log-density, mean over elements) or None.

    Raises:
        ValueError: unknown ``kind`` / ``cps_log_prob`` (allowed values listed); shape mismatches; negative
            ``noise_level`` (or > 1 for "cps"); a Gaussian log-prob requested where ``std == 0``.

    Sources: flow_grpo ``sd3_sde_with_logprob.sde_step_with_logprob`` (sde, cps); DanceGRPO ``flux_step`` with
    ``sde_solver=True`` (dance); diffusers ``FlowMatchEulerDiscreteScheduler.step`` (ode).
    """
    _check_transition_args(kind, x, velocity, noise_level, cps_log_prob)
    dtype = compute_dtype(x, velocity)
    b, dev = x.shape[0], x.device
    s1 = per_sample(sigma, "sigma", (b,), dtype, dev)
    sn1 = per_sample(sigma_next, "sigma_next", (b,), dtype, dev)
    mean, std1 = _kernel(kind, x.to(dtype), velocity.to(dtype), s1, sn1, noise_level, sigma_max)
    x_next_t = _next_sample(kind, x, mean, std1, x_next, noise, generator)
    log_prob = None
    if compute_log_prob and kind != "ode":
        if kind == "cps" and cps_log_prob == "unnormalized":
            sq = (x_next_t - mean) ** 2
            log_prob = -sq.mean(dim=tuple(range(1, x.ndim)))
        else:
            log_prob = _gaussian_log_prob(x_next_t, mean, std1, kind)
    return Transition(x_next=x_next_t, mean=mean, std=std1, log_prob=log_prob)


def _check_transition_args(kind: str, x: torch.Tensor, velocity: torch.Tensor, noise_level: float,
                           cps_log_prob: str) -> None:
    if kind not in TRANSITION_KINDS:
        raise ValueError(f"kind={kind!r} is not one of {TRANSITION_KINDS}")
    if cps_log_prob not in CPS_LOG_PROB_MODES:
        raise ValueError(f"cps_log_prob={cps_log_prob!r} is not one of {CPS_LOG_PROB_MODES}")
    _check_pair(x, velocity)
    if kind != "ode":
        if not (noise_level >= 0 and math.isfinite(noise_level)):
            raise ValueError(f"noise_level must be a finite number >= 0, got {noise_level!r}")
        if kind == "cps" and noise_level > 1:
            raise ValueError(f"kind='cps' needs 0 <= noise_level <= 1 (eta * pi / 2 is an angle), got {noise_level}")


def _kernel(kind: str, xf: torch.Tensor, vf: torch.Tensor, s1: torch.Tensor, sn1: torch.Tensor, noise_level: float,
            sigma_max: Optional[Sigma]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Transition ``(mean [B, *latent], std [B])`` of ``kind`` (module-docstring equations), compute dtype."""
    b, nd = xf.shape[0], xf.ndim
    s, sn = _expand(s1, nd), _expand(sn1, nd)
    dt = sn - s
    if kind == "ode":
        return euler_step(xf, vf, s1, sn1), torch.zeros(b, dtype=xf.dtype, device=xf.device)
    if kind == "sde":
        sm = sn1 if sigma_max is None else sigma_max
        g = _expand(sde_diffusion_coefficient(s1, noise_level, sigma_max=sm), nd)
        mean = xf * (1 + g**2 / (2 * s) * dt) + vf * (1 + g**2 * (1 - s) / (2 * s)) * dt
        return mean, (g * torch.sqrt(-dt)).reshape(b)
    if kind == "dance":
        x0_hat = xf - s * vf
        score = -(xf - x0_hat * (1 - s)) / s**2
        mean = xf + dt * vf + (-0.5 * noise_level**2 * score) * dt
        return mean, noise_level * torch.sqrt(s1 - sn1)
    std1 = sn1 * math.sin(noise_level * math.pi / 2)  # cps
    std = _expand(std1, nd)
    x0_hat = xf - s * vf
    noise_hat = xf + vf * (1 - s)
    return x0_hat * (1 - sn) + noise_hat * torch.sqrt(sn**2 - std**2), std1


def _next_sample(kind: str, x: torch.Tensor, mean: torch.Tensor, std1: torch.Tensor, x_next: Optional[torch.Tensor],
                 noise: Optional[torch.Tensor], generator: Optional[torch.Generator]) -> torch.Tensor:
    """The given ``x_next`` (detached, compute dtype), or a fresh sample ``mean + std * noise`` (``mean`` for "ode")."""
    dtype = mean.dtype
    if x_next is not None:
        if x_next.shape != x.shape:
            raise ValueError(f"x_next must have the shape of x {tuple(x.shape)}, got {tuple(x_next.shape)}")
        return x_next.detach().to(dtype)
    if kind == "ode":
        return mean.detach()
    if noise is None:
        noise = torch.randn(x.shape, generator=generator, dtype=dtype, device=x.device)
    elif noise.shape != x.shape:
        raise ValueError(f"noise must have the shape of x {tuple(x.shape)}, got {tuple(noise.shape)}")
    return mean.detach() + _expand(std1, x.ndim) * noise.to(dtype)
