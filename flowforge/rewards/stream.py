"""Scoring that overlaps the rollout: a group goes to the group scorers as soon as its last candidate's media exist,
while the media of later groups are still being produced (``reward.overlap``).

A paid VLM judge answers one group per request in seconds; scored after the rollout, a step waits
``ceil(G / C)`` request latencies (``G`` groups, ``C`` = the judge's ``max_concurrency``) on top of the rollout.
Streamed, the first groups' requests run while the rollout goes on, and the step waits only for what is still in
flight when the rollout ends. The update still waits for every score: training stays on-policy.

Nothing else changes: every group is scored by the same call as in
:meth:`RewardProcessor.__call__ <flowforge.rewards.processor.RewardProcessor.__call__>` (its members in row order,
the same media), per-sample components are scored on the whole batch after the rollout as before, and the metrics
are built by the same code, so a deterministic scorer gives bit-identical scores and metrics either way.

Usage (one batch of ``B`` samples)::

    stream = processor.stream(prompts, metadata, group_ids)
    for rows, media in parts_of_the_rollout:      # rows: [n] int64 indices into 0..B-1, media [n, 3, H, W]
        stream.add(rows, media)                   # complete groups are sent at once (background threads)
    media, components, metrics = stream.finish()  # waits for every score

With latent scorers (``takes_latents``) each part also brings its latents, ``stream.add(rows, media, latents)``; a
step whose scorers read no pixels passes ``media=None`` (nothing was decoded) and :meth:`ScoreStream.finish` returns
``None`` for the media.

Timing metrics (seconds, ``time.perf_counter``), beside the processor's ``reward/*``:

=========================  ==========================================================================================
``time/reward_wait``       time :meth:`ScoreStream.finish` waited for scores after the last media arrived (the
                           rollout's end): what scoring still added to the step
``perf/reward_overlap``    fraction of the group scorers' busy time (the union of their calls' intervals) that lay
                           before the rollout's end, i.e. was hidden behind it; NaN when nothing was streamed
=========================  ==========================================================================================

Errors are those of the sequential path: the first failing group in group-id order (the sequential order) raises what
its call raised; a required component's NaN raises the processor's error naming the component and the first NaN
sample. Once a call has failed no further group is sent (the sequential path stops at its first failure too).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from flowforge.rewards.groups import clear_error, concurrency


def hidden_fraction(intervals: Sequence[tuple[float, float]], boundary: float) -> float:
    """Fraction of the union of ``intervals`` (``(start, end)`` seconds) that lies before ``boundary``; NaN for an
    empty union. Example: ``[(0, 2), (1, 3)]`` with boundary 2 -> union ``[0, 3]``, 2 s of it before 2 -> 2/3."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    busy = sum(end - start for start, end in merged)
    if busy <= 0:
        return math.nan
    return sum(max(0.0, min(end, boundary) - start) for start, end in merged) / busy


class ScoreStream:
    """One batch's scoring, fed part by part (module docstring). Built by
    :meth:`~flowforge.rewards.processor.RewardProcessor.stream`.

    ``given``: what every :meth:`add` brings (``"pixels"``, ``"latents"``): monitor-only scorers that read something
    else are left out (:meth:`~flowforge.rewards.processor.RewardProcessor.training_scorers`); ``None``: every one.

    Raises:
        ValueError: ``group_ids`` not ``[B]`` for ``B`` prompts and metadata.
    """

    def __init__(self, processor: Any, prompts: Sequence[str], metadata: Sequence[dict[str, Any]],
                 group_ids: Tensor, given: Collection[str] | None = None) -> None:
        self.processor = processor
        self.prompts, self.metadata = list(prompts), list(metadata)
        batch = len(self.prompts)
        if len(self.metadata) != batch or group_ids.dim() != 1 or group_ids.shape[0] != batch:
            raise ValueError(f"a score stream needs one prompt, metadata and group id per sample ({batch}), got "
                             f"{len(self.metadata)} and group_ids of shape {tuple(group_ids.shape)}")
        self.group_ids = group_ids.detach().cpu()
        self.groups = {int(g): torch.nonzero(self.group_ids == g).squeeze(1) for g in torch.unique(self.group_ids)}
        self.missing = {g: rows.numel() for g, rows in self.groups.items()}
        self.arrived = torch.zeros(batch, dtype=torch.bool)
        self.media: Tensor | None = None  # [B, 3, H, W] / [B, 3, F, H, W], the parts' media in row order
        self.latents: Tensor | None = None  # [B, *latent], the parts' latents in row order
        self.scorers = processor.training_scorers(given)  # given: what add() will bring ("pixels", "latents")
        self.streamed = {n: s for n, s in self.scorers.items() if getattr(s, "needs_group", False)}
        self.pools = {n: ThreadPoolExecutor(max_workers=concurrency(n, s), thread_name_prefix=f"stream-{n}")
                      for n, s in self.streamed.items()}
        self.futures: dict[str, dict[int, Future]] = {n: {} for n in self.streamed}
        self.intervals: list[tuple[float, float]] = []
        self.first_send: dict[str, float] = {}
        self._lock = threading.Lock()
        self._failed = threading.Event()
        for scorer in self.streamed.values():
            clear_error(scorer)

    def add(self, rows: Tensor, media: Tensor | None, latents: Tensor | None = None) -> None:
        """Media of the samples ``rows`` (``[n]`` int64 indices into the batch, each given once over the stream):
        ``[n, 3, H, W]`` or ``[n, 3, F, H, W]`` in [0, 1] (``None``: no scorer reads pixels), and their latents
        ``[n, *latent]`` for latent scorers. Sends every group that is now complete.

        Raises:
            ValueError: a row out of range or given twice; neither media nor latents; media or latents of another
                length or sample shape.
        """
        rows = rows.detach().cpu().long()
        if media is None and latents is None:
            raise ValueError("add() needs the media or the latents of the rows")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.arrived.numel()):
            raise ValueError(f"rows must index the batch of {self.arrived.numel()} samples")
        if bool(self.arrived[rows].any()) or rows.unique().numel() != rows.numel():
            raise ValueError("a sample's media was added twice")
        if media is not None:
            self.media = self._put("media", self.media, rows, media)
        if latents is not None:
            self.latents = self._put("latents", self.latents, rows, latents)
        self.arrived[rows] = True
        for g in self.group_ids[rows].tolist():
            self.missing[g] -= 1
            if self.missing[g] == 0 and not self._failed.is_set():
                self._send(g)

    def _put(self, what: str, store: Tensor | None, rows: Tensor, part: Tensor) -> Tensor:
        """``part`` (``[n, ...]``) written to rows ``rows`` of ``store`` (made ``[B, ...]`` on the first call)."""
        if part.shape[0] != rows.numel():
            raise ValueError(f"add() got {rows.numel()} rows and {part.shape[0]} {what}")
        if store is None:
            store = torch.empty((self.arrived.numel(), *part.shape[1:]), dtype=part.dtype, device=part.device)
        elif part.shape[1:] != store.shape[1:]:
            raise ValueError(f"{what} of shape {tuple(part.shape[1:])} after {tuple(store.shape[1:])}")
        store[rows.to(store.device)] = part
        return store

    def _send(self, g: int) -> None:
        rows = self.groups[g]
        # copies: later add() calls never touch them
        media = None if self.media is None else self.media[rows.to(self.media.device)]
        latents = None if self.latents is None else self.latents[rows.to(self.latents.device)]
        prompts, metadata = [self.prompts[i] for i in rows.tolist()], [self.metadata[i] for i in rows.tolist()]
        for name, scorer in self.streamed.items():
            self.first_send.setdefault(name, time.perf_counter())
            self.futures[name][g] = self.pools[name].submit(self._score_group, name, scorer, media, prompts,
                                                            metadata, self.group_ids[rows], latents)

    def close(self) -> None:
        """Send nothing more and stop the threads (what is in flight finishes; nothing waits for it)."""
        self._failed.set()
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    @contextlib.contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """:meth:`close` the stream when the block raises (e.g. the rollout feeding it failed), then re-raise."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def _score_group(self, name, scorer, media, prompts, metadata, group_ids, latents):
        start = time.perf_counter()
        try:
            return self.processor.score_component(name, scorer, media, prompts, metadata, group_ids, None,
                                                  latents=latents)
        except BaseException:
            self._failed.set()  # no further group is sent, as the sequential path stops at its first failure
            raise
        finally:
            with self._lock:
                self.intervals.append((start, time.perf_counter()))

    def finish(self) -> tuple[Tensor | None, dict[str, Tensor], dict[str, float]]:
        """Wait for every group's scores, score the per-sample components on the whole batch, and return
        ``(media [B, ...] (None when none was added), components, metrics)`` as :meth:`RewardProcessor.__call__`
        returns ``(components, metrics)``, plus ``time/reward_wait`` and ``perf/reward_overlap``.

        Raises:
            ValueError: samples whose media never arrived; what a scorer raised (first failing group in row order);
                a required component's NaN.
        """
        rollout_end = time.perf_counter()
        try:
            if not bool(self.arrived.all()):
                raise ValueError(f"{int((~self.arrived).sum())} samples of the batch never got their media")
            components, metrics = self._collect()
        finally:
            for pool in self.pools.values():
                pool.shutdown(wait=True, cancel_futures=True)
        metrics["time/reward_wait"] = time.perf_counter() - rollout_end
        metrics["perf/reward_overlap"] = hidden_fraction(self.intervals, rollout_end)
        return self.media, components, metrics

    def _results(self, name: str) -> dict[int, tuple[Tensor, dict[str, Tensor], int | None]]:
        """Every group's result for component ``name``; when a call failed, what the first failed call raised (the
        components in order, each one's groups in group-id order: the order of the sequential path). Groups sent
        after it are waited for; unsent ones were never sent."""
        for futures in self.futures.values():
            for future in futures.values():
                future.exception()  # waits
        for futures in self.futures.values():
            for g in sorted(futures):
                if futures[g].exception() is not None:
                    raise futures[g].exception()
        return {g: f.result() for g, f in self.futures[name].items()}

    def _collect(self) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Every component's scores and metrics, in the order of the processor's scorers. The per-sample
        components are scored first, while the last groups' requests are still in flight (whatever the order:
        ``reward.weights: {vlm_judge: ...}`` with monitor-only ``eval.scorers`` after it would otherwise wait for
        the judge, then score); a per-sample scorer's error is raised where the sequential path would raise it
        (after the streamed components before it in order, whose errors come first)."""
        media, p = self.media, self.processor
        device = (media if media is not None else self.latents).device
        batch = self.arrived.numel()
        components: dict[str, Tensor] = {}
        metrics: dict[str, float] = {}
        call_start = time.perf_counter()
        local: dict[str, tuple[Any, float] | BaseException] = {}  # name -> ((scores, flags, groups), seconds)
        scorers = self.scorers
        for name, scorer in scorers.items():
            if name in self.streamed:
                continue
            start = time.perf_counter()
            clear_error(scorer)
            try:
                local[name] = (p.score_component(name, scorer, media, self.prompts, self.metadata, self.group_ids,
                                                 None, latents=self.latents), time.perf_counter() - start)
            except Exception as exc:  # raised in its turn below; nothing after it is scored, as sequentially
                local[name] = exc
                break
        for name in scorers:
            if name in self.streamed:
                start = self.first_send.get(name, time.perf_counter())
                scores = torch.full((batch,), float("nan"), dtype=torch.float32, device=device)
                flags: dict[str, Tensor] = {}
                results = self._results(name)
                for g in sorted(self.groups):
                    out, out_flags, _ = results[g]
                    rows = self.groups[g]
                    scores[rows.to(device)] = out
                    for flag, values in out_flags.items():
                        flags.setdefault(flag, torch.zeros(batch, dtype=torch.bool))[rows] = values
                groups = len(self.groups)
                metrics[f"reward/{name}_time"] = time.perf_counter() - start
            else:
                done = local[name]
                if isinstance(done, BaseException):
                    raise done
                (scores, flags, groups), metrics[f"reward/{name}_time"] = done
            components[name] = scores
            metrics.update(p.component_metrics(name, scores, flags, groups))
        metrics["reward/score_time"] = time.perf_counter() - call_start
        return components, metrics
