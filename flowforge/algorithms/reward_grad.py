"""Reward-gradient fine-tuning: the differentiable tails of the deterministic sampler (DRaFT-K, DRaFT-LV, ReFL).

With a differentiable reward ``r`` and a decoder ``D``, the sample's reward is a differentiable function of the
policy's weights ``theta`` through the sampler itself, and the loss is simply ``-r(D(x_0(theta)))``. Three ways to
bound the backward pass, all on the flow ODE ``dx/dsigma = v_theta(x, sigma)`` (Euler,
:func:`flowforge.algorithms.sde.euler_step`):

* **DRaFT-K** (Clark et al. 2023, "Directly Fine-Tuning Diffusion Models on Differentiable Rewards", Sec. 4.2):
  the first ``T - K`` steps run without gradient; the last ``K`` with gradient. :func:`ode_tail` runs those ``K``
  steps from the stored ``x_{T-K}``; each step's velocity call is activation-checkpointed
  (:func:`torch.utils.checkpoint.checkpoint`), so the memory is one step's activations plus ``K`` latents, not
  ``K`` steps' activations. The gradient with respect to ``x_{T-K}`` is dropped (the truncation).
* **DRaFT-LV** (same paper, Sec. 4.3, for ``K = 1``): the finished sample ``x_0`` (no gradient) is re-noised ``n``
  times to the last step's noise level ``s = sigma_{T-1}``, ``x_s^j = (1 - s) x_0 + s eps_j``, and each is
  denoised in one step with gradient, ``x0_hat^j = x_s^j - s v_theta(x_s^j, s)`` (the paper's ``(x_1 - sigma_1
  eps_theta) / alpha_1`` in the flow parametrisation); the loss averages ``-r`` over the ``n`` copies
  (:func:`renoise`, :func:`predict_x0`).
* **ReFL** (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image Generation",
  Alg. 1): the sampler stops at a step ``t`` drawn from a late range ``[t1, t2]`` (no gradient up to it) and
  predicts ``x_0`` from ``x_t`` in one step with gradient, ``x0_hat = x_t - sigma_t v_theta(x_t, sigma_t)``
  (:func:`predict_x0`; one Euler step to ``sigma = 0``). ImageReward's loss ``lambda * ReLU(c - r)`` has the gradient
  ``-lambda * grad r`` wherever ``r < c`` (ImageReward uses ``c = 2``), so on a reward bounded below ``c`` it is the
  same update as ``-r`` with the learning rate scaled by ``lambda``.

Notation: ``B`` samples, latent ``[C, H, W]`` (any trailing shape), ``sigma`` in [0, 1] with 1 = noise,
``v = noise - x0`` (``docs``' conventions). A ``velocity`` argument is ``velocity(x [B, *latent], sigma [B]) -> v``
(fp32 ``[B, *latent]``) with the policy's weights and the conditioning bound in.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from flowforge.algorithms.sde import euler_step

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def ode_tail(velocity: Velocity, x: torch.Tensor, sigmas: torch.Tensor, *, use_checkpoint: bool = True
             ) -> torch.Tensor:
    """The deterministic (Euler) sampler over ``sigmas`` from ``x``, with gradient through every step (DRaFT-K).

    Each step is ``x <- euler_step(x, v, sigma_i, sigma_{i+1})`` with ``v = velocity(x, sigma_i.expand(B))`` --
    the same calls, in the same order, as :func:`flowforge.rollout.denoise`'s ODE steps, so from the same ``x`` it
    returns the same values bit for bit.

    Args:
        velocity: ``(x [B, *latent], sigma [B]) -> v [B, *latent]`` (see the module docstring).
        x: ``[B, *latent]`` the input of the first step (``x_{T-K}``); detached (the truncation).
        sigmas: ``[K+1]`` fp32 noise levels, decreasing (the schedule's last ``K+1`` for DRaFT-K).
        use_checkpoint: recompute each step's activations in the backward instead of keeping them.
    Returns:
        ``[B, *latent]`` fp32, differentiable with respect to the weights ``velocity`` uses.
    Raises:
        ValueError: ``sigmas`` has fewer than 2 entries (no step: nothing to differentiate).
    Source: Clark et al. 2023 (DRaFT), Algorithm 1 with truncation ``K``.
    """
    if sigmas.ndim != 1 or sigmas.shape[0] < 2:
        raise ValueError(f"ode_tail needs at least 2 noise levels (1 step), got shape {tuple(sigmas.shape)}")
    b = x.shape[0]
    x = x.detach().float()
    sig = sigmas.to(x.device)

    def step(x_in: torch.Tensor, i: int) -> torch.Tensor:
        return euler_step(x_in, velocity(x_in, sig[i].expand(b)), sig[i], sig[i + 1])

    for i in range(sig.shape[0] - 1):
        # non-reentrant checkpointing: the step's forward is re-run in the backward; the first step's input has no
        # grad, which the non-reentrant form allows (the weights still get theirs)
        x = checkpoint(step, x, i, use_reentrant=False) if use_checkpoint and torch.is_grad_enabled() else step(x, i)
    return x


def predict_x0(velocity: Velocity, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """One-step data prediction ``x0_hat = x - sigma * v(x, sigma)`` (ReFL's and DRaFT-LV's single step).

    Equal to one Euler step from ``sigma`` to 0 (:func:`flowforge.algorithms.sde.euler_step`).

    Args:
        x: ``[B, *latent]`` the noisy latent (detached: the gradient flows through ``v`` only).
        sigma: 0-d or ``[B]`` noise level(s) of ``x``.
    Returns:
        ``[B, *latent]`` fp32.
    Source: Xu et al. 2023 (ImageReward), Algorithm 1 ("predict the original latent from x_t").
    """
    x = x.detach().float()
    s = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0])
    return euler_step(x, velocity(x, s), s, torch.zeros_like(s))


def renoise(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
    """The forward process ``x_sigma = (1 - sigma) x0 + sigma noise`` at one noise level (DRaFT-LV's re-noising).

    Args:
        x0, noise: ``[B, *latent]``.
        sigma: python float or 0-d tensor in [0, 1].
    Returns:
        ``[B, *latent]`` fp32.
    Raises:
        ValueError: shapes differ.
    """
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must have one shape")
    s = torch.as_tensor(sigma, dtype=torch.float32, device=x0.device)
    return (1 - s) * x0.float() + s * noise.float()

