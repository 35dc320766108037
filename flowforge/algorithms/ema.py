"""Decay schedules of the two weight averages: the eval EMA of the live policy, and DiffusionNFT's old policy.

What
    Pure functions of the optimizer-step count ``n`` returning the decay ``d`` of an exponential moving average
    ``avg <- d * avg + (1 - d) * live``. The caller applies the blend; these only say how much of the average stays.

Why
    A constant decay keeps the base weights in the average for long: after ``n`` updates at ``d = 0.9`` the base
    still holds ``0.9^n`` of it (35% after 10). DiffusionNFT's eval EMA warms up instead, so early evaluations see
    the trained weights; its old policy (the one it samples with) starts equal to the live policy and lags more
    as training goes, in one of three schedules ("decay types").

Equations (``n`` = optimizer steps taken so far, counting the one just taken: the first update has ``n = 1``)::

    ema_decay        "constant":  d(n) = decay
                     "warmup":    d(n) = min( (1 + n) / (10 + n), decay )
    old_policy_decay "linear":    d(n) = min( decay_rate * n, decay_max )
                     "flat_ramp": d(n) = 0                                          n <  flat_steps
                                  d(n) = min( (n - flat_steps) * decay_rate, decay_max )   n >= flat_steps

With "warmup" the base's share of the EMA after ``k`` updates is ``prod_{n=1..k} (1 + n) / (10 + n)``
(``2/11 = 0.18`` after one, ``6.0e-5`` after ten) until the cap ``decay`` binds (``n >= 80`` for 0.9). ``d = 0``
makes the old policy a copy of the live one.

Reference configurations (NVlabs/DiffusionNFT ``config/nft.py`` ``decay_type``, ``return_decay`` in
``scripts/train_nft_sd3.py``), as :data:`NFT_DECAY_TYPES`::

    type 0  linear,    decay_rate 0,      decay_max 0        (old = live after every epoch)
    type 1  linear,    decay_rate 0.001,  decay_max 0.5      (the default of every SD3 config)
    type 2  flat_ramp, flat_steps 75, decay_rate 0.0075, decay_max 0.999   (``sd3_ocr``)

Notation
    ==============  =======================================================================================
    ``n``           optimizer steps so far (NVlabs ``global_step``, incremented before the EMA / old update)
    ``decay``       the EMA's cap (NVlabs ``EMAModuleWrapper(decay=0.9)``)
    ``decay_rate``  old-policy ramp slope per optimizer step (NVlabs ``uprate``)
    ``decay_max``   old-policy cap (NVlabs ``uphold``); ``flat_steps`` its flat start (NVlabs ``flat``)
    ==============  =======================================================================================

Sources: Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (arXiv 2509.16117);
NVlabs/DiffusionNFT ``flow_grpo/ema.py`` (``EMAModuleWrapper.get_current_decay``: ``min((1 + optimization_step) /
(10 + optimization_step), self.decay)``, stepped with ``global_step`` after its increment) and
``scripts/train_nft_sd3.py`` (``return_decay``). flow_grpo's ``flow_grpo/ema.py`` has the same warm-up.
"""

from __future__ import annotations

import math
from typing import Dict, Union

__all__ = ["EMA_SCHEDULES", "OLD_DECAY_SCHEDULES", "NFT_DECAY_TYPES", "ema_decay", "old_policy_decay"]

EMA_SCHEDULES = ("constant", "warmup")
OLD_DECAY_SCHEDULES = ("linear", "flat_ramp")
NFT_DECAY_TYPES: Dict[int, Dict[str, Union[str, int, float]]] = {
    0: {"schedule": "linear", "decay_rate": 0.0, "decay_max": 0.0},
    1: {"schedule": "linear", "decay_rate": 0.001, "decay_max": 0.5},
    2: {"schedule": "flat_ramp", "flat_steps": 75, "decay_rate": 0.0075, "decay_max": 0.999},
}


def _check_step(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"the optimizer-step count must be an int >= 0, got {n!r}")


def _check_unit(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def ema_decay(step: int, *, schedule: str = "constant", decay: float) -> float:
    """Decay of the eval EMA at optimizer step ``step`` (``ema <- d * ema + (1 - d) * live``).

    Args:
        step: ``n``, optimizer steps taken so far including the one this update follows (first update: 1).
        schedule: "constant" (``d = decay``) | "warmup" (``d = min((1 + n) / (10 + n), decay)``, DiffusionNFT).
        decay: the constant decay, or the warm-up's cap, in [0, 1].
    Returns:
        ``d`` (python float, dimensionless).
    Raises:
        ValueError: unknown ``schedule`` (allowed values listed), ``step`` not an int >= 0, ``decay`` outside [0, 1].
    Source: NVlabs/DiffusionNFT ``flow_grpo/ema.py`` ``EMAModuleWrapper.get_current_decay`` ("warmup").
    """
    if schedule not in EMA_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {EMA_SCHEDULES}")
    _check_step(step)
    _check_unit("decay", decay)
    if schedule == "constant":
        return decay
    return min((1 + step) / (10 + step), decay)


def old_policy_decay(n: int, *, schedule: str = "linear", decay_rate: float = 0.001, decay_max: float = 0.5,
                     flat_steps: int = 0) -> float:
    """Decay of DiffusionNFT's old (sampling) policy after ``n`` optimizer steps (``old <- d old + (1 - d) live``).

    Args:
        n: optimizer steps so far (NVlabs ``global_step`` at the end of the epoch's updates).
        schedule: "linear" (``min(decay_rate * n, decay_max)``) | "flat_ramp" (0 for ``n < flat_steps``, then
            ``min((n - flat_steps) * decay_rate, decay_max)``).
        decay_rate: ramp slope per optimizer step, ``>= 0``. decay_max: the cap, in [0, 1].
        flat_steps: ``>= 0``, the flat start of "flat_ramp"; must be 0 for "linear".
    Returns:
        ``d`` (python float in [0, 1]). "linear" evaluates exactly ``min(decay_rate * n, decay_max)``.
    Raises:
        ValueError: unknown ``schedule`` (allowed values listed); ``n`` or ``flat_steps`` not an int >= 0;
            ``decay_rate < 0``; ``decay_max`` outside [0, 1]; ``flat_steps != 0`` with "linear".
    Source: NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` ``return_decay`` (presets in :data:`NFT_DECAY_TYPES`).
    """
    if schedule not in OLD_DECAY_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {OLD_DECAY_SCHEDULES}")
    _check_step(n)
    _check_step(flat_steps)
    if not (math.isfinite(decay_rate) and decay_rate >= 0):
        raise ValueError(f"decay_rate must be a finite number >= 0, got {decay_rate!r}")
    _check_unit("decay_max", decay_max)
    if schedule == "linear":
        if flat_steps != 0:
            raise ValueError(f"flat_steps={flat_steps} needs schedule 'flat_ramp' ('linear' has no flat start)")
        return min(decay_rate * n, decay_max)
    if n < flat_steps:
        return 0.0
    return min((n - flat_steps) * decay_rate, decay_max)
