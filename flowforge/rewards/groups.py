"""Calling one scorer on a batch: checked calls, per-sample flags, and whole groups for ``needs_group`` scorers, also
when a group's candidates are spread over several ranks.

A group scorer (a ranking, a VLM judge comparing candidates) must see every candidate of a prompt at once. Under
``torchrun`` each rank holds a contiguous share of the step's candidates in canonical order, so a group can straddle
two ranks. :func:`score_groups_across_ranks` then:

1. all-gathers every rank's per-group member counts and gives each group one **owner**: the rank holding most of
   its members (ties: the lowest rank), so only straddling members move;
2. all-gathers the moving members (media on the CPU, prompt, metadata) and each owner scores its groups whole, the
   members ordered by (rank, local index);
3. all-gathers the scores of moved members back to their ranks.

A scorer that keeps a request ledger of its own (the ``vlm_judge``: a paid teacher must be billed once, and its
ledger has one writer) declares ``single_client = True``: rank 0 then owns every group, so it alone sends requests
and writes the ledger, and the other ranks' members travel to it and their scores back.

Every rank must call it for the same scorers in the same order (it runs collectives). The number of groups scored
is the same on every rank (all of the step's groups), so averaging the metric over ranks keeps it.

Per-sample flags: a scorer may set ``sample_flags`` (name -> ``[n]`` bool, for its last call), e.g. CLIP's
``{"truncated": ...}``; the processor logs their fractions as ``reward/<component>_<flag>_fraction``.

Several calls at once (:func:`call_many`): a scorer that waits on a service -- the ``vlm_judge`` (a paid VLM, a
student server), a ``remote`` reward service -- declares ``max_concurrency`` (an int >= 1), and a step's calls (its
groups, or its ``reward.batch_size`` slices) are then in flight together, up to that many at once, instead of one
after another. A group scorer with a ``score_groups(calls) -> list[Tensor]`` method (the judge) gets the step's
groups in one batch and keeps its own requests in flight (and checks its budget for the batch as a whole).
Results land in the order of the calls, so the scores are those of the sequential path; the first failing call in
that order raises, as it would have sequentially (calls not yet started are cancelled). ``sample_flags`` are read
only from scorers called one call at a time (they describe "the last call", which is not defined otherwise).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from flowforge.rewards.base import RewardScorer
from flowforge.runtime.distributed import DistInfo, portable_error

Flags = dict[str, Tensor]  # flag name -> [n] bool on the CPU
Call = tuple[Tensor, list[str], list[dict[str, Any]]]  # (media [n, ...], n prompts, n metadata): one scorer call


def concurrency(name: str, scorer: RewardScorer) -> int:
    """How many calls of ``scorer`` may be in flight at once: its ``max_concurrency`` (1 when it declares none).

    Raises:
        ValueError: ``max_concurrency`` is not an int >= 1.
    """
    value = getattr(scorer, "max_concurrency", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"reward component {name!r} has max_concurrency={value!r}; it must be an int >= 1")
    return value


def clear_error(scorer: RewardScorer) -> None:
    """Forget a scorer's ``last_error`` (the cause that a required component's NaN error quotes, e.g. the
    ``remote`` scorer's failed request) before the scorer's calls of a new batch."""
    if hasattr(scorer, "last_error"):
        scorer.last_error = None


def _checked(name: str, out: Any, n: int, device: torch.device) -> Tensor:
    if not isinstance(out, Tensor) or out.shape != (n,):
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"reward component {name!r} returned {shape}, expected a [{n}] tensor")
    return out.detach().to(device=device, dtype=torch.float32)


def call_scorer(name: str, scorer: RewardScorer, media: Tensor, prompts: list[str],
                metadata: list[dict[str, Any]], *, flags: bool = True) -> tuple[Tensor, Flags]:
    """``scorer(media, prompts, metadata)`` checked: ``([n] float32 on media's device, flags)``; ``flags=False``
    skips ``sample_flags`` (calls made concurrently: "the last call" is not defined).

    Raises:
        ValueError: the scorer returned something other than an ``[n]`` tensor, or flags of another length.
    """
    n = len(prompts)
    out = _checked(name, scorer(media, prompts, metadata), n, media.device)
    if not flags:
        return out, {}
    found = {}
    for flag, values in (getattr(scorer, "sample_flags", None) or {}).items():
        if not isinstance(values, Tensor) or values.shape != (n,):
            raise ValueError(f"reward component {name!r} set sample_flags[{flag!r}] of shape "
                             f"{getattr(values, 'shape', None)}, expected [{n}]")
        found[flag] = values.detach().bool().cpu()
    return out, found


def call_many(name: str, scorer: RewardScorer, count: int, make: Callable[[int], Call]) -> list[tuple[Tensor, Flags]]:
    """``count`` calls of ``scorer`` -- call ``i`` is ``make(i)`` -- checked as :func:`call_scorer`, results in call
    order (module docstring: one batch to ``score_groups``, up to ``max_concurrency`` in flight, or one after
    another).

    Raises:
        ValueError: as :func:`call_scorer`; a bad ``max_concurrency``. Whatever the first failing call raises.
    """
    if count == 0:
        return []
    batch = getattr(scorer, "score_groups", None)
    if getattr(scorer, "needs_group", False) and callable(batch):
        calls = [make(i) for i in range(count)]
        outs = batch(calls)
        if not isinstance(outs, list) or len(outs) != count:
            raise ValueError(f"reward component {name!r}: score_groups returned {type(outs).__name__} of "
                             f"{len(outs) if isinstance(outs, list) else '?'} results for {count} groups")
        return [(_checked(name, out, len(call[1]), call[0].device), {}) for out, call in zip(outs, calls)]
    workers = min(concurrency(name, scorer), count)
    if workers == 1:
        return [call_scorer(name, scorer, *make(i)) for i in range(count)]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"score-{name}") as pool:
        futures = [pool.submit(lambda i=i: call_scorer(name, scorer, *make(i), flags=False)) for i in range(count)]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:  # no new request after a failure, as the sequential path would stop there
                future.cancel()
            raise


def _owners(counts: list[dict[int, int]], single_client: bool = False) -> dict[int, int]:
    """group -> owning rank: the rank holding most members, ties to the lowest rank; rank 0 for every group with
    ``single_client``."""
    groups = sorted(set().union(*counts))
    if single_client:
        return dict.fromkeys(groups, 0)
    return {g: max(range(len(counts)), key=lambda r: (counts[r].get(g, 0), -r)) for g in groups}


def score_groups_across_ranks(name: str, scorer: RewardScorer, media: Tensor, prompts: list[str],
                              metadata: list[dict[str, Any]], group_ids: Tensor,
                              dist: DistInfo) -> tuple[Tensor, Flags, int]:
    """Score every group whole, wherever its members are (module docstring). A collective: every rank calls it.

    Args:
        media: this rank's ``[B, 3, H, W]``; prompts / metadata: its ``B`` entries.
        group_ids: ``[B]`` int64 ids that name the same group on every rank (the step's group index).

    Returns:
        ``(scores [B] float32 on media's device, flags (name -> [B] bool), number of groups over all ranks)``.

    Raises:
        ValueError: as :func:`call_scorer`. Whatever an owning rank's scorer raised (a spent judge budget, say) is
            raised on every rank (on the others as the same exception when it pickles, else a RuntimeError quoting
            it), so the ranks stop together instead of waiting for each other.
    """
    import torch.distributed as tdist

    rank, world = dist.rank, dist.world_size
    local = group_ids.tolist()
    counts: list[Any] = [None] * world
    tdist.all_gather_object(counts, dict(Counter(local)), group=dist.group)
    owner = _owners(counts, bool(getattr(scorer, "single_client", False)))
    outgoing = [(i, g, media[i].cpu(), prompts[i], metadata[i]) for i, g in enumerate(local) if owner[g] != rank]
    incoming: list[Any] = [None] * world
    tdist.all_gather_object(incoming, outgoing, group=dist.group)

    scores = torch.full((len(local),), float("nan"), dtype=torch.float32, device=media.device)
    flags: dict[str, Tensor] = {}
    returned = []  # (member's rank, its local index, score, {flag: bool}) for members of other ranks
    owned = []  # per group this rank owns: its members (rank, local index, media, prompt, metadata) in order
    for g in (g for g, r in owner.items() if r == rank):
        members = [(rank, i, media[i], prompts[i], metadata[i]) for i, gi in enumerate(local) if gi == g]
        members += [(r, i, m.to(media.device), p, md) for r in range(world) if r != rank
                    for i, gi, m, p, md in incoming[r] if gi == g]
        members.sort(key=lambda member: (member[0], member[1]))
        owned.append(members)
    try:
        results = call_many(name, scorer, len(owned), lambda k: (torch.stack([m[2] for m in owned[k]]),
                                                                 [m[3] for m in owned[k]], [m[4] for m in owned[k]]))
        error = None
    except Exception as exc:  # the other ranks still wait for this rank's scores: tell them, then raise everywhere
        results, error = [], exc
    for members, (out, out_flags) in zip(owned if error is None else [], results, strict=True):
        for j, (r, i, *_) in enumerate(members):
            member_flags = {f: bool(v[j]) for f, v in out_flags.items()}
            if r == rank:
                scores[i] = out[j]
                for f, v in member_flags.items():
                    flags.setdefault(f, torch.zeros(len(local), dtype=torch.bool))[i] = v
            else:
                returned.append((r, i, float(out[j]), member_flags))
    back: list[Any] = [None] * world
    tdist.all_gather_object(back, (returned, None if error is None else portable_error(error)), group=dist.group)
    if error is not None:
        raise error
    failed = next((e for _, e in back if e is not None), None)
    if failed is not None:  # the owner's error (e.g. a spent judge budget) on every rank, so every rank stops alike
        raise failed
    for r, i, value, member_flags in (item for part, _ in back for item in part):
        if r == rank:
            scores[i] = value
            for f, v in member_flags.items():
                flags.setdefault(f, torch.zeros(len(local), dtype=torch.bool))[i] = v
    return scores, flags, len(owner)


def local_chunks(needs_group: bool, batch: int, batch_size: int, group_ids: Tensor | None) -> list[Tensor]:
    """Index sets (int64 ``[n]``) on which a scorer is called in one process, covering ``0..B-1`` once: one per
    group (whole batch without ``group_ids``) for group scorers, else ``batch_size`` slices."""
    if needs_group:
        if group_ids is None:
            return [torch.arange(batch)]
        return [torch.nonzero(group_ids == g).squeeze(1) for g in torch.unique(group_ids)]
    return [torch.arange(start, min(start + batch_size, batch)) for start in range(0, batch, batch_size)]


def score_local(name: str, scorer: RewardScorer, media: Tensor, prompts: Sequence[str],
                metadata: Sequence[dict[str, Any]], chunks: list[Tensor]) -> tuple[Tensor, Flags]:
    """Score ``media`` chunk by chunk in this process (:func:`call_many`: concurrently where the scorer allows):
    ``([B] float32 on media's device, flags)``; a flag a chunk does not report is False for its samples."""
    batch = media.shape[0]
    scores = torch.full((batch,), float("nan"), dtype=torch.float32, device=media.device)
    flags: dict[str, Tensor] = {}
    chunks = [index for index in chunks if index.numel()]

    def make(k: int) -> Call:
        rows = chunks[k].tolist()
        return media[chunks[k].to(media.device)], [prompts[i] for i in rows], [metadata[i] for i in rows]

    for index, (out, out_flags) in zip(chunks, call_many(name, scorer, len(chunks), make), strict=True):
        scores[index.to(media.device)] = out
        for flag, values in out_flags.items():
            flags.setdefault(flag, torch.zeros(batch, dtype=torch.bool))[index] = values
    return scores, flags
