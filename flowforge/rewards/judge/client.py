"""``vlm_judge``: a group reward from a vision-language judge behind any OpenAI-compatible chat-completions API.

The judge sees one prompt's ``K`` candidates at once (``needs_group = True``), in a seeded permutation, and answers one
score per candidate (protocol: :mod:`flowforge.rewards.judge.protocol`). Every answered request is kept in the run's
request ledger (:mod:`flowforge.rewards.judge.ledger`) and served from it when asked again -- after a crash, a resume
or a rerun of the same step -- so no answered request is sent twice.

Per group, in order:

1. each candidate -> ``N`` JPEG frames (``frames``, ``max_side``), hashed; the reference (``metadata["reference"]``,
   an image file or a directory of frame images) likewise;
2. presented order ``perm`` = :func:`~flowforge.rewards.judge.protocol.group_permutation` (position-bias control);
3. key = :func:`~flowforge.rewards.judge.protocol.request_key`; a ledger hit returns the stored scores;
4. else send; transport failures (timeouts, connection errors, 408 / 409 / 429 / 5xx) are retried up to
   ``max_retries`` times with exponential back-off; a malformed reply gets a repair message, up to ``max_repairs``
   times; the answer (ok or still malformed) is recorded in the ledger before it is used;
5. presented score ``j`` -> candidate ``perm[j]``. A group that stays malformed, or whose request fails after every
   retry, scores NaN for all its candidates and is counted in ``failures``; a wrong URL, key or model
   (401 / 403 / 404) raises :class:`JudgeError`.

Metrics since the last :meth:`VLMJudge.pop_metrics` (the reward processor logs them as ``reward/<name>_<metric>``):
``requests_sent`` (HTTP requests, retries and repairs included), ``served_from_ledger`` (groups), ``retries``
(transport retries + repairs), ``failures`` (NaN groups), ``tokens`` (prompt + completion, as reported),
``latency_s`` (mean seconds per HTTP request sent; NaN when none was sent).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowforge.rewards.judge import protocol as P
from flowforge.rewards.judge.ledger import LedgerEntry, RequestLedger

log = logging.getLogger(__name__)

LEDGER_FILE = Path("judge") / "ledger.sqlite"
"""The ledger's place in a run directory."""
MEDIA_DIR = Path("judge") / "media"
"""Where the sent frames are kept (``<sha256[:2]>/<sha256>.jpg``), next to the ledger that names them."""
RETRY_STATUS = frozenset({408, 409, 429})
FATAL_STATUS = frozenset({401, 403, 404})
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class JudgeError(RuntimeError):
    """The judge cannot work at all (bad credentials, URL or model name): an error, never a reward."""


class _NoAnswer(Exception):
    """A request that got no usable HTTP answer after every retry (or a non-retryable 4xx)."""


@dataclasses.dataclass
class _Group:
    key: str
    perm: list[int]
    labels: list[str]
    content: list[dict]  # message parts with data URLs (what is sent)
    request: dict  # the same with {"sha256", "path"} per image (what the ledger keeps)


def _counters() -> dict[str, float]:
    return dict(requests_sent=0, served_from_ledger=0, retries=0, failures=0, tokens=0, latency_total=0.0)


class VLMJudge:
    """Group VLM judge scorer (module docstring).

    Args:
        model: model name sent in each request.
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        api_key_env: environment variable holding the API key / bearer token; ``None`` sends a placeholder (a server
            run with ``--no-auth``).
        timeout_s: seconds per HTTP request.
        max_concurrency: groups in flight at once in :meth:`score_groups`.
        template: template file (default: the shipped ``group_v1``).
        frames: frames per video (``N``); images are one frame. max_side: longest side of a sent frame, pixels.
        max_repairs: repair messages after malformed replies. max_retries: re-sends after transport failures.
        retry_backoff_s: first back-off; doubled per retry.
        seed: permutation seed (also sent as the request's ``seed``).
        temperature, max_tokens: generation settings sent with each request (part of the request key).
        jpeg_quality: JPEG quality of the frames (part of the key through the frame hashes).
        reference_root: directory that relative ``metadata["reference"]`` paths are read from (default: cwd).
        run_dir: the run directory; the ledger is ``run_dir/judge/ledger.sqlite`` and frames go to
            ``run_dir/judge/media``. ledger: an explicit ledger path instead. Neither: an in-memory ledger (warned).

    Raises:
        ValueError: a bad option, or ``api_key_env`` names an unset variable.
    """

    name = "vlm_judge"
    needs_group: ClassVar[bool] = True

    def __init__(self, *, model: str, base_url: str, api_key_env: str | None = "OPENAI_API_KEY",
                 timeout_s: float = 120.0, max_concurrency: int = 4, template: str | Path | None = None,
                 frames: int = 24, max_side: int = 832, max_repairs: int = 2, max_retries: int = 3,
                 retry_backoff_s: float = 1.0, seed: int = 0, temperature: float = 0.0, max_tokens: int = 512,
                 jpeg_quality: int = 90, reference_root: str | Path | None = None,
                 run_dir: str | Path | None = None, ledger: str | Path | None = None) -> None:
        import openai

        for opt, value, low in (("max_concurrency", max_concurrency, 1), ("frames", frames, 1),
                                ("max_side", max_side, 1), ("max_repairs", max_repairs, 0),
                                ("max_retries", max_retries, 0), ("max_tokens", max_tokens, 1),
                                ("jpeg_quality", jpeg_quality, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"vlm_judge option {opt} must be an int >= {low}, got {value!r}")
        if not timeout_s > 0 or retry_backoff_s < 0 or temperature < 0:
            raise ValueError(f"vlm_judge needs timeout_s > 0, retry_backoff_s >= 0 and temperature >= 0, got "
                             f"{timeout_s!r}, {retry_backoff_s!r}, {temperature!r}")
        if not model or not base_url:
            raise ValueError("vlm_judge needs a model name and a base_url")
        key = "unused"
        if api_key_env is not None:
            key = os.environ.get(api_key_env, "")
            if not key:
                raise ValueError(f"vlm_judge: environment variable {api_key_env} (api_key_env) is not set")
        self.model, self.frames, self.max_side, self.quality = model, frames, max_side, jpeg_quality
        self.max_repairs, self.max_retries, self.backoff = max_repairs, max_retries, retry_backoff_s
        self.max_concurrency, self.seed = max_concurrency, seed
        self.settings = dict(temperature=float(temperature), max_tokens=max_tokens, seed=seed, frames=frames,
                             max_side=max_side, jpeg_quality=jpeg_quality, max_repairs=max_repairs)
        self.template = P.JudgeTemplate.load(template)
        self.reference_root = Path(reference_root) if reference_root is not None else None
        self.client = openai.OpenAI(base_url=base_url, api_key=key, timeout=timeout_s, max_retries=0)
        self._openai = openai
        root = Path(run_dir) if run_dir is not None else None
        if ledger is None and root is None:
            log.warning("vlm_judge has no run_dir and no ledger path: its request ledger lives in memory only")
        self.ledger = RequestLedger(ledger if ledger is not None else (root / LEDGER_FILE if root else ":memory:"))
        self.media_dir = root / MEDIA_DIR if root is not None else None
        self._references: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()
        self._counts = _counters()

    # ------------------------------------------------------------------------------------------------ scoring
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """Score one group: ``media`` ``[K, 3, H, W]`` images or ``[K, 3, F, H, W]`` videos in [0, 1] of one prompt.

        Returns:
            ``[K]`` float32 in [0, 1] on ``media``'s device; all NaN when the group failed.

        Raises:
            ValueError: bad shapes, prompts that differ within the group, an unreadable reference.
            JudgeError: the server refuses the credentials, URL or model.
        """
        return self.score_groups([(media, prompts, metadata)])[0]

    def score_groups(self, groups: Sequence[tuple[Tensor, Sequence[str], Sequence[dict[str, Any]]]]) -> list[Tensor]:
        """Score several groups, up to ``max_concurrency`` requests in flight; one ``[K_i]`` tensor per group."""
        prepared = [self._prepare(*group) for group in groups]
        results: list[list[float] | None] = [None] * len(prepared)
        pending: dict[str, _Group] = {}  # one request per key, even when a group repeats within the call
        for i, group in enumerate(prepared):
            entry = self.ledger.get(group.key)
            if entry is None:
                pending.setdefault(group.key, group)
                continue
            self._count(served_from_ledger=1)
            results[i] = self._presented_scores(entry, group)
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            asked = dict(zip(pending, pool.map(self._ask, pending.values()), strict=True))
        for i, group in enumerate(prepared):
            if group.key in asked:
                results[i] = asked[group.key]
        out = []
        for (media, _, _), group, scores in zip(groups, prepared, results, strict=True):
            row = torch.full((len(group.perm),), float("nan"), dtype=torch.float32)
            if scores is not None:
                for position, candidate in enumerate(group.perm):
                    row[candidate] = scores[position]
            else:
                self._count(failures=1)
            out.append(row.to(media.device))
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
        self.ledger.close()
        self.client.close()

    # ------------------------------------------------------------------------------------------------ internals
    def _count(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def _store(self, jpeg: bytes, digest: str) -> str | None:
        """Keep a sent frame under its hash (atomic: temp file + rename); its path, or None without a run dir."""
        if self.media_dir is None:
            return None
        path = self.media_dir / digest[:2] / f"{digest}.jpg"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(jpeg)
            os.replace(tmp, path)
        return str(path)

    def _reference(self, metadata: Sequence[dict[str, Any]]) -> list[bytes] | None:
        """The group's reference frames (first ``metadata["reference"]`` of the group), or None."""
        paths = [m.get("reference") for m in metadata if m.get("reference")]
        if not paths:
            return None
        path = Path(paths[0])
        if not path.is_absolute() and self.reference_root is not None:
            path = self.reference_root / path
        if str(path) not in self._references:
            self._references[str(path)] = P.encode_media(load_reference(path), self.frames, self.max_side,
                                                         self.quality)
        return self._references[str(path)]

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
        reference = self._reference(metadata)
        ref_hashes = [P.sha256_hex(f) for f in reference] if reference is not None else []
        perm = P.group_permutation(self.seed, prompt, hashes)
        labels = P.candidate_labels(len(perm))
        presented = [hashes[c] for c in perm]
        key = P.request_key(self.model, self.template.sha256, prompt, ref_hashes, presented, self.settings)
        instructions = self.template.render(prompt, labels, len(frames[0]), reference is not None)
        content = P.build_content(instructions, prompt, None if reference is None else
                                  [P.data_url(f) for f in reference], [[P.data_url(f) for f in frames[c]]
                                                                       for c in perm], labels)

        def kept(jpegs: list[bytes], digests: list[str]) -> list[dict]:
            return [{"sha256": d, "path": self._store(j, d)} for j, d in zip(jpegs, digests, strict=True)]

        request = {"model": self.model, "template": {"version": self.template.version,
                                                     "sha256": self.template.sha256},
                   "settings": self.settings, "prompt": prompt, "instructions": instructions, "labels": labels,
                   "permutation": perm, "sample_ids": [m.get("sample_id") for m in metadata],
                   "reference": kept(reference, ref_hashes) if reference is not None else None,
                   "candidates": [kept(frames[c], hashes[c]) for c in perm]}
        return _Group(key=key, perm=perm, labels=labels, content=content, request=request)

    @staticmethod
    def _presented_scores(entry: LedgerEntry, group: _Group) -> list[float] | None:
        if entry.status != "ok" or entry.scores is None:
            return None
        return [float(entry.scores[label]) for label in group.labels]

    def _ask(self, group: _Group) -> list[float] | None:
        """Send one group (repairing malformed replies), record the answer; presented-order scores or None."""
        messages: list[dict] = [{"role": "user", "content": group.content}]
        attempts: list[dict] = []
        usage, latency, scores = [0, 0], 0.0, None
        for repair in range(self.max_repairs + 1):
            try:
                text, body, used, seconds = self._send(messages)
            except _NoAnswer as exc:
                self.ledger.record_failure(group.key, str(exc), group.request, len(attempts))
                log.warning("vlm_judge: no answer for request %s: %s", group.key[:12], exc)
                return None
            usage, latency = [usage[0] + used[0], usage[1] + used[1]], latency + seconds
            try:
                scores = P.parse_scores(text, group.labels)
                attempts.append({"body": body, "verdict": "ok"})
                break
            except P.MalformedReply as exc:
                attempts.append({"body": body, "verdict": f"malformed: {exc}"})
                if repair < self.max_repairs:
                    self._count(retries=1)
                    messages = [*messages, {"role": "assistant", "content": text or ""},
                                {"role": "user", "content": P.repair_message(str(exc), group.labels)}]
        status = "ok" if scores is not None else "malformed"
        if scores is None:
            log.warning("vlm_judge: request %s still malformed after %d repairs", group.key[:12], self.max_repairs)
        self.ledger.record(LedgerEntry(
            key=group.key, model=self.model, template_sha256=self.template.sha256, status=status,
            scores=None if scores is None else dict(zip(group.labels, scores, strict=True)),
            request={**group.request, "repairs": [m["content"] for m in messages[2::2]]}, response=attempts,
            prompt_tokens=usage[0], completion_tokens=usage[1], latency_s=latency, attempts=len(attempts)))
        return scores

    def _send(self, messages: list[dict]) -> tuple[str | None, str, tuple[int, int], float]:
        """One chat completion with transport retries: ``(reply text, raw HTTP body, (prompt, completion) tokens,
        seconds)``.

        Raises:
            _NoAnswer: still failing after ``max_retries`` re-sends, or a non-retryable 4xx.
            JudgeError: 401 / 403 / 404.
        """
        oa = self._openai
        for attempt in range(self.max_retries + 1):
            self._count(requests_sent=1)
            start = time.perf_counter()
            try:
                raw = self.client.chat.completions.with_raw_response.create(
                    model=self.model, messages=messages, temperature=self.settings["temperature"],
                    max_tokens=self.settings["max_tokens"], seed=self.seed)
                completion = raw.parse()
            except (oa.APITimeoutError, oa.APIConnectionError, oa.APIStatusError) as exc:
                seconds = time.perf_counter() - start
                self._count(latency_total=seconds)
                status = getattr(exc, "status_code", None)
                body = getattr(getattr(exc, "response", None), "text", "")[:500]
                if status in FATAL_STATUS:
                    raise JudgeError(f"judge at {self.client.base_url} refused the request (HTTP {status}): "
                                     f"{body}") from exc
                if status is not None and status < 500 and status not in RETRY_STATUS:
                    raise _NoAnswer(f"HTTP {status}: {body}") from exc
                if attempt == self.max_retries:
                    raise _NoAnswer(f"{type(exc).__name__} after {attempt + 1} tries: {exc}") from exc
                self._count(retries=1)
                time.sleep(self.backoff * 2 ** attempt)
                continue
            seconds = time.perf_counter() - start
            used = completion.usage
            tokens = (used.prompt_tokens or 0, used.completion_tokens or 0) if used is not None else (0, 0)
            self._count(latency_total=seconds, tokens=sum(tokens))
            text = completion.choices[0].message.content if completion.choices else None
            return text, raw.text, tokens, seconds
        raise AssertionError("unreachable")


def load_reference(path: Path) -> Tensor:
    """A reference as media: an image file -> ``[3, H, W]``; a directory of image files -> ``[3, F, H, W]`` (frames
    in file-name order). Values float32 in [0, 1].

    Raises:
        ValueError: the path does not exist, is not an image, or is a directory without images.
    """
    import numpy as np
    from PIL import Image

    def read(p: Path) -> Tensor:
        try:
            with Image.open(p) as im:
                array = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
        except OSError as exc:
            raise ValueError(f"reference {str(p)!r} is not a readable image: {exc}") from None
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()

    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"reference directory {str(path)!r} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        return torch.stack([read(p) for p in files], dim=1)
    if not path.is_file():
        raise ValueError(f"reference {str(path)!r} does not exist")
    return read(path)
