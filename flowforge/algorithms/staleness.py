"""Bounded staleness: how far the policy that sampled a batch may lag the policy that trains on it.

Policy versions count optimizer rounds (training steps): version ``v`` is the weights after ``v`` steps. With
``max_staleness = s`` the rollout of step ``k`` may have been sampled by any version in ``[k - s, k]``; the loss then
weighs each transition by the importance ratio against the policy that sampled it, from the log-probs recorded at
sampling time (``Trajectory.log_probs``), clipped as usual::

    staleness = k - v                                   (0 = on-policy)
    ratio     = exp(log p_k(x_next | x) - log p_v(x_next | x))   clipped to [1 - eps_lo, 1 + eps_hi]

That ratio is exactly what :func:`flowforge.algorithms.losses.grpo_clip_loss` (and the GRPO family's losses) compute
from the recorded log-probs, so an on-policy and a stale batch go through the same function; only the behaviour
policy differs. This module holds the bound itself, checked wherever a stale rollout is taken.

Notation
    ===========  ===========================================================
    ``k``        the trainer's version when it trains on the batch (its step)
    ``v``        the version that sampled the batch (``Trajectory.policy_version``)
    ``s``        ``train.max_staleness``
    ===========  ===========================================================

Source: bounded-staleness asynchronous RL as in AReaL (Fu et al. 2025, arXiv 2505.24298), here without the
decoupled proximal policy: the clip band is around the behaviour policy, as PPO (Schulman et al. 2017).
"""

from __future__ import annotations

__all__ = ["policy_staleness"]


def policy_staleness(trainer_version: int, sampled_version: int, max_staleness: int) -> int:
    """``trainer_version - sampled_version``, the versions a batch lags the policy that trains on it.

    Args:
        trainer_version: ``k``, the version that trains on the batch (>= 0).
        sampled_version: ``v``, the version that sampled it (``Trajectory.policy_version``).
        max_staleness: ``s >= 0``, the bound (0: on-policy only).
    Returns:
        ``k - v`` as an int in ``[0, s]``.
    Raises:
        ValueError: ``max_staleness < 0``; ``v > k`` (a batch from weights this run has not trained yet); ``k - v >
            s`` (the batch is staler than the bound allows).
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness} must be >= 0")
    lag = trainer_version - sampled_version
    if lag < 0:
        raise ValueError(f"a batch sampled by policy version {sampled_version} is newer than the trainer's "
                         f"{trainer_version}: it cannot come from this run's weights")
    if lag > max_staleness:
        raise ValueError(f"a batch sampled by policy version {sampled_version} is {lag} versions behind the trainer's "
                         f"{trainer_version}; train.max_staleness={max_staleness} allows 0..{max_staleness}")
    return lag
