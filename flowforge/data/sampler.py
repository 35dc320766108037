"""The K-repeat prompt sampler: which prompts each training step draws (re-exported by
:mod:`flowforge.data.prompts`).

**K-repeat sampling** (GRPO-style group sampling, as in flow_grpo's ``DistributedKRepeatSampler``). Every step draws
``M`` distinct prompts and repeats each ``K`` times, giving ``B = M * K`` candidates whose rewards are compared within
their group. Every rank builds the same batch from the seed alone, with no communication, and keeps a contiguous,
equal share of the candidates.

===========  ==================================================================================================
symbol       meaning
===========  ==================================================================================================
``N``        number of prompts in the dataset (``num_prompts``)
``M``        prompts per step (``prompts_per_step``), distinct within a step, ``M <= N``
``K``        candidates per prompt (``group_size``)
epoch ``e``  one pass over the permutation ``pi_e`` of ``0..N-1`` seeded by ``seed + e``
cursor       position in ``pi_e``; a step takes ``pi_e[cursor : cursor + M]``
===========  ==================================================================================================

A step never straddles epochs: when fewer than ``M`` prompts remain in ``pi_e`` the last ``N mod M`` are skipped for
this epoch and the next step starts epoch ``e + 1`` at cursor 0 (so an epoch is ``N // M`` steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["KRepeatBatch", "KRepeatSampler"]

_MASK63 = (1 << 63) - 1


def _mix63(value: int) -> int:
    """A bijection of ``[0, 2**63)``: add a constant (so 0 does not map to 0), then xor-shift / odd-multiply rounds
    (splitmix64-style, reduced to 63 bits). Every step is invertible modulo ``2**63``."""
    x = (value + 0x2545F4914F6CDD1D) & _MASK63
    x ^= x >> 31
    x = (x * 0x3F2A8C5B1D4E6F97) & _MASK63
    x ^= x >> 29
    x = (x * 0x1CE4E5B9A6B3D2F1) & _MASK63
    x ^= x >> 32
    return x


def _permutation(num_prompts: int, seed: int, epoch: int) -> np.ndarray:
    """``pi_e``: ``argsort`` of per-index hash keys derived from ``seed + epoch``; pure integer arithmetic, so the
    order is the same on every machine and library version. int64 ``[N]``."""
    base = np.uint64(_mix63(seed + epoch))
    keys = np.arange(num_prompts, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + base
    keys ^= keys >> np.uint64(30)
    keys *= np.uint64(0xBF58476D1CE4E5B9)
    keys ^= keys >> np.uint64(27)
    keys *= np.uint64(0x94D049BB133111EB)
    keys ^= keys >> np.uint64(31)
    return np.argsort(keys, kind="stable").astype(np.int64)


@dataclasses.dataclass(frozen=True)
class KRepeatBatch:
    """One step of K-repeat sampling; identical on every rank except ``rank_slice``.

    Candidates are ordered group-major: candidate ``j`` belongs to group ``j // K`` (``[g0]*K + [g1]*K + ...``).
    """

    step: int  # global step index of this batch (0 for the first batch ever drawn)
    epoch: int  # epoch the prompts were drawn from
    prompt_indices: torch.Tensor  # [M] int64, distinct indices into the prompt list
    group_ids: torch.Tensor  # [M*K] int64, 0..M-1, group-major
    candidate_ids: torch.Tensor  # [M*K] int64 >= 0, unique over every candidate this sampler ever draws
    rank_slice: slice  # this rank's contiguous share of the M*K candidates

    @property
    def candidate_prompt_indices(self) -> torch.Tensor:
        """``[M*K]`` int64: the prompt index of every candidate (``prompt_indices[group_ids]``)."""
        return self.prompt_indices[self.group_ids]

    @property
    def local_prompt_indices(self) -> torch.Tensor:
        """``[M*K / num_replicas]`` int64: prompt index of each candidate this rank owns."""
        return self.candidate_prompt_indices[self.rank_slice]

    @property
    def local_group_ids(self) -> torch.Tensor:
        """``[M*K / num_replicas]`` int64: group id of each candidate this rank owns."""
        return self.group_ids[self.rank_slice]

    @property
    def local_candidate_ids(self) -> torch.Tensor:
        """``[M*K / num_replicas]`` int64: candidate id (noise seed) of each candidate this rank owns."""
        return self.candidate_ids[self.rank_slice]


class KRepeatSampler:
    """Draws ``M`` distinct prompts per step, each repeated ``K`` times, identically on every rank.

    Args:
        num_prompts: ``N``, size of the prompt list, >= 1.
        prompts_per_step: ``M``, 1 <= M <= N.
        group_size: ``K``, >= 1.
        seed: int >= 0; epoch ``e`` uses the permutation seeded by ``seed + e``.
        num_replicas: number of ranks, >= 1, must divide ``M * K``.
        rank: this rank, ``0 <= rank < num_replicas``.

    ``candidate_ids`` (for seeding each candidate's noise) are ``mix63(c + mix63(seed))`` where
    ``c = steps_before * M * K + j`` counts every candidate drawn so far, ``mix63`` a bijection of ``[0, 2**63)``.
    The counter fixes (epoch, position in the epoch, prompt index, k) and the map is one-to-one, so ids never repeat
    within a run (exactly, not just with high probability) and change with the seed.

    Stateful (``torch.distributed.checkpoint.stateful.Stateful``): :meth:`state_dict` / :meth:`load_state_dict`
    carry the position, so a resumed run draws exactly the batches the interrupted one would have.

    Raises:
        ValueError: any argument outside the ranges above (the message names it).
    """

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        group_size: int,
        seed: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        for field, value, low in (
            ("num_prompts", num_prompts, 1), ("prompts_per_step", prompts_per_step, 1),
            ("group_size", group_size, 1), ("seed", seed, 0), ("num_replicas", num_replicas, 1), ("rank", rank, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{field} must be an int >= {low}, got {value!r}")
        if prompts_per_step > num_prompts:
            raise ValueError(
                f"prompts_per_step ({prompts_per_step}) must be <= num_prompts ({num_prompts}): "
                "the prompts of one step are distinct"
            )
        if rank >= num_replicas:
            raise ValueError(f"rank must be in 0..{num_replicas - 1} (num_replicas={num_replicas}), got {rank}")
        batch = prompts_per_step * group_size
        if batch % num_replicas:
            raise ValueError(
                f"prompts_per_step * group_size ({prompts_per_step} * {group_size} = {batch}) must be divisible by "
                f"num_replicas ({num_replicas})"
            )
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        per_rank = batch // num_replicas
        self._rank_slice = slice(rank * per_rank, (rank + 1) * per_rank)
        self._seed_offset = _mix63(seed)
        self.epoch = 0
        self.cursor = 0
        self.steps = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        """``N // M``: steps drawn from each permutation before the next epoch starts."""
        return self.num_prompts // self.prompts_per_step

    def _permutation_for(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = _permutation(self.num_prompts, self.seed, epoch)
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> KRepeatBatch:
        """Draw the next step's prompts and candidates and advance the sampler (see :class:`KRepeatBatch`)."""
        m, k = self.prompts_per_step, self.group_size
        if self.cursor + m > self.num_prompts:
            self.epoch += 1
            self.cursor = 0
        prompts = self._permutation_for(self.epoch)[self.cursor : self.cursor + m]
        first = self.steps * m * k
        ids = [_mix63(first + j + self._seed_offset) for j in range(m * k)]
        batch = KRepeatBatch(
            step=self.steps,
            epoch=self.epoch,
            prompt_indices=torch.from_numpy(prompts.copy()),
            group_ids=torch.arange(m).repeat_interleave(k),
            candidate_ids=torch.tensor(ids, dtype=torch.int64),
            rank_slice=self._rank_slice,
        )
        self.cursor += m
        self.steps += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Position and identity of the sampler: ``epoch``, ``cursor``, ``steps`` plus ``num_prompts``,
        ``prompts_per_step``, ``group_size`` and ``seed`` (checked on load). JSON-serialisable ints."""
        return {
            "epoch": self.epoch, "cursor": self.cursor, "steps": self.steps, "num_prompts": self.num_prompts,
            "prompts_per_step": self.prompts_per_step, "group_size": self.group_size, "seed": self.seed,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue exactly where the sampler that produced ``state`` stopped. ``num_replicas``/``rank`` may differ.

        Raises:
            ValueError: a key is missing, or ``num_prompts`` / ``prompts_per_step`` / ``group_size`` / ``seed``
                differ from this sampler's (resuming would not reproduce the run), or the position is invalid.
        """
        missing = [key for key in self.state_dict() if key not in state]
        if missing:
            raise ValueError(f"sampler state is missing keys {missing}")
        for key in ("num_prompts", "prompts_per_step", "group_size", "seed"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler has {getattr(self, key)}")
        epoch, cursor, steps = int(state["epoch"]), int(state["cursor"]), int(state["steps"])
        if epoch < 0 or steps < 0 or not 0 <= cursor <= self.num_prompts:
            raise ValueError(f"sampler state position is invalid: epoch={epoch}, cursor={cursor}, steps={steps}")
        self.epoch, self.cursor, self.steps = epoch, cursor, steps
