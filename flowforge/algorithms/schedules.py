"""Sigma schedules for flow-matching samplers, and the choice of which steps are trained.

What
    ``flow_match_sigmas`` builds the ``T + 1`` noise levels of a ``T``-step sampler (descending, ending in 0) for the
    three schedule families used by the supported models; ``calculate_shift`` gives FLUX's resolution-dependent
    ``mu``; ``resolve_trained_steps`` picks the step indices whose transitions are trained.

Why
    The schedule is computed once per rollout and stored in the trajectory, so training re-uses exactly the sigmas the
    sampler used. Steps are addressed by integer index: looking a step up from a (bf16-rounded) timestep picks the wrong
    index for some steps. Functions here are pure: no scheduler object holds state, so nothing can be shifted twice.

Equations (``s`` a base sigma in (0, 1])
    static shift   (SD3, diffusers ``FlowMatchEulerDiscreteScheduler``)::

        s_min   = shift(1 / N_train)                         # the scheduler's training sigma_min (already shifted)
        base    = linspace(1, s_min, T)                       # as diffusers: linspace over N_train * sigma, / N_train
        sigma   = shift(base),  shift(s) = a s / (1 + (a - 1) s)

      (diffusers shifts ``s_min`` a second time; reproduced on purpose so the schedules are identical.)
    dynamic shift  (FLUX, Qwen-Image: ``use_dynamic_shifting=True``)::

        base    = linspace(1, 1 / N_train, T)
        sigma   = exp(mu) / (exp(mu) + (1 / base - 1))        # exponential time shift, diffusers ``time_shift``
        mu      = m * image_seq_len + b                       # ``calculate_shift``, linear in the token count
    Wan::

        base    = linspace(1, 0, T + 1)[:-1]
        sigma   = a s / (1 + (a - 1) s)                       # a = shift, 5 by default

    All three append a terminal ``sigma_T = 0``.

Notation
    ======================  ==========================================================================
    ``T`` / ``num_steps``   number of sampling steps; the schedule has ``T + 1`` entries
    ``N_train``             ``num_train_timesteps`` (1000); only sets the smallest base sigma
    ``a`` / ``shift``       static shift factor (``a > 1`` spends more steps at high noise)
    ``mu``                  dynamic (log-space) shift
    step ``i``              the transition ``sigmas[i] -> sigmas[i + 1]``, ``0 <= i < T``
    ======================  ==========================================================================
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["flow_match_sigmas", "calculate_shift", "resolve_trained_steps", "SCHEDULE_KINDS", "WAN_DEFAULT_SHIFT"]

SCHEDULE_KINDS = ("static", "dynamic", "wan")
WAN_DEFAULT_SHIFT = 5.0


def _linspace_f64(start: float, stop: float, num: int) -> torch.Tensor:
    """``numpy.linspace(start, stop, num)`` in float64 (same arithmetic: start + k * step, last element = stop)."""
    if num == 1:
        return torch.tensor([start], dtype=torch.float64)
    step = (stop - start) / (num - 1)
    out = torch.arange(num, dtype=torch.float64) * step + start
    out[-1] = stop
    return out


def flow_match_sigmas(
    num_steps: int,
    shift: Optional[float] = None,
    *,
    mu: Optional[float] = None,
    kind: str = "static",
    num_train_timesteps: int = 1000,
) -> torch.Tensor:
    """Noise levels of a ``num_steps``-step flow-matching sampler.

    Args:
        num_steps: ``T >= 1`` sampling steps.
        shift: static shift factor ``a > 0``. ``None`` means 1.0 for ``kind="static"`` and
            ``WAN_DEFAULT_SHIFT`` (5.0) for ``kind="wan"``. Not allowed (other than ``None`` / 1.0) with ``mu``:
            diffusers ignores ``shift`` under dynamic shifting, so passing both is ambiguous.
        mu: dynamic shift (FLUX / Qwen-Image, see ``calculate_shift``). Giving ``mu`` selects dynamic shifting
            (``kind`` may be left at "static" or set to "dynamic").
        kind: "static" | "dynamic" | "wan".
        num_train_timesteps: ``N_train``; sets the smallest base sigma of the static / dynamic schedules.

    Returns:
        ``[T + 1]`` float32, strictly descending from 1 (static / dynamic) or ``shift(1) = 1`` (wan), last entry 0.
        Unit: sigma in [0, 1] (1 = pure noise). Adapters convert to their model's native timestep.

    Raises:
        ValueError: unknown ``kind``; ``num_steps < 1``; ``shift <= 0``; ``mu`` with ``kind="wan"``;
            ``kind="dynamic"`` without ``mu``; ``mu`` together with a non-default ``shift``.

    Source:
        static / dynamic: diffusers ``FlowMatchEulerDiscreteScheduler.set_timesteps`` (sigmas equal bit for bit:
        same float32 training ``sigma_min``, float64 linspace, float32 cast). Dynamic ``mu``: FLUX (Black Forest Labs)
        ``time_shift``. Wan: Wan2.1 ``FlowUniPCMultistepScheduler`` shift on ``linspace(1, 0, T + 1)[:-1]``.
    """
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"kind={kind!r} is not one of {SCHEDULE_KINDS}")
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    if not isinstance(num_train_timesteps, int) or num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be an int >= 1, got {num_train_timesteps!r}")
    if mu is not None:
        if kind == "wan":
            raise ValueError("mu (dynamic shift) is not defined for kind='wan'; allowed kinds with mu: static, dynamic")
        if shift is not None and shift != 1.0:
            raise ValueError(
                f"got both mu={mu} and shift={shift}: dynamic shifting ignores shift; pass one of them "
                "(mu for FLUX / Qwen-Image, shift for SD3 / Wan)"
            )
        kind = "dynamic"
    elif kind == "dynamic":
        raise ValueError("kind='dynamic' needs mu (see calculate_shift)")
    if shift is None:
        shift = WAN_DEFAULT_SHIFT if kind == "wan" else 1.0
    if not (shift > 0 and math.isfinite(shift)):
        raise ValueError(f"shift must be a finite number > 0, got {shift!r}")

    if kind == "wan":
        base = _linspace_f64(1.0, 0.0, num_steps + 1)[:-1]
        sigmas = shift * base / (1.0 + (shift - 1.0) * base)
    else:
        # The scheduler's training sigma_min: float32 1/N_train, statically shifted in float32 (not under dynamic).
        smin32 = torch.tensor(1.0, dtype=torch.float32) / num_train_timesteps
        if kind == "static":
            smin32 = shift * smin32 / (1 + (shift - 1) * smin32)
        sigma_min = float(smin32)
        base = _linspace_f64(1.0 * num_train_timesteps, sigma_min * num_train_timesteps, num_steps)
        base = base / num_train_timesteps
        if kind == "static":
            sigmas = shift * base / (1.0 + (shift - 1.0) * base)
        else:
            e = math.exp(mu)
            sigmas = e / (e + (1.0 / base - 1.0))
    return torch.cat([sigmas.to(torch.float32), torch.zeros(1, dtype=torch.float32)])


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX's dynamic shift ``mu``, linear in the number of image tokens.

    ``mu = base_shift + (max_shift - base_shift) * (image_seq_len - base_seq_len) / (max_seq_len - base_seq_len)``.

    Args:
        image_seq_len: number of latent tokens (FLUX: ``(H / 16) * (W / 16)``).
    Returns:
        python float ``mu``.
    Raises:
        ValueError: ``max_seq_len == base_seq_len``.
    Source: diffusers ``pipeline_flux.calculate_shift`` (FLUX.1 reference defaults).
    """
    if max_seq_len == base_seq_len:
        raise ValueError("max_seq_len must differ from base_seq_len")
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def _check_index(i: int, num_steps: int, what: str) -> int:
    if isinstance(i, bool) or not isinstance(i, int):
        if isinstance(i, torch.Tensor) and i.numel() == 1 and not i.is_floating_point():
            i = int(i)
        else:
            raise ValueError(f"{what} entries must be ints, got {i!r}")
    if not 0 <= i < num_steps - 1:
        raise ValueError(
            f"{what} entry {i} is not a trainable step of a {num_steps}-step schedule: allowed 0..{num_steps - 2} "
            f"(step {num_steps - 1} ends at sigma 0, its transition is degenerate and never trained)"
        )
    return i


def resolve_trained_steps(
    num_steps: int,
    *,
    indices: Optional[Sequence[int]] = None,
    num_sde_steps: int = 0,
    fraction: Tuple[float, float] = (0.0, 1.0),
    pool: Optional[Sequence[int]] = None,
    resample_seed: Optional[int] = None,
    count: Optional[int] = None,
) -> list:
    """Indices of the sampling steps whose transitions are trained (stochastic steps), sorted ascending.

    Priority (the first that applies wins):

    1. ``pool`` given: draw ``count`` distinct entries of ``pool`` with a ``torch.Generator`` seeded by
       ``resample_seed`` (per-rollout resampling, e.g. MixGRPO / "random window" variants). The same seed gives the
       same answer on every rank with no communication; derive the seed from (run seed, training step).
       ``count`` defaults to ``num_sde_steps`` when that is > 0, else to ``len(pool)`` (the whole pool).
    2. ``indices`` given: exactly those steps (sorted, duplicates removed).
    3. otherwise ``num_sde_steps`` steps spread with an even stride over the window
       ``[floor(f0 * (T - 1)), ceil(f1 * (T - 1)))`` of the trainable steps ``0 .. T - 2``
       (``k``-th pick: ``start + floor(k * width / num_sde_steps)``); ``num_sde_steps == 0`` means every step in the
       window (flow_grpo's ``timestep_fraction``).

    The last step ``T - 1`` (``sigma_next == 0``) is never returned: its transition is degenerate.

    Args:
        num_steps: ``T >= 2`` sampling steps.
        fraction: ``(f0, f1)`` with ``0 <= f0 < f1 <= 1``, a window over the trainable steps.
    Returns:
        ``list[int]``, sorted, distinct, each in ``[0, T - 1)``.
    Raises:
        ValueError: an explicit / pool index outside ``[0, T - 1)`` (incl. the last step), ``pool`` without
            ``resample_seed``, ``count`` larger than the pool or < 1, ``num_sde_steps`` larger than the window, a bad
            ``fraction``, ``num_steps < 2``, ``count`` without
            ``pool``, an empty ``indices``.
    """
    if not isinstance(num_steps, int) or num_steps < 2:
        raise ValueError(f"num_steps must be an int >= 2 (one trainable step plus the final step), got {num_steps!r}")
    if num_sde_steps < 0:
        raise ValueError(f"num_sde_steps must be >= 0, got {num_sde_steps}")
    if pool is not None:
        if resample_seed is None:
            raise ValueError("pool needs resample_seed (the same seed on every rank keeps ranks in agreement)")
        checked = sorted({_check_index(i, num_steps, "pool") for i in pool})
        if len(checked) != len(pool):
            raise ValueError(f"pool has duplicate entries: {list(pool)}")
        n = count if count is not None else (num_sde_steps if num_sde_steps > 0 else len(checked))
        if not 1 <= n <= len(checked):
            raise ValueError(f"count must be in 1..{len(checked)} (pool size), got {n}")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(resample_seed))
        perm = torch.randperm(len(checked), generator=gen)[:n]
        return sorted(checked[j] for j in perm.tolist())
    if count is not None:
        raise ValueError("count is only used with pool")
    if indices is not None:
        out = sorted({_check_index(i, num_steps, "indices") for i in indices})
        if not out:
            raise ValueError("indices is empty: give at least one step index")
        return out
    f0, f1 = fraction
    if not (0.0 <= f0 < f1 <= 1.0):
        raise ValueError(f"fraction must satisfy 0 <= f0 < f1 <= 1, got {fraction!r}")
    trainable = num_steps - 1
    start = int(math.floor(f0 * trainable))
    end = min(int(math.ceil(f1 * trainable)), trainable)
    width = end - start
    if width < 1:
        raise ValueError(f"fraction {fraction!r} selects no step of the {trainable} trainable steps")
    if num_sde_steps == 0:
        return list(range(start, end))
    if num_sde_steps > width:
        raise ValueError(
            f"num_sde_steps={num_sde_steps} exceeds the {width} trainable steps in the window {fraction!r} "
            f"(steps {start}..{end - 1})"
        )
    return [start + (k * width) // num_sde_steps for k in range(num_sde_steps)]


def sample_sigmas(batch: int, generator: torch.Generator, *, kind: str = "logit_normal", logit_mean: float = 0.0,
                  logit_std: float = 1.0) -> torch.Tensor:
    """Training noise levels ``[batch]`` float32 in (0, 1) for flow-matching SFT and its anchors.

    ``logit_normal``: ``sigma = sigmoid(m + s * n)``, ``n ~ N(0, 1)`` (SD3's choice, Esser et al. 2024, section 3.1:
    more training on intermediate noise levels); ``uniform``: ``sigma ~ U(0, 1)``.

    Raises:
        ValueError: ``kind`` is not ``"logit_normal"`` or ``"uniform"``.
    """
    if kind == "logit_normal":
        return torch.sigmoid(logit_mean + logit_std * torch.randn(batch, generator=generator))
    if kind == "uniform":
        return torch.rand(batch, generator=generator)
    raise ValueError(f"sigma_sampling={kind!r} is not one of ['logit_normal', 'uniform']")
