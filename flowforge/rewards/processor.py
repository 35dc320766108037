"""Scores a rollout's media with every reward component and reports per-component statistics.

The processor is stage 3 of the training loop (``docs/architecture.md``, section "Rewards"): it returns the raw
per-sample reward of each component; the weighted / group-relative combination into advantages lives in
``flowforge.algorithms.advantages``, which receives ``components`` and ``weights``. Components come in three kinds:

* **weighted** (a name in ``weights``): enters the advantage with that weight;
* **required** (a name in ``required``, must also be weighted): a NaN score is an error, not "not applicable";
* **monitor-only** (a scorer without a weight): scored and logged, never optimised.

Metrics (python floats; times in seconds, measured with ``time.perf_counter``, after a CUDA synchronise when the media
is on a GPU):

=================================  ===================================================================================
``reward/<name>_mean``             mean over the non-NaN scores (NaN when all are NaN)
``reward/<name>_std``              population standard deviation (``correction=0``) over the non-NaN scores
``reward/<name>_nan_fraction``     fraction of samples scored NaN ("not applicable")
``reward/<name>_time``             wall time of this component, all its batches
``reward/<name>_groups_scored``    ``needs_group`` scorers only: groups scored whole (with ``dist``: of all ranks)
``reward/<name>_<flag>_fraction``  fraction of samples a scorer flagged in ``sample_flags`` (e.g. CLIP's
                                   ``truncated``: prompts cut at the tokenizer's limit)
``reward/<name>_<metric>``         what a scorer's ``pop_metrics() -> {metric: float}`` returns after the call, e.g.
                                   ``vlm_judge``'s ``requests_sent``, ``served_from_ledger``, ``failures``
``reward/score_time``              wall time of the whole call
=================================  ===================================================================================

Concurrency: a scorer that waits on a service (the ``vlm_judge``, a ``remote`` reward service) declares
``max_concurrency``, and its calls of one batch -- every group of a step, or every ``batch_size`` slice -- are in
flight together up to that many at once; the results land in the order of the sequential path, so the scores and
metrics are the same (:func:`flowforge.rewards.groups.call_many`). :meth:`RewardProcessor.stream` goes one step
further (``reward.overlap``): a group is sent while the media of later groups are still being rolled out
(:mod:`flowforge.rewards.stream`).

Group scorers see whole groups: one call per group id; with ``dist`` (under ``torchrun``) groups that straddle ranks
are gathered to one rank, scored and the scores sent back (:mod:`flowforge.rewards.groups`).

Paid scorers (``paid = True``, :func:`~flowforge.rewards.base.is_paid`: ``vlm_judge``): a call with ``paid_groups=N``
(the trainer's evaluation passes ``eval.teacher_groups``, in every run) asks them only for the rows of the ``N``
smallest group ids -- NaN elsewhere, and no component at all with ``N = 0`` (nothing is sent); their metrics are
then over the rows they scored. ``paid_groups=None`` (training) asks every scorer of :meth:`training_scorers` for
every row: a paid scorer without a weight is never called on a training step.

Latent scorers (``takes_latents = True``, :func:`~flowforge.rewards.base.takes_latents`) are given the clean latents
``[B, *latent]`` (``latents=``) in the place of the media; :meth:`RewardProcessor.inputs` says what a training step
or an evaluation must hand over (``"pixels"``, ``"latents"``, ``"audio"``), so the trainer decodes only what is read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowforge.media import AudioBatch, video_frames
from flowforge.rewards.base import (RewardScorer, check_batch_size, check_media_batch, is_paid, scorer_reads,
                                    takes_audio, takes_latents, takes_video)
from flowforge.rewards.groups import (call_scorer, clear_error, local_chunks, score_groups_across_ranks,
                                      score_local)
from flowforge.runtime.distributed import DistInfo


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RewardProcessor:
    """Runs named reward scorers over a batch of media.

    Args:
        scorers: component name -> scorer (the name is the key used in metrics and ``components``).
        weights: component name -> finite float weight; every name must be a key of ``scorers``.
        required: names whose scores must never be NaN; each must be a key of ``scorers`` and of ``weights``.
        batch_size: samples per scorer call, >= 1. Scorers with ``needs_group = True`` are never split by it: they
            are called once per group when ``group_ids`` is given, else once on the whole batch.

    Raises:
        ValueError: no scorers; an unknown name in ``weights`` or ``required`` (the message lists the known names);
            a required component without a weight; a non-finite weight; a bad ``batch_size``.
    """

    def __init__(
        self,
        scorers: Mapping[str, RewardScorer],
        weights: Mapping[str, float],
        required: Sequence[str] = (),
        *,
        batch_size: int = 64,
    ) -> None:
        if not scorers:
            raise ValueError("scorers must name at least one reward component")
        known = sorted(scorers)
        for name in weights:
            if name not in scorers:
                raise ValueError(f"weights names unknown reward component {name!r}; known components: {known}")
        for name in required:
            if name not in scorers:
                raise ValueError(f"required names unknown reward component {name!r}; known components: {known}")
            if name not in weights:
                raise ValueError(
                    f"required reward component {name!r} has no weight; give it one in weights "
                    f"(weighted components: {sorted(weights)})"
                )
        for name, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"weights[{name!r}] must be a finite number, got {weight!r}")
        check_batch_size(batch_size)
        self.scorers = dict(scorers)
        self.weights = {name: float(weight) for name, weight in weights.items()}
        self.required = tuple(dict.fromkeys(required))
        self.batch_size = batch_size

    def training_scorers(self, given: Collection[str] | None = None) -> dict[str, RewardScorer]:
        """The scorers a training step calls, in order: every weighted one and every free monitor-only one. A paid
        scorer without a weight (a judge named only in ``eval.scorers``) is evaluation-only: on a training step it
        would be billed for a score that trains nothing. With ``given`` (what the step holds: ``"pixels"``,
        ``"latents"``, ``"audio"``) a monitor-only scorer that reads something else is left out: it never makes a
        step decode (:meth:`inputs`) and is scored at evaluation."""
        return {n: s for n, s in self.scorers.items() if n in self.weights
                or (not is_paid(s) and (given is None or scorer_reads(s) <= set(given)))}

    def inputs(self, evaluation: bool = False) -> frozenset[str]:
        """What a training step must hand over: what its weighted scorers read (``evaluation``: what every scorer
        reads): ``"pixels"`` (decoded media: every scorer but a latent one), ``"latents"`` (``takes_latents``),
        ``"audio"`` (``takes_audio``). The trainer decodes pixels / audio only when they are named here; a
        monitor-only scorer (named only in ``eval.scorers``) never asks for a decode on a training step, it is
        scored there when the step holds what it reads (:meth:`training_scorers`)."""
        scorers = self.scorers.values() if evaluation else [self.scorers[n] for n in self.weights]
        return frozenset().union(*(scorer_reads(s) for s in scorers))

    @staticmethod
    def given(media: Tensor | None, latents: Tensor | None, audio: AudioBatch | None) -> frozenset[str]:
        """The names of :meth:`inputs` that a call holds (the arguments not ``None``)."""
        return frozenset(k for k, v in (("pixels", media), ("latents", latents), ("audio", audio)) if v is not None)

    def score_component(self, name: str, scorer: RewardScorer, media: Tensor | None, prompts: list[str],
               metadata: list[dict[str, Any]], group_ids: Tensor | None, dist: DistInfo | None,
               audio: AudioBatch | None = None, latents: Tensor | None = None):
        """One component: ``([B] float32, flags, groups scored or None for a per-sample scorer)``. A video batch
        goes whole to a ``takes_video`` scorer; any other scores its frames, averaged per video (a flag: any frame).
        A ``takes_audio`` scorer gets the whole media and ``audio=`` the rows of ``audio`` it scores. A
        ``takes_latents`` scorer gets ``latents`` ``[B, *latent]`` whole in the place of the media.

        Raises:
            ValueError: the input the scorer reads (``media`` or ``latents``) was not given.
        """
        if takes_latents(scorer):
            if latents is None:
                raise ValueError(f"reward component {name!r} scores latents (takes_latents) but none were given")
            media = latents  # whole: a latent video is not split into frames
        elif media is None:
            raise ValueError(f"reward component {name!r} scores decoded media but none were given (only latents)")
        if takes_audio(scorer):
            return self._score_with_audio(name, scorer, media, prompts, metadata, group_ids, audio)
        if media.ndim == 5 and not takes_video(scorer) and not takes_latents(scorer):
            f = media.shape[2]
            scores, flags, groups = self.score_component(name, scorer, video_frames(media),
                                                [p for p in prompts for _ in range(f)],
                                                [m for m in metadata for _ in range(f)],
                                                None if group_ids is None else group_ids.repeat_interleave(f), dist)
            return scores.view(-1, f).mean(1), {k: v.view(-1, f).any(1) for k, v in flags.items()}, groups
        needs_group = bool(getattr(scorer, "needs_group", False))
        if needs_group and group_ids is not None and dist is not None and dist.enabled:
            return score_groups_across_ranks(name, scorer, media, prompts, metadata, group_ids, dist)
        chunks = local_chunks(needs_group, media.shape[0], self.batch_size, group_ids)
        scores, flags = score_local(name, scorer, media, prompts, metadata, chunks)
        return scores, flags, (len(chunks) if needs_group else None)

    def _score_with_audio(self, name: str, scorer: RewardScorer, media: Tensor, prompts: list[str],
                          metadata: list[dict[str, Any]], group_ids: Tensor | None, audio: AudioBatch | None):
        """A ``takes_audio`` component, in this process: chunk by chunk (per group for a group scorer), each call
        ``scorer(media[rows], prompts, metadata, audio=audio.index(rows))``.

        Raises:
            ValueError: no ``audio`` (the model produced none) or not one row per sample.
        """
        if audio is None:
            raise ValueError(f"reward component {name!r} scores audio (takes_audio) but this model produced none; "
                             "use an audio-video family (model.adapter=ltx2) or drop the component")
        if len(audio) != media.shape[0]:
            raise ValueError(f"audio has {len(audio)} rows for {media.shape[0]} samples")
        needs_group = bool(getattr(scorer, "needs_group", False))
        chunks = [c for c in local_chunks(needs_group, media.shape[0], self.batch_size, group_ids) if c.numel()]
        scores = torch.full((media.shape[0],), float("nan"), dtype=torch.float32, device=media.device)
        flags: dict[str, Tensor] = {}
        for index in chunks:
            rows = index.tolist()
            part = audio.index(index)
            out, _ = call_scorer(name, lambda m, p, md, part=part: scorer(m, p, md, audio=part),
                                         media[index.to(media.device)], [prompts[i] for i in rows],
                                         [metadata[i] for i in rows], flags=False)
            scores[index.to(media.device)] = out
            for flag, values in (getattr(scorer, "sample_flags", None) or {}).items():
                flags.setdefault(flag, torch.zeros(media.shape[0], dtype=torch.bool))[index] = values.bool().cpu()
        return scores, flags, (len(chunks) if needs_group else None)

    def __call__(
        self,
        media: Tensor | None,
        prompts: Sequence[str],
        metadata: Sequence[dict[str, Any]],
        group_ids: Tensor | None = None,
        *,
        dist: DistInfo | None = None,
        audio: AudioBatch | None = None,
        paid_groups: int | None = None,
        latents: Tensor | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Score ``media`` with every component.

        Args:
            media: ``[B, 3, H, W]`` float in [0, 1], or videos ``[B, 3, F, H, W]`` (see :meth:`score_component`);
                ``None`` when no scorer reads pixels (:meth:`inputs`) and ``latents`` are given.
            prompts: ``B`` prompt strings.
            metadata: ``B`` metadata dicts (task-specific keys such as ``"digit"`` are read by the scorers).
            group_ids: optional ``[B]`` int group id per sample, used only to call group scorers per group.
            dist: this rank's :class:`DistInfo` when every rank scores its share of one step together (a collective
                for group scorers: every rank must call); ``None`` scores this process's batch alone.
            audio: the sound of each sample (an audio-video model), for ``takes_audio`` components (scored in this
                process, group scorers per local group).
            paid_groups: ``None`` (training): every scorer of :meth:`training_scorers` scores every row. An int
                ``N >= 0``: paid scorers score only the rows
                of the ``N`` smallest group ids (NaN elsewhere; left out of ``components`` when that is no row) --
                evaluation (module docstring). Needs ``group_ids``; one process (not with an enabled ``dist``).
            latents: the clean latents ``[B, *latent]`` (float32) for ``takes_latents`` components.

        Returns:
            ``(components, metrics)``: ``components[name]`` is ``[B]`` float32 on its input's device (NaN = not
            applicable), in the order of ``scorers``; ``metrics`` as in the module docstring.

        Raises:
            ValueError: bad inputs (neither ``media`` nor ``latents``; ``latents`` not ``[B, ...]``; the input a scorer
                reads missing); a scorer returned the wrong shape; a required component scored NaN (the message
                names the component and the first offending sample index); ``paid_groups`` without ``group_ids``,
                negative, or with an enabled ``dist``.
        """
        if media is not None:
            batch = check_media_batch(media, prompts, metadata)
        elif latents is None:
            raise ValueError("the reward processor needs media or latents; got neither")
        else:
            batch = len(prompts)
            if len(metadata) != batch:
                raise ValueError(f"metadata must have one entry per prompt ({batch}), got {len(metadata)}")
        if latents is not None and (latents.dim() < 2 or latents.shape[0] != batch or not latents.is_floating_point()):
            raise ValueError(f"latents must be a floating [B={batch}, ...] tensor, got {tuple(latents.shape)} "
                             f"{latents.dtype}")
        device = (media if media is not None else latents).device
        if group_ids is not None and (group_ids.dim() != 1 or group_ids.shape[0] != batch):
            raise ValueError(f"group_ids must have shape [{batch}], got {tuple(group_ids.shape)}")
        if paid_groups is not None and (group_ids is None or paid_groups < 0 or (dist is not None and dist.enabled)):
            raise ValueError(f"paid_groups={paid_groups!r} needs group_ids, a value >= 0 and one process")
        prompts, metadata = list(prompts), list(metadata)
        group_cpu = None if group_ids is None else group_ids.detach().cpu()
        components: dict[str, Tensor] = {}
        metrics: dict[str, float] = {}
        _sync(device)
        call_start = time.perf_counter()
        scorers = self.training_scorers(self.given(media, latents, audio)) if paid_groups is None else self.scorers
        for name, scorer in scorers.items():
            rows = None
            if paid_groups is not None and is_paid(scorer):  # evaluation: a paid scorer on the groups allowed only
                rows = torch.nonzero(torch.isin(group_cpu, torch.unique(group_cpu)[:paid_groups])).view(-1)
                if not rows.numel():
                    continue
            start = time.perf_counter()
            clear_error(scorer)
            if rows is None:
                scores, flags, groups = self.score_component(name, scorer, media, prompts, metadata, group_cpu, dist,
                                                             audio, latents)
                components[name] = scores
            else:
                kept = rows.tolist()
                scores, flags, groups = self.score_component(
                    name, scorer, None if media is None else media[rows.to(media.device)], [prompts[i] for i in kept],
                    [metadata[i] for i in kept], group_cpu[rows], None, None if audio is None else audio.index(rows),
                    None if latents is None else latents[rows.to(latents.device)])
                components[name] = torch.full((batch,), math.nan, dtype=scores.dtype, device=scores.device)
                components[name][rows.to(scores.device)] = scores
            _sync(device)
            metrics[f"reward/{name}_time"] = time.perf_counter() - start
            # a single-client scorer under torchrun (the judge) did every rank's work on rank 0: the other ranks'
            # counters are NaN, so the mean over ranks that have a value is rank 0's count, not a share of it
            own = not (dist is not None and dist.enabled and not dist.is_main and group_cpu is not None
                       and getattr(scorer, "needs_group", False) and getattr(scorer, "single_client", False))
            metrics.update(self.component_metrics(name, scores, flags, groups, own_counters=own))
        metrics["reward/score_time"] = time.perf_counter() - call_start
        return components, metrics

    def component_metrics(self, name: str, scores: Tensor, flags: dict[str, Tensor],
                          groups: int | None, *, own_counters: bool = True) -> dict[str, float]:
        """The metrics of one scored component (module docstring), the scorer's own counters popped (NaN with
        ``own_counters=False``: another rank did this scorer's work).

        Raises:
            ValueError: a required component scored NaN (the message names the component and the first offending
                sample index, and the scorer's ``last_error`` when it has one).
        """
        scorer, batch = self.scorers[name], scores.shape[0]
        nan = torch.isnan(scores)
        if name in self.required and bool(nan.any()):
            first = int(torch.nonzero(nan)[0, 0])
            cause = getattr(scorer, "last_error", None)  # e.g. the remote scorer's failed request
            raise ValueError(
                f"required reward component {name!r} scored NaN for sample {first} "
                f"({int(nan.sum())} of {batch} samples are NaN)" + (f": {cause}" if cause else "")
            )
        valid = scores[~nan]
        metrics = {f"reward/{name}_mean": valid.mean().item() if valid.numel() else float("nan"),
                   f"reward/{name}_std": valid.std(correction=0).item() if valid.numel() else float("nan"),
                   f"reward/{name}_nan_fraction": nan.float().mean().item() if batch else 0.0}
        if groups is not None:
            metrics[f"reward/{name}_groups_scored"] = float(groups)
        for flag, values in flags.items():
            metrics[f"reward/{name}_{flag}_fraction"] = values.float().mean().item() if batch else 0.0
        pop = getattr(scorer, "pop_metrics", None)  # counters of a scorer's own work, e.g. the judge's requests
        for key, value in (pop() if callable(pop) else {}).items():
            metrics[f"reward/{name}_{key}"] = float(value) if own_counters else math.nan
        return metrics

    def check_finite(self, components: Mapping[str, Tensor], names: Sequence[str]) -> None:
        """Refuse NaN / inf scores in the components ``names`` (the weighted ones of a run that cannot drop a group),
        naming the component, how many samples, and why when its scorer knows (``last_error``: e.g. an unreachable
        judge), instead of a bare non-finite reward.

        Raises:
            ValueError: a component in ``names`` holds a non-finite score.
        """
        for name in names:
            bad = ~torch.isfinite(components[name])
            if bool(bad.any()):
                cause = getattr(self.scorers.get(name), "last_error", None)
                raise ValueError(f"reward component {name!r} scored NaN/inf for {int(bad.sum())} of {bad.numel()} "
                                 "samples" + (f": {cause}" if cause else "; rewards must be finite"))

    def stream(self, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], group_ids: Tensor,
               given: Collection[str] | None = None):
        """A :class:`~flowforge.rewards.stream.ScoreStream` for one batch of ``B`` samples whose media arrive in
        parts: each group is sent to the group scorers as soon as its last member arrives (``reward.overlap``).

        Args:
            prompts / metadata: ``B`` entries. group_ids: ``[B]`` int group id per sample.
            given: what each part will bring (``"pixels"``, ``"latents"``; :meth:`training_scorers`).
        """
        from flowforge.rewards.stream import ScoreStream

        return ScoreStream(self, prompts, metadata, group_ids, given)
