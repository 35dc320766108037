"""Noise-seed slots: every random draw of a candidate is a function of (run seed, candidate id, slot) only.

Slot ``-1`` is the initial ``x_T``; slot ``i`` is step ``i``'s transition noise. Forward-process objectives use
their own slot ranges for training-time noise and sigma draws (:mod:`flowforge.objectives.forward`). Never a
function of rank, batch position or chunking, so a rerun (or a resume, or another world size) reproduces them.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch


def _seed_of(seed: int, candidate_id: int, slot: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{candidate_id}:{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def candidate_noise(candidate_ids: Sequence[int], shape: Sequence[int], seed: int, slot: int) -> torch.Tensor:
    """Standard normal noise ``[B, *shape]`` fp32 on CPU, row ``b`` a function of ``(seed, candidate_ids[b], slot)``.

    ``slot`` is ``-1`` for the initial ``x_T`` and the step index ``i`` for step ``i``'s transition noise. Drawing
    on CPU with one generator per candidate makes the noise independent of device, rank, batch size and order.
    """
    out = torch.empty(len(candidate_ids), *shape)
    gen = torch.Generator()
    for row, cid in enumerate(candidate_ids):
        gen.manual_seed(_seed_of(seed, int(cid), slot))
        out[row] = torch.randn(tuple(shape), generator=gen)
    return out


def candidate_randint(candidate_ids: Sequence[int], high: int, seed: int, slot: int) -> torch.Tensor:
    """``[B]`` int64 uniform in ``[0, high)``, row ``b`` a function of ``(seed, candidate_ids[b], slot)`` only."""
    gen = torch.Generator()
    out = torch.empty(len(candidate_ids), dtype=torch.long)
    for row, cid in enumerate(candidate_ids):
        gen.manual_seed(_seed_of(seed, int(cid), slot))
        out[row] = torch.randint(high, (1,), generator=gen)
    return out
