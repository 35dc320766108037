"""The verdict of ``flowforge export --verify``: the reloaded export's velocity against the trained policy's.

Every family's writer (:mod:`flowforge.tools.export.diffusers` for diffusers transformers,
:mod:`flowforge.tools.export.world` for the world model) computes ``v_trained`` (the trained policy on fixed
seeded inputs, fp32) and ``v_export`` (the export reloaded the way a user loads it, same inputs) and hands both to
:func:`verify_report`. It passes when

    max |v_export - v_trained| <= tol * max(1, max |v_trained|)

with ``tol`` from :data:`TOLERANCES` by what was written: ``adapter`` (the same LoRA layers reloaded), ``merged`` (a
LoRA folded into the weights: ``(W + s B A) x`` rounds differently from ``W x + s B (A x)``), ``full`` (the same
weights saved and reloaded: full fine-tunes and ``module`` runs, expected bit-equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from flowforge.models import lora as lora_lib

TOLERANCES = {"adapter": 1e-5, "merged": 1e-4, "full": 1e-5}
"""Verification tolerance relative to ``max(1, max |v_trained|)`` (see :mod:`flowforge.tools.export` for the
measurements)."""


class ExportVerificationError(RuntimeError):
    """The reloaded export's velocity differs from the trained policy's by more than the tolerance."""


@dataclass(frozen=True)
class VerifyReport:
    """Velocity comparison of a reloaded export with the trained policy on fixed inputs (fp32)."""

    max_abs_diff: float  # max |v_export - v_trained|
    max_abs_trained: float  # max |v_trained|
    base_diff: float | None  # max |v_trained - v_base|: > 0 means training changed the model (None: not computed)
    tolerance: float  # relative to max(1, max_abs_trained)
    passed: bool


def verify_report(v_export: torch.Tensor, v_trained: torch.Tensor, base_diff: float | None,
                  kind: str) -> VerifyReport:
    """Compare ``v_export`` with ``v_trained`` (same shape, any float dtype) under ``TOLERANCES[kind]``.

    Raises:
        KeyError: ``kind`` is not a key of :data:`TOLERANCES`.
    """
    tol = TOLERANCES[kind]
    diff = float((v_export.float() - v_trained.float()).abs().max())
    scale = float(v_trained.abs().max())
    return VerifyReport(max_abs_diff=diff, max_abs_trained=scale, base_diff=base_diff, tolerance=tol,
                        passed=bool(diff <= tol * max(1.0, scale)))


def describe(report: VerifyReport, trainable: str) -> str:
    """The one-line verdict the export logs: the export's difference against its tolerance, and how far training moved
    the model from the base (``max |v_trained - v_base|``; for a ``trainable`` mode whose writer does not measure
    it, the line says ``n/a`` and why)."""
    if report.base_diff is not None:
        moved = f"{report.base_diff:.3g}"
    else:  # a full / module fine-tune's weights replace the base's in memory: no base velocity to compare with
        moved = (f"n/a (not measured for lora.trainable={trainable!r}: the trained weights replace the base's, which "
                 "is not loaded a second time; the export is checked against the trained weights above)")
    return (f"max |v_export - v_trained| = {report.max_abs_diff:.3g} (tolerance {report.tolerance:.1g} x max(1, "
            f"{report.max_abs_trained:.3g})); max |v_trained - v_base| = {moved}")


def trained_velocity(policy: nn.Module, velocity: Callable[[nn.Module], torch.Tensor],
                     lora: bool) -> tuple[torch.Tensor, float | None]:
    """``(v_trained, base_diff)`` of the trained ``policy`` before a writer merges or reloads it: ``velocity(policy)``
    on the writer's probe inputs, and, for a LoRA run (``lora``), ``max |v_trained - v_base|`` with the adapters
    disabled (``None`` otherwise: a full or module run has no base left in memory to compare with)."""
    v_trained = velocity(policy)
    if not lora:
        return v_trained, None
    with lora_lib.adapters_disabled(policy):
        return v_trained, float((velocity(policy) - v_trained).abs().max())
