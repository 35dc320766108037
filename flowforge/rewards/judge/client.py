"""``vlm_judge``: a group reward from a vision-language judge behind any OpenAI-compatible chat-completions API.

The judge sees one prompt's ``K`` candidates at once (``needs_group = True``), whole videos included
(``takes_video = True``: each candidate is its ordered frames, never frames of several candidates mixed), in a
seeded permutation, and answers one score per candidate (protocol: :mod:`flowforge.rewards.judge.protocol`). A paid
judge is money: every request and every billed attempt is written to the run's request ledger
(:mod:`flowforge.rewards.judge.ledger`) *before* it is sent, and an answered request is served from the ledger when
asked again -- after a crash, a resume or a rerun of the same step -- so nothing answered is sent twice.

Per group, in order:

1. each candidate -> ``N`` JPEG frames (``frames``, ``max_side``), hashed and stored under the run directory; the
   condition's first frame (``metadata["image"]``) and the reference (``metadata["reference"]``: an image file or
   a directory of frame images) likewise;
2. presented order ``perm`` = :func:`~flowforge.rewards.judge.protocol.group_permutation` (position-bias control),
   recorded with the request;
3. the ledger is asked (:meth:`~flowforge.rewards.judge.ledger.RequestLedger.claim`) by the request key and, when the
   judge is bound to a step (:meth:`VLMJudge.bind`), by the group's slot (stage, purpose, step, condition): an
   answered request is served (a slot's answer also serves re-generated media of a resumed step, mapped through its
   own permutation); a request another process left in flight is ``lost`` -- billed, answer unknown -- and never
   sent again;
4. else the request is recorded ``pending`` and sent, each attempt recorded before it leaves; at most
   ``max_attempts`` billed attempts per group over every run. A failed attempt is sent again (exponential back-off)
   only when its kind is in ``retry_on`` -- by default only the kinds that cannot have been billed: ``refused``
   (the connection was refused: nothing left the machine) and ``429`` (rate limited before any work). A timeout,
   a connection lost after sending, a 408 / 409 or a 5xx may have been processed and billed by the provider: by
   default the attempt is recorded billed and the group dropped, never sent again (opt in with ``retry_on:
   [timeout, connection, "408", "409", 5xx]``, at the cost of paying twice for what the provider did process). A
   malformed reply gets a repair message (a new request with the reply and why it was refused); a 200 whose body
   is not a chat completion is a billed failure, not repaired;
5. presented score ``j`` -> candidate ``perm[j]``. A group without scores (malformed after every attempt, no answer,
   lost) scores NaN for all its candidates and is counted in ``failures``: the trainer drops it with zero weight.
   A wrong URL, key or model (401 / 403 / 404) raises :class:`JudgeError`; a spent budget
   (``max_billed``) raises :class:`~flowforge.rewards.judge.ledger.BudgetExhausted` before the step sends anything.
   Why the last group without scores has none is kept in ``last_error`` (e.g. the judge is unreachable: every
   attempt's connection failed), which a run that cannot drop the group quotes in its error.

Metrics since the last :meth:`VLMJudge.pop_metrics` (the reward processor logs them as ``reward/<name>_<metric>``):
``requests_sent`` (HTTP attempts started), ``billed`` (of them, billed), ``served_from_ledger`` (groups),
``media_changed`` (of them, served by slot for media that differ from what was judged), ``retries`` (retries and
repairs), ``failures`` (NaN groups), ``lost`` (groups lost in a crash), ``tokens``, ``latency_s`` (mean seconds per
HTTP attempt; NaN when none was sent).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowforge.rewards.judge import protocol as P
from flowforge.rewards.judge.ledger import BudgetExhausted, LedgerEntry, RequestLedger, Slot
from flowforge.rewards.judge.options import JudgeOptions
from flowforge.rewards.judge.reference import load_reference  # noqa: F401 -- also imported from here
from flowforge.rewards.judge.transport import (  # noqa: F401 -- JudgeError, FATAL_WHAT: also imported from here
    FATAL_WHAT, JudgeError, Unanswered, retry_kind, send, settle_unanswered)

log = logging.getLogger(__name__)

LEDGER_FILE = Path("judge") / "ledger.sqlite"
"""The ledger's place in a run directory."""
MEDIA_DIR = Path("judge") / "media"
"""Where the sent frames are kept (``<sha256[:2]>/<sha256>.jpg``), next to the ledger that names them."""


@dataclasses.dataclass
class _Group:
    key: str
    perm: list[int]
    labels: list[str]
    content: list[dict]  # message parts with data URLs (what is sent)
    request: dict  # the same with {"sha256", "path"} per image (what the ledger keeps)
    slot: Slot


def _counters() -> dict[str, float]:
    return dict(requests_sent=0, billed=0, served_from_ledger=0, media_changed=0, retries=0, failures=0, lost=0,
                tokens=0, latency_total=0.0)


class VLMJudge:
    """Group VLM judge scorer (module docstring).

    Args:
        options: the judge's options (:class:`~flowforge.rewards.judge.options.JudgeOptions`, each documented there
            and in the config reference as ``reward.options.vlm_judge.<option>``), or a mapping of them. Without it,
            the keyword arguments are the options (``VLMJudge(model="m", base_url=url, frames=1)``).
        run_dir: the run directory; the ledger is ``run_dir/judge/ledger.sqlite`` and frames go to
            ``run_dir/judge/media``, unless the ``ledger`` option names an explicit path (frames beside it in
            ``media/``). Neither: an in-memory ledger (warned). The ledger is opened on first use (a rank that never
            judges never opens it).

    Raises:
        ConfigError: a bad option (a ``ValueError``, each problem naming ``reward.options.vlm_judge.<option>`` and
            the allowed values).
        ValueError: ``api_key_env`` names an unset variable.
        TypeError: both ``options`` and keyword options.
    """

    name = "vlm_judge"
    needs_group: ClassVar[bool] = True
    takes_video: ClassVar[bool] = True
    single_client: ClassVar[bool] = True  # under torchrun rank 0 judges every group: one writer of the ledger
    options_class: ClassVar[type[JudgeOptions]] = JudgeOptions  # reward.options.vlm_judge (flowforge.rewards.options)

    def __init__(self, options: JudgeOptions | Mapping[str, Any] | None = None, /, *,
                 run_dir: str | Path | None = None, **keywords: Any) -> None:
        import openai

        if options is not None and keywords:
            raise TypeError(f"VLMJudge takes its options or keyword options, not both (got {sorted(keywords)})")
        o = options if isinstance(options, JudgeOptions) else JudgeOptions.from_options(
            keywords if options is None else options)
        self.options = o
        self.retry_on = frozenset(o.retry_on)
        key = "unused"
        if o.api_key_env is not None:
            key = os.environ.get(o.api_key_env, "")
            if not key:
                raise ValueError(f"vlm_judge: environment variable {o.api_key_env} (api_key_env) is not set")
        self.model, self.frames, self.max_side, self.quality = o.model, o.frames, o.max_side, o.jpeg_quality
        self.max_attempts, self.backoff, self.paid = o.max_attempts, o.retry_backoff_s, o.paid
        # last_error: why the last group without scores has none
        self.api_key_env, self.last_error = o.api_key_env, None
        self.max_concurrency, self.seed, self.max_billed = o.max_concurrency, o.seed, o.max_billed
        self.settings = dict(temperature=float(o.temperature), max_tokens=o.max_tokens, seed=o.seed, frames=o.frames,
                             max_side=o.max_side, jpeg_quality=o.jpeg_quality)
        self.template = P.JudgeTemplate.load(o.template)
        self.reference_root = Path(o.reference_root) if o.reference_root is not None else None
        self.client = openai.OpenAI(base_url=o.base_url, api_key=key, timeout=o.timeout_s, max_retries=0)
        self._openai = openai
        root = Path(run_dir) if run_dir is not None else None
        if o.ledger is None and root is None:
            log.warning("vlm_judge has no run_dir and no ledger path: its request ledger lives in memory only")
        self.ledger_path = str(o.ledger if o.ledger is not None else (root / LEDGER_FILE if root else ":memory:"))
        self.media_dir = (Path(o.ledger).parent / "media" if o.ledger is not None else
                          root / MEDIA_DIR if root is not None else None)
        self._ledger: RequestLedger | None = None
        self._context = Slot()
        self._references: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()
        self._counts = _counters()

    @property
    def ledger(self) -> RequestLedger:
        """The request ledger (opened on first use)."""
        with self._lock:
            if self._ledger is None:
                self._ledger = RequestLedger(self.ledger_path, budget=self.max_billed)
            return self._ledger

    def bind(self, *, stage: str = "", purpose: str = "", step: int | None = None,
             policy_version: int | None = None) -> None:
        """Tag the next requests with where they belong (the ledger's slot columns): a stage, its purpose
        (``train`` / ``eval`` / ``audit``), the trainer step and the policy version. A bound group is also found by
        its slot (stage, purpose, step, condition id) -- a resumed step re-uses its recorded answers even when its
        re-generated media differ."""
        self._context = Slot(stage=stage, purpose=purpose, step=step, policy_version=policy_version)

    # ------------------------------------------------------------------------------------------------ scoring
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """Score one group: ``media`` ``[K, 3, H, W]`` images or ``[K, 3, F, H, W]`` videos in [0, 1] of one prompt.

        Returns:
            ``[K]`` float32 in [0, 1] on ``media``'s device; all NaN when the group has no scores.

        Raises:
            ValueError: bad shapes, prompts that differ within the group, an unreadable reference or condition.
            JudgeError: the server refuses the credentials, URL or model.
            BudgetExhausted: the budget cannot pay for the group.
        """
        return self.score_groups([(media, prompts, metadata)])[0]

    def score_groups(self, groups: Sequence[tuple[Tensor, Sequence[str], Sequence[dict[str, Any]]]]) -> list[Tensor]:
        """Score several groups, up to ``max_concurrency`` requests in flight; one ``[K_i]`` tensor per group.

        Several groups are prepared (JPEG frames, hashes, stored files) on up to ``max_concurrency`` threads, as a
        stage's 28 groups of ~124 frames each would otherwise be encoded one after another before the first is sent
        (PIL and torch release the GIL while they encode); one group -- a streamed group (``reward.overlap``), an
        audit's -- is prepared and sent in the calling thread, without a thread pool.

        Raises:
            BudgetExhausted: the groups to send exceed what is left of ``max_billed``; nothing was sent.
            UserError: the ledger file is not an SQLite database (:class:`RequestLedger`); nothing was written.
            ValueError: as :meth:`__call__`, for the first bad group in order.
        """
        ledger = self.ledger  # opened first: a ledger that is no database is refused before media are stored
        prepared = self._map(lambda group: self._prepare(*group), groups)
        decided: dict[str, list[float] | None] = {}  # key -> candidate-order scores (None: no scores)
        todo: dict[str, tuple[_Group, int]] = {}  # one request per key, even when a group repeats within the call
        for group in prepared:
            if group.key in decided or group.key in todo:
                continue
            entry, billed = ledger.claim(group.key, group.slot)
            if entry is not None:
                decided[group.key] = self._served(entry, group)
            elif billed >= self.max_attempts or any(retry_kind(o, h, True) not in self.retry_on
                                                    for o, h in ledger.billed_failures(group.key, group.slot)):
                decided[group.key] = None  # its attempts are spent, or one may have been billed: not sent again
            else:
                todo[group.key] = (group, self.max_attempts - billed)
        if self.max_billed and len(todo) > self.max_billed - ledger.billed():
            raise BudgetExhausted(f"vlm_judge max_billed={self.max_billed}: the judge's budget of {self.max_billed} "
                                  f"billed requests cannot pay for {len(todo)} more groups ({ledger.billed()} spent, "
                                  f"in {ledger.path}); nothing was sent; raise max_billed to continue")
        decided.update(zip(todo, self._map(lambda item: self._ask(*item), list(todo.values())), strict=True))
        out = []
        for (media, _, _), group in zip(groups, prepared, strict=True):
            scores = decided[group.key]
            if scores is None:
                self._count(failures=1)
                scores = [math.nan] * len(group.perm)
            out.append(torch.tensor(scores, dtype=torch.float32).to(media.device))
        return out

    def pop_metrics(self) -> dict[str, float]:
        """The counters since the last call (module docstring), then reset."""
        with self._lock:
            c, self._counts = self._counts, _counters()
        sent = c.pop("requests_sent")
        latency = c.pop("latency_total")
        return {"requests_sent": float(sent), **{k: float(v) for k, v in c.items()},
                "latency_s": latency / sent if sent else math.nan}

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
        self.client.close()

    # ------------------------------------------------------------------------------------------------ internals
    def _map(self, fn, items: Sequence) -> list:
        """``[fn(x) for x in items]``, on up to ``max_concurrency`` threads when there are several items; the first
        failing item in order raises."""
        workers = min(self.max_concurrency, len(items))
        if workers <= 1:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vlm_judge") as pool:
            return list(pool.map(fn, items))

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def _store(self, jpeg: bytes, digest: str) -> str | None:
        """Keep a sent frame under its hash (atomic: temp file + rename); its path, or None without a media dir."""
        if self.media_dir is None:
            return None
        path = self.media_dir / digest[:2] / f"{digest}.jpg"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(jpeg)
            os.replace(tmp, path)
        return str(path)

    def _side_media(self, metadata: Sequence[dict[str, Any]], field: str, frames: int) -> list[bytes] | None:
        """The group's ``metadata[field]`` (first one of the group) as JPEG frames, or None. ``examples`` is a list
        of image paths, one frame each (a single path is a list of one)."""
        paths = [m.get(field) for m in metadata if m.get(field)]
        if not paths:
            return None
        if field == "examples":
            listed = [paths[0]] if isinstance(paths[0], (str, Path)) else list(paths[0])
            return [f for item in listed for f in self._media_file(field, item, 1)]
        return self._media_file(field, paths[0], frames)

    def _media_file(self, field: str, name: str | Path, frames: int) -> list[bytes]:
        """The image file or frame directory ``name`` (relative: under ``reference_root``) as JPEG frames, cached."""
        path = Path(name)
        if not path.is_absolute() and self.reference_root is not None:
            path = self.reference_root / path
        cache = f"{field}:{frames}:{path}"
        if cache not in self._references:
            self._references[cache] = P.encode_media(load_reference(path), frames, self.max_side, self.quality)
        return self._references[cache]

    def _prepare(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> _Group:
        if media.dim() not in (4, 5) or media.shape[1] != 3:
            raise ValueError(f"vlm_judge media must be [K, 3, H, W] or [K, 3, F, H, W], got {tuple(media.shape)}")
        if len(prompts) != media.shape[0] or len(metadata) != media.shape[0]:
            raise ValueError(f"vlm_judge needs one prompt and metadata per candidate ({media.shape[0]}), got "
                             f"{len(prompts)} and {len(metadata)}")
        if len(set(prompts)) != 1:
            raise ValueError(f"vlm_judge scores one prompt's group at a time, got {len(set(prompts))} prompts")
        prompt = prompts[0]
        frames = [P.encode_media(item, self.frames, self.max_side, self.quality) for item in media]
        hashes = [[P.sha256_hex(f) for f in item] for item in frames]
        reference = self._side_media(metadata, "reference", self.frames)
        condition = self._side_media(metadata, "image", 1)
        examples = self._side_media(metadata, "examples", 1)
        side = {name: [P.sha256_hex(f) for f in got] if got is not None else []
                for name, got in (("reference", reference), ("condition", condition), ("examples", examples))}
        perm = P.group_permutation(self.seed, prompt, hashes)
        labels = P.candidate_labels(len(perm))
        presented = [hashes[c] for c in perm]
        # side media join the key only when present: the keys of groups without them stay what they were
        settings = {**self.settings, **{name: side[name] for name, got in (("condition", condition),
                                                                            ("examples", examples)) if got}}
        key = P.request_key(self.model, self.template.sha256, prompt, side["reference"], presented, settings)
        instructions = self.template.render(prompt, labels, len(frames[0]), reference is not None,
                                            condition is not None, bool(examples))

        def urls(jpegs: list[bytes] | None) -> list[str] | None:
            return None if not jpegs else [P.data_url(f) for f in jpegs]

        content = P.build_content(instructions, prompt, urls(reference), [urls(frames[c]) for c in perm], labels,
                                  condition=urls(condition), examples=urls(examples))

        def kept(jpegs: list[bytes] | None, digests: list[str]) -> list[dict] | None:
            if jpegs is None:
                return None
            return [{"sha256": d, "path": self._store(j, d)} for j, d in zip(jpegs, digests, strict=True)]

        ids = {m.get("sample_id") for m in metadata}
        slot = dataclasses.replace(self._context, condition=str(ids.pop()) if len(ids) == 1 and None not in ids
                                   else None)
        request = {"model": self.model, "template": {"version": self.template.version,
                                                     "sha256": self.template.sha256},
                   "settings": self.settings, "prompt": prompt, "instructions": instructions, "labels": labels,
                   "permutation": perm, "sample_ids": [m.get("sample_id") for m in metadata],
                   "frames_per_candidate": len(frames[0]), "slot": dataclasses.asdict(slot),
                   "reference": kept(reference, side["reference"]), "condition": kept(condition, side["condition"]),
                   **({"examples": kept(examples, side["examples"])} if examples else {}),
                   "candidates": [kept(frames[c], hashes[c]) for c in perm]}
        return _Group(key=key, perm=perm, labels=labels, content=content, request=request, slot=slot)

    def _served(self, entry: LedgerEntry, group: _Group) -> list[float] | None:
        """Candidate-order scores of a recorded request (through *its* permutation), None without scores."""
        self._count(served_from_ledger=1, media_changed=int(entry.key != group.key),
                    lost=int(entry.status == "lost"))
        if entry.status != "ok" or entry.scores is None:
            return None
        perm, labels = entry.request["permutation"], entry.request["labels"]
        if len(perm) != len(group.perm):
            log.warning("vlm_judge: the recorded request %s has %d candidates, the group %d; not used",
                        entry.key[:12], len(perm), len(group.perm))
            return None
        scores = [math.nan] * len(perm)
        for label, candidate in zip(labels, perm, strict=True):
            scores[candidate] = float(entry.scores[label])
        return scores

    def _ask(self, group: _Group, attempts_left: int) -> list[float] | None:
        """Send one group (retrying, repairing), every attempt recorded before it leaves; candidate-order scores or
        None. A request another run left pending after malformed answers continues with their repair."""
        ledger = self.ledger
        ledger.begin(group.key, model=self.model, template_sha256=self.template.sha256, request=group.request,
                     slot=group.slot)
        messages: list[dict] = [{"role": "user", "content": group.content}]
        prior = ledger.get(group.key)
        answers: list[dict] = list(prior.response) if prior is not None else []  # malformed ones only: still pending
        for answer in answers:  # the conversation as it stood when that run stopped: the next attempt repairs
            messages = [*messages, {"role": "assistant", "content": P.reply_text(answer["body"]) or ""},
                        {"role": "user", "content": P.repair_message(answer["verdict"].removeprefix("malformed: "),
                                                                     group.labels)}]
        outcomes: list[str] = []  # each attempt's: all connection errors = the judge is unreachable
        usage, latency, scores, error = [0, 0], 0.0, None, ""
        kind = "repair" if answers else "first"
        for attempt in range(attempts_left):
            try:
                row = ledger.start_attempt(group.key, kind)
            except BudgetExhausted as exc:
                error = str(exc)
                break
            self._count(requests_sent=1, retries=int(kind != "first"))
            try:
                text, body, used, seconds = self._send(messages)
            except Unanswered as exc:
                outcomes.append(exc.outcome)
                error = str(exc)
                if not settle_unanswered(ledger, row, exc, self.retry_on, self._count, attempt=attempt,
                                         attempts_left=attempts_left, backoff=self.backoff):
                    break
                kind = "retry"
                continue
            except JudgeError as exc:  # refused before any work: not billed
                ledger.finish_attempt(row, "http_error", billed=False, error=str(exc))
                ledger.finish(group.key, "failed", scores=None, response=answers)
                raise
            self._count(billed=1, latency_total=seconds, tokens=sum(used))
            usage, latency = [usage[0] + used[0], usage[1] + used[1]], latency + seconds
            try:
                scores = P.parse_scores(text, group.labels)
            except P.MalformedReply as exc:
                answers.append({"body": body, "verdict": f"malformed: {exc}"})
                ledger.finish_attempt(row, "answered", latency_s=seconds, tokens=used, response=answers)
                messages = [*messages, {"role": "assistant", "content": text or ""},
                            {"role": "user", "content": P.repair_message(str(exc), group.labels)}]
                kind = "repair"
                continue
            answers.append({"body": body, "verdict": "ok"})
            # the answer and the request's end commit together: an answered attempt left beside a pending request
            # (a kill between two commits) would have its group sent again by the rerun
            ledger.finish(group.key, "ok", scores=dict(zip(group.labels, scores, strict=True)), response=answers,
                          tokens=(usage[0], usage[1]), latency_s=latency, answered=(row, seconds, used),
                          request={**group.request, "repairs": [m["content"] for m in messages[2::2]]})
            out = [math.nan] * len(scores)
            for position, candidate in enumerate(group.perm):
                out[candidate] = scores[position]
            return out
        status = "malformed" if answers else "failed"
        why = error or answers[-1]["verdict"]
        log.warning("vlm_judge: request %s has no scores (%s) after its attempts: %s", group.key[:12], status, why)
        self.last_error = (f"the judge at {self.client.base_url} is unreachable ({why}) after {len(outcomes)} "
                           "attempts; check vlm_judge base_url and that the server is up"
                           if outcomes and set(outcomes) == {"connection_error"} and not answers else
                           f"the judge at {self.client.base_url} gave a group no scores ({status}: {why})")
        ledger.finish(group.key, status, scores=None, response=answers, tokens=(usage[0], usage[1]),
                      latency_s=latency, request={**group.request, "repairs": [m["content"] for m in messages[2::2]]})
        return None

    def _send(self, messages: list[dict]) -> tuple[str | None, str, tuple[int, int], float]:
        """One HTTP attempt (:func:`flowforge.rewards.judge.transport.send`) with this judge's client and settings."""
        return send(self.client, self._openai, messages, model=self.model, settings=self.settings, seed=self.seed,
                    api_key_env=self.api_key_env)
