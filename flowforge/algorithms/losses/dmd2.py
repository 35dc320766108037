"""DMD2 (Improved Distribution Matching Distillation): the generator's distribution-matching loss, the fake score's
denoising loss, and the optional non-saturating GAN terms.

A few-step generator ``G`` is trained so that the distribution of its samples ``x = G(z)`` matches the data
distribution the teacher (the *real* score, frozen) models. The KL between the two diffused distributions has the
gradient ``E_{s, eps}[ -(score_real(x_s) - score_fake(x_s)) dx_s/dtheta ]``; the *fake* score is a copy of the teacher
trained online, with the ordinary denoising loss, on ``G``'s own samples (several fake updates per generator update:
the two time-scale update rule, TTUR), so it tracks the generator's current distribution. In the data-prediction
parametrisation the score difference is a difference of denoised estimates, normalised per sample::

    x_s      = (1 - s) x + s eps                         s ~ U[s_min, s_max], eps ~ N(0, I)     (no gradient)
    x0_real  = x_s - s v_real(x_s, s)                    the teacher's data prediction            (no gradient)
    x0_fake  = x_s - s v_fake(x_s, s)                    the fake score's data prediction          (no gradient)
    g        = (x0_fake - x0_real) / mean_el|x - x0_real|                                          per sample
    L_DM     = 1/2 mean((x - sg(x - g))^2)               so dL_DM / dx = g / N   (N = elements of the batch)

    L_fake   = mean((v_fake(x'_u, u) - (eps' - sg(x)))^2)    u ~ U[0, 1]: flow matching on G's detached samples

    L_G,GAN  = mean softplus(-D(x_gen))                   L_D,GAN = mean softplus(-D(x_real)) + softplus(D(x_gen))

No regression loss: DMD2 drops DMD's paired-noise regression term (and its ODE pairs) and adds the GAN term instead.

Notation
    ============  ===================================================================================
    ``x``         the generator's data prediction ``[B, *latent]`` (with gradient in ``L_DM``)
    ``s``, ``u``  noise levels in [0, 1], 1 = noise; ``v = noise - x0`` (the project's conventions)
    ``mean_el``   mean over all non-batch elements; ``sg`` stop-gradient
    ``D``         discriminator logits ``[B]`` (DMD2: a head on the fake score's features)
    ============  ===================================================================================

Sources: Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image Synthesis" (DMD2,
arXiv:2405.14867), Sec. 4.1-4.3 (TTUR, GAN term, backward simulation) and Eq. 2 of DMD (Yin et al. 2023,
arXiv:2311.18828) for the gradient; reference implementation tianweiy/DMD2 ``main/sd_guidance.py``
(``compute_distribution_matching_loss``: the per-sample ``mean |x - x0_real|`` normaliser and the
``0.5 * mse(x, sg(x - g))`` form; ``compute_loss_fake``: timesteps over the whole range, no guidance;
``min_step_percent 0.02`` / ``max_step_percent 0.98``). The flow-matching parametrisation (``x0 = x_s - s v``) replaces
the reference's epsilon / Karras parametrisations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import Metrics


def _per_sample_mean(t: torch.Tensor) -> torch.Tensor:
    """``[B, *]`` -> ``[B, 1, ..., 1]`` mean over the non-batch elements (broadcastable back onto ``t``)."""
    return t.mean(dim=tuple(range(1, t.ndim)), keepdim=True)


def dmd_gradient(x: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor, *, eps: float = 1e-8
                 ) -> torch.Tensor:
    """The normalised distribution-matching gradient ``g = (x0_fake - x0_real) / mean_el|x - x0_real|``.

    Args:
        x: ``[B, *latent]`` the generator's sample (only its values are used: no gradient flows through ``g``).
        x0_real, x0_fake: ``[B, *latent]`` the teacher's and the fake score's data predictions from the same noised
            ``x_s``.
        eps: floor of the normaliser (a sample the teacher reproduces exactly has ``g = 0``, not NaN).
    Returns:
        ``[B, *latent]`` fp32 (fp64 stays fp64), detached.
    Raises:
        ValueError: the three shapes differ.
    Source: DMD2 ``compute_distribution_matching_loss`` (``grad = (p_real - p_fake) / mean|p_real|`` with
    ``p = x - x0_pred``, which is ``(x0_fake - x0_real) / mean|x - x0_real|``).
    """
    if not x.shape == x0_real.shape == x0_fake.shape:
        raise ValueError(f"x {tuple(x.shape)}, x0_real {tuple(x0_real.shape)} and x0_fake {tuple(x0_fake.shape)} "
                         "must have one shape")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, real, fake = (t.detach().to(dtype) for t in (x, x0_real, x0_fake))
    scale = _per_sample_mean((x - real).abs()).clamp_min(eps)
    return (fake - real) / scale


def dmd_loss(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """``L_DM = 1/2 mean((x - sg(x - g))^2)``: a loss whose gradient with respect to ``x`` is ``g / x.numel()``.

    Args:
        x: ``[B, *latent]`` the generator's sample, with gradient to its weights.
        grad: ``[B, *latent]`` :func:`dmd_gradient` (treated as a constant).
    Returns:
        ``(loss, metrics)``: the 0-d loss (fp32; fp64 stays fp64) and ``dm_grad_abs`` (mean ``|g|``).
    Raises:
        ValueError: shapes differ.
    """
    if x.shape != grad.shape:
        raise ValueError(f"x {tuple(x.shape)} and grad {tuple(grad.shape)} must have one shape")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, grad = x.to(dtype), grad.detach().to(dtype)
    loss = 0.5 * F.mse_loss(x, (x - grad).detach(), reduction="mean")
    return loss, {"loss_dm": loss.detach(), "dm_grad_abs": grad.abs().mean()}


def fake_score_loss(v_fake: torch.Tensor, x: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """The fake score's flow-matching loss on the generator's detached samples: ``mean((v_fake - (noise - x))^2)``.

    Args:
        v_fake: ``[B, *latent]`` the fake score's velocity at ``x_u = (1 - u) x + u noise``, with gradient.
        x: ``[B, *latent]`` the generator's samples (detached here).
        noise: ``[B, *latent]`` the noise that made ``x_u``.
    Returns:
        ``(loss, metrics)`` with ``loss_fake``.
    Raises:
        ValueError: shapes differ.
    """
    if not v_fake.shape == x.shape == noise.shape:
        raise ValueError(f"v_fake {tuple(v_fake.shape)}, x {tuple(x.shape)} and noise {tuple(noise.shape)} must "
                         "have one shape")
    dtype = torch.float64 if v_fake.dtype == torch.float64 else torch.float32
    target = (noise.to(dtype) - x.detach().to(dtype))
    loss = F.mse_loss(v_fake.to(dtype), target, reduction="mean")
    return loss, {"loss_fake": loss.detach()}


def gan_generator_loss(logits_gen: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Non-saturating generator GAN loss ``mean softplus(-D(x_gen))`` (DMD2 Sec. 4.2, ``gen_cls_loss``).

    Args:
        logits_gen: ``[B]`` discriminator logits of generated samples, with gradient to the generator.
    Returns:
        ``(loss, metrics)`` with ``loss_gan_gen``.
    """
    loss = F.softplus(-logits_gen.float()).mean()
    return loss, {"loss_gan_gen": loss.detach()}


def gan_discriminator_loss(logits_real: torch.Tensor, logits_gen: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """The discriminator's loss ``mean softplus(-D(x_real)) + mean softplus(D(x_gen))`` (DMD2's
    ``guidance_cls_loss``: real samples labelled 1, generated 0, binary cross-entropy on logits).

    Args:
        logits_real: ``[B_r]`` logits of real data samples; logits_gen: ``[B_g]`` of (detached) generated ones.
    Returns:
        ``(loss, metrics)`` with ``loss_gan_disc`` and ``disc_acc`` (fraction classified correctly).
    """
    real, gen = logits_real.float(), logits_gen.float()
    loss = F.softplus(-real).mean() + F.softplus(gen).mean()
    acc = torch.cat([(real > 0).float(), (gen < 0).float()]).mean()
    return loss, {"loss_gan_disc": loss.detach(), "disc_acc": acc.detach()}
