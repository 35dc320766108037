"""Policy losses and KL terms for flow-matching RL, one module per algorithm; the single source of the loss math.

Objectives only gather the tensors and call these. Every loss returns ``(loss, metrics)``; metrics are detached
tensors. Each module's docstring gives its equations, notation and sources.

    ==============  =====================================================================================
    ``grpo``        ``grpo_clip_loss`` (FlowGRPO / DanceGRPO PPO clip over per-step log-probs),
                    ``transition_mean_kl`` (KL of two Gaussian transitions of equal std), ``flow_grpo_kl``
                    (flow_grpo's KL loss, what its ``beta`` weighs)
    ``grpo_guard``  ``grpo_guard_loss`` (GRPO-Guard: RatioNorm + ``1 / -dt`` step reweighting)
    ``dppo``        ``dppo_loss`` (Flow-DPPO: asymmetric divergence mask instead of the ratio clip)
    ``nft``         ``nft_loss`` (DiffusionNFT, forward process, no likelihoods), ``velocity_mse_kl``
    ``awm``         ``awm_loss`` (Advantage Weighted Matching)
    ``dgpo``        ``dgpo_loss`` (Direct Group Preference Optimization)
    ``dpo``         ``diffusion_dpo_loss`` + ``best_worst_pairs`` (online Diffusion-DPO)
    ``crd``         ``crd_loss`` + ``cfg_velocity`` (Centered Reward Distillation)
    ``dmd2``        ``dmd_gradient`` + ``dmd_loss`` + ``fake_score_loss`` (DMD2 few-step distillation: the
                    distribution-matching gradient, the online fake score's denoising loss), GAN terms
    ``anchors``     ``anchor_fm_loss``, ``transition_ce_loss``, ``combine_anchor_terms``, ``training_sigmas``
                    (world-model anchor losses on real clips)
    ==============  =====================================================================================

Conventions: log-probs are Gaussian log-densities, mean over elements; ``A`` advantages ``[B]`` (broadcast over the
``S`` trained steps) or ``[B, S]``; velocities ``[B, *latent]`` in the ``noise - x0`` convention; computed in float32
whatever the input dtype, float64 inputs stay float64.
"""

from ..common import GroupIds
from ._common import Metrics
from .anchors import anchor_fm_loss, combine_anchor_terms, transition_ce_loss
from .awm import AWM_WEIGHTINGS, awm_loss
from .crd import CRD_LOSS_TYPES, cfg_velocity, crd_loss
from .dgpo import DGPO_MODES, dgpo_loss
from .dmd2 import dmd_gradient, dmd_loss, fake_score_loss, gan_discriminator_loss, gan_generator_loss
from .dpo import best_worst_pairs, diffusion_dpo_loss
from .dppo import dppo_loss
from .grpo import flow_grpo_kl, grpo_clip_loss, transition_mean_kl
from .grpo_guard import GUARD_STEP_WEIGHTS, grpo_guard_loss
from .nft import NFT_MODES, nft_loss, velocity_mse_kl

__all__ = [
    "grpo_clip_loss",
    "nft_loss",
    "velocity_mse_kl",
    "transition_mean_kl",
    "flow_grpo_kl",
    "NFT_MODES",
    "awm_loss",
    "AWM_WEIGHTINGS",
    "dgpo_loss",
    "DGPO_MODES",
    "grpo_guard_loss",
    "GUARD_STEP_WEIGHTS",
    "dppo_loss",
    "diffusion_dpo_loss",
    "best_worst_pairs",
    "crd_loss", "dmd_gradient", "dmd_loss", "fake_score_loss",
    "CRD_LOSS_TYPES", "gan_generator_loss", "gan_discriminator_loss",
    "cfg_velocity",
    "anchor_fm_loss",
    "transition_ce_loss",
    "combine_anchor_terms",
    "Metrics",
    "GroupIds",
]
