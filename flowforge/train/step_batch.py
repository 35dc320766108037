"""A training step's candidates (:class:`StepBatch`), below the trainer and its seams: both name it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowforge.data.prompts import PromptRecord


@dataclass
class StepBatch:
    """Stage 1's output: this rank's candidates of one step, in training order."""

    prompt_indices: torch.Tensor  # [B] int64 index into the prompt list
    group_ids: torch.Tensor  # [B] int64
    candidate_ids: torch.Tensor  # [B] int64 stable per-candidate sample ids (noise seeds)
    order: torch.Tensor  # [B] int64 training order of this rank's canonical share (row i = share[order[i]])
    global_group_ids: torch.Tensor  # [M*K] int64 group of every candidate of the step, canonical order
    rank_slice: slice  # this rank's share of the canonical order
    records: list[PromptRecord]  # [B] the prompt record of each candidate
