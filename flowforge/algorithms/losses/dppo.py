"""Flow-DPPO: FlowGRPO's ratio surrogate with an asymmetric divergence (trust-region) mask in place of the ratio clip.

Each stochastic sampler step is a Gaussian of fixed std, so the divergence between the live and the rollout (old)
transition of a stored step is exact and cheap: the KL of two Gaussians of equal std, from their means. A step's
surrogate loses its gradient only when BOTH its KL to the old transition is at or beyond ``delta`` AND its update moves
further out in the advantage's direction (``ratio > 1`` with ``A > 0``, or ``ratio < 1`` with ``A < 0``). Steps inside
the region always pass, unclipped; steps outside that move back toward the old policy (e.g. ``A > 0``, ``ratio < 1``)
also pass. The PPO clip instead limits every step by its single-sample ratio, a noisy estimate of the divergence.

Equations (per element of ``[B, S]``)::

    ratio   = exp(logp - logp_old)
    D       = mean_el( (mu - mu_old)^2 ) / (2 s^2)          = KL(N(mu_old, s^2) || N(mu, s^2)), mean over elements
    masked  = (D >= delta) & ( (ratio > 1 & A > 0) | (ratio < 1 & A < 0) )
    L       = mean( where(masked, 0, -A * ratio) )           mean over ALL B x S elements, masked ones count as 0

The mask is a constant (no gradient flows through ``D``); a masked element contributes neither value nor gradient. At
``logp == logp_old`` and ``mu == mu_old`` (the first update) ``ratio == 1`` and ``D == 0``: nothing is masked and the
loss is ``-mean(A)``, FlowGRPO's first-update value and gradient.

The KL is the mean over latent elements (not the sum over them, as the paper's Eq. 14 writes it): the reference code
reduces with a mean, and ``delta`` is calibrated against that (reference default 1e-5; Flow-Factory's 1e-6).
``std`` is the TRANSITION std (``sde.Transition.std``, ``g * sqrt(-dt)``, unlike flow_grpo's KL loss, which divides
by ``std_dev_t = g`` alone); ``std=1.0`` gives the references' ``add_kl_coefficient=False`` score
``mean_el((mu - mu_old)^2) / 2``.

Which std at ``sigma = 1`` (step 0 of a schedule starting at 1). flowforge uses the std the rollout actually sampled
with: FlowGRPO's ``g = eta sqrt(sigma / (1 - sigma'))`` with ``sigma' = sigmas[1]`` where ``sigma == 1``, so ``D`` is
the exact KL of the two transitions. Flow-Factory-Draft (``src/flow_factory/trainers/dppo.py``,
``_effective_sigma``: ``std_dev_t * sqrt(-dt)`` with the scheduler's own ``std_dev_t``) does the same. UniRL's
``FlowDPPO._compute_sigma_t`` instead recomputes ``std_dev_t = eta sqrt(s / (1 - clamp(s, max=0.99)))``, i.e.
``sigma' = 0.99`` at ``sigma = 1``, while its SDE kernel (``unirl/sde/kernels.py``, given ``sigma_max =
schedule[1]`` by e.g. ``unirl/models/flux2_klein/diffusion.py``) draws step 0 with ``sigma' = sigmas[1]``: at step 0 its normaliser ``2 s^2`` is ``100 (1 - sigmas[1])`` times flowforge's
(3.99x for SD3's static schedule, 10 steps, shift 3; 2.3x for 16 steps; 0.87x for 40 steps), so UniRL's step-0
``D`` is that many times smaller and the mask trips less often there. Every other step agrees (``sigma < 0.99``:
the clamp is inactive). flowforge keeps the sampler's std because the mask is meant to bound the divergence of the
transition that was sampled; to reproduce UniRL's step 0 exactly, scale ``delta`` or start the schedule below 1.

Notation
    =============  =================================================================================
    ``logp``       live log-prob of a stored step ``[B]`` or ``[B, S]``, mean over elements; ``logp_old`` the
                   rollout (old) policy's, a constant
    ``mu``         live transition mean ``[B, (S,) *latent]``; ``mu_old`` the rollout policy's, a constant
    ``s``          transition std ``[B(, S)]``
    ``A``          advantages ``[B]`` (broadcast over ``S``) or ``[B, S]``
    ``delta``      the divergence threshold (paper ``delta``, reference ``kl_mask_threshold``)
    ``mean_el``    mean over all latent elements
    =============  =================================================================================

Source: Ping, Zhou, Qi, Luo, Bo, Pang 2026, "Flow-DPPO: Divergence Proximal Policy Optimization for Flow Matching
Models" (arXiv 2606.11025; Eq. 14 the equal-covariance Gaussian KL, Eq. 18 the asymmetric mask); reference
implementation Tencent-Hunyuan/UniRL ``unirl/algorithms/flowdppo.py`` (``_flowdppo_kl_adv_loss``: the mask, the
``torch.where`` zeroing, the mean over all elements) with ``FlowDPPO/README.md``; the same loss in verl-omni
(``docs/algo/flowdppo.md``, ``loss_mode=flow_dppo``) and in the first author's Flow-Factory fork
(Jayce-Ping/Flow-Factory-Draft ``src/flow_factory/trainers/dppo.py``, ``DPPOTrainer``, which also clamps advantages
first: ``adv_clip`` here). The divergence mask comes from DPPO for LLMs: Qi et al. 2026, "Rethinking the Trust
Region in LLM Reinforcement Learning" (arXiv 2602.04879).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..common import compute_dtype
from ._common import (
    Metrics,
    check_ratio_inputs,
    check_step_means,
    gaussian_mean_kl,
    positive_step_std,
    prepared_advantages,
    ratio_metrics,
)

__all__ = ["dppo_loss"]


def dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: Union[float, torch.Tensor],
    delta: float,
    adv_clip: Optional[float] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """Flow-DPPO surrogate: unclipped ``-A * ratio`` with the asymmetric divergence mask (module docstring).

    Args:
        log_prob: ``[B]`` or ``[B, S]`` live log-probs of the stored steps, mean over elements (graph).
        old_log_prob: same shape, the rollout (old) policy's log-probs of the same steps (detached here).
        advantages: ``[B]`` (broadcast over ``S``) or the shape of ``log_prob`` (detached here).
        mean: ``[B, *latent]`` (for ``[B]`` log-probs) or ``[B, S, *latent]``: live transition mean; only used for
            the mask, so no gradient flows through it.
        old_mean: same shape, the rollout policy's transition mean of the same step (detached here).
        std: the transition std (``Transition.std``), float / 0-d / the shape of ``log_prob``; ``> 0``. The live and
            the old transition of a step must share it (true for every sampler kind: it depends on sigma and eta only).
        delta: the divergence threshold ``> 0`` (``math.inf`` disables the mask: plain unclipped policy gradient).
        adv_clip: if given, advantages are first clamped to ``[-adv_clip, adv_clip]``.
    Returns:
        ``loss`` 0-d (mean over samples and steps) and ``metrics``: ``ratio_mean``, ``ratio_std`` (population),
        ``ratio_min``, ``ratio_max``, ``approx_kl`` (``0.5 mean (logp - logp_old)^2``), ``step_kl_mean``,
        ``step_kl_max`` (of ``D``), ``step_kl_exceeded_fraction`` (``D >= delta``), ``masked_fraction``,
        ``masked_positive_fraction`` / ``masked_negative_fraction`` (masked with ``A > 0`` / ``A < 0``; fractions of
        all ``B x S`` elements) — 0-d, detached.
    Raises:
        ValueError: ``delta`` not > 0; ``adv_clip <= 0``; ``std <= 0``; shape mismatches.
    Source: Ping et al. 2026, arXiv 2606.11025 (Eq. 14, 18); Tencent-Hunyuan/UniRL ``unirl/algorithms/flowdppo.py``.
    """
    if not delta > 0:
        raise ValueError(f"delta must be > 0 (math.inf disables the mask), got {delta}")
    check_ratio_inputs(log_prob, old_log_prob, advantages, adv_clip)
    check_step_means(mean, old_mean, log_prob)
    dtype = compute_dtype(log_prob, old_log_prob, advantages, mean, old_mean)
    s = positive_step_std(std, log_prob, dtype)
    lp = log_prob.to(dtype)
    old = old_log_prob.detach().to(dtype)
    adv = prepared_advantages(advantages, adv_clip, dtype, lp.ndim)
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    step_kl = gaussian_mean_kl(mean.detach(), old_mean, s, dtype)
    exceeded = step_kl >= delta
    r = ratio.detach()
    masked_pos = exceeded & (r > 1.0) & (adv > 0)
    masked_neg = exceeded & (r < 1.0) & (adv < 0)
    masked = masked_pos | masked_neg
    # Masked elements enter the surrogate with log-ratio 0 and are then zeroed: a masked ratio that overflowed to inf
    # then gives neither an inf value nor a NaN gradient (a 0/1 multiplier, or where() alone, would give 0 * inf).
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    kept_ratio = torch.exp(torch.where(masked, zero, log_ratio))
    loss = torch.where(masked, zero, -adv * kept_ratio).mean()
    metrics = ratio_metrics(ratio, log_ratio)
    metrics.update(
        step_kl_mean=step_kl.mean(),
        step_kl_max=step_kl.max(),
        step_kl_exceeded_fraction=exceeded.to(dtype).mean(),
        masked_fraction=masked.to(dtype).mean(),
        masked_positive_fraction=masked_pos.to(dtype).mean(),
        masked_negative_fraction=masked_neg.to(dtype).mean(),
    )
    return loss, metrics
