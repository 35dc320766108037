"""Pure-torch math core of flowforge: schedules, transition kernels, deterministic solvers, advantages, losses, EMA
and old-policy decay schedules.

Imports only torch and the standard library (enforced by a test). Conventions: sigma in [0, 1] (1 = pure noise),
``x_sigma = (1 - sigma) x0 + sigma noise``, velocity ``v = noise - x0``, log-probs are Gaussian log-densities
averaged (mean over elements) over all non-batch elements, computed in fp32.
"""

from .advantages import (COMBINE_MODES, STD_MODES, GroupStats, clip_advantages, combine_components, group_advantages,
                         group_stats, nft_optimality)
from .ema import EMA_SCHEDULES, NFT_DECAY_TYPES, OLD_DECAY_SCHEDULES, ema_decay, old_policy_decay
from .losses import NFT_MODES, flow_grpo_kl, grpo_clip_loss, nft_loss, transition_mean_kl, velocity_mse_kl
from .schedules import SCHEDULE_KINDS, WAN_DEFAULT_SHIFT, calculate_shift, flow_match_sigmas, resolve_trained_steps
from .sde import (CPS_LOG_PROB_MODES, TRANSITION_KINDS, Transition, euler_step, reference_std_dev_t,
                  sde_diffusion_coefficient, transition)
from .staleness import policy_staleness
from .solvers import data_prediction, dpm_solver_2_sample, dpm_solver_2m_step

__all__ = ["flow_match_sigmas", "calculate_shift", "resolve_trained_steps", "SCHEDULE_KINDS", "WAN_DEFAULT_SHIFT",
           "Transition", "transition", "euler_step", "sde_diffusion_coefficient", "reference_std_dev_t",
           "data_prediction", "dpm_solver_2m_step", "dpm_solver_2_sample", "TRANSITION_KINDS", "CPS_LOG_PROB_MODES",
           "group_advantages", "group_stats", "GroupStats", "combine_components", "clip_advantages", "nft_optimality",
           "STD_MODES", "COMBINE_MODES", "grpo_clip_loss", "nft_loss", "velocity_mse_kl", "transition_mean_kl",
           "flow_grpo_kl", "NFT_MODES", "ema_decay", "old_policy_decay", "EMA_SCHEDULES", "OLD_DECAY_SCHEDULES",
           "NFT_DECAY_TYPES", "policy_staleness"]
