"""Pointwise VLM scorers: one chat completion per sample through any OpenAI-compatible server (vLLM, SGLang,
``flowforge serve judge``), each request billed at most as the group judge's rules allow.

A pointwise scorer (``unified_reward``, ``vqa_score``'s server path, ``edit_score``) asks one question about one
sample: its images (the generated one; for an edit, the source image first) and a text rendered from the scorer's
official prompt template, and parses one number from the answer. Everything that costs money is the group judge's
own machinery, called, not copied:

* the HTTP attempt is :func:`flowforge.rewards.judge.transport.send` (the official ``openai`` client; what a timeout,
  a refused connection, a 429 / 5xx mean for billing: :func:`~flowforge.rewards.judge.transport.retry_kind`);
* every request and every billed attempt is written to a :class:`~flowforge.rewards.judge.ledger.RequestLedger`
  *before* it leaves; an answered request (``ok`` or ``malformed``) is served from the ledger when asked again -- a
  rerun, a resume, the same image scored twice -- and never sent again;
* ``retry_on`` (default: the kinds that cannot have been billed, ``refused`` and ``429``) decides which failed
  attempts are sent again; ``max_attempts`` caps a request's billed attempts over every run; ``max_billed`` caps the
  ledger file's (a batch that would exceed it raises :class:`~flowforge.rewards.judge.ledger.BudgetExhausted` before
  anything is sent).

A reply the scorer cannot parse (:class:`~flowforge.rewards.judge.protocol.MalformedReply`) is recorded
``malformed`` and scores NaN: it is not repaired (these models were trained on one prompt; a repair conversation is
out of their distribution) and, being answered, never sent again. Failures are never rewards: a sample without a
score is NaN (the reward processor counts it; a required component then fails).

Request key: :func:`~flowforge.rewards.judge.protocol.request_key` over the model, the sha256 of the scorer's
template, the prompt, the images' JPEG sha256 (in order) and the generation settings. The ledger holds one row per
sample (``scores_json = {"score": s}``); the request as recorded names the images by hash, never base64.

Metrics since the last :meth:`PointwiseVLM.pop_metrics` (logged as ``reward/<name>_<metric>``): ``requests_sent``,
``billed``, ``served_from_ledger``, ``retries``, ``failures`` (NaN samples), ``malformed`` (of them, answered but not
parseable), ``tokens``, ``latency_s`` (mean seconds per HTTP attempt; NaN when none was sent).
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import io
import logging
import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowforge.rewards.base import check_inputs
from flowforge.rewards.judge import protocol as P
from flowforge.rewards.judge.ledger import BudgetExhausted, RequestLedger
from flowforge.rewards.judge.transport import (RETRY_KINDS, UNBILLED_RETRIES, JudgeError, RetryKind, Unanswered,
                                               retry_kind, send, settle_unanswered)

log = logging.getLogger(__name__)

IMAGE_FORMATS = ("jpeg", "png")


def _counters() -> dict[str, float]:
    return dict(requests_sent=0, billed=0, served_from_ledger=0, retries=0, failures=0, malformed=0, tokens=0,
                latency_total=0.0)


class PointwiseVLM:
    """Base of the pointwise VLM scorers (module docstring). A subclass sets ``name`` and ``template`` (the official
    prompt; its sha256 joins every request key) and implements :meth:`parse`; it may override :meth:`requests` (the
    requests of a sample: their images and texts), :meth:`content` (the message layout), :meth:`combine` (a sample's
    reward from its requests' scores) and :meth:`extra_body` (more request fields).

    Args:
        model: model name sent in each request (what the server serves, e.g. ``CodeGoat24/UnifiedReward-qwen-7b``).
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        api_key_env: environment variable holding the API key; ``None`` sends a placeholder (a ``--no-auth`` server).
        timeout_s: seconds per HTTP attempt, > 0.
        max_concurrency: requests in flight at once, >= 1.
        max_attempts: billed attempts per request at most, over every run, >= 1.
        retry_on: failed attempts sent again, a list of :data:`~flowforge.rewards.judge.transport.RETRY_KINDS`;
            default ``["refused", "429"]``, which never pays twice.
        retry_backoff_s: first back-off in seconds (doubled per retry), >= 0.
        max_side: longest side of a sent image in pixels (downscaled only, bicubic), >= 1.
        image_format: ``jpeg`` (at ``jpeg_quality``, 1..100) or ``png`` (lossless: the 8-bit pixels exactly).
        temperature, max_tokens, seed: generation settings sent with each request (part of the key).
        run_dir: the run directory; the ledger is ``run_dir/judge/<name>.sqlite``. ledger: an explicit path
            instead. Neither: an in-memory ledger (warned).
        max_billed: billed attempts the ledger file may hold (0: no limit).
        paid: whether evaluation counts the scorer as paid (``eval.teacher_groups``); False for a free local server.

    Raises:
        ValueError: a bad option (named, with what it allows), or ``api_key_env`` names an unset variable.
    """

    name: ClassVar[str] = "pointwise_vlm"
    template: ClassVar[str] = ""
    needs_group: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass whose ``__init__`` passes ``**options`` on to this one gets the explicit signature of both (its
        own keywords, then the others of :class:`PointwiseVLM`) as ``__signature__``: the registry checks options
        against it (``flowforge check`` names an unknown one before any model loads)."""
        super().__init_subclass__(**kwargs)
        own = list(inspect.signature(cls.__init__).parameters.values())[1:]
        if not own or own[-1].kind is not inspect.Parameter.VAR_KEYWORD:
            return
        names = {p.name for p in own}
        base = [p for p in inspect.signature(PointwiseVLM).parameters.values() if p.name not in names]
        cls.__signature__ = inspect.Signature([*own[:-1], *base])

    def __init__(self, *, model: str, base_url: str, api_key_env: str | None = "OPENAI_API_KEY",
                 timeout_s: float = 120.0, max_concurrency: int = 4, max_attempts: int = 3,
                 retry_on: Sequence[RetryKind] = UNBILLED_RETRIES, retry_backoff_s: float = 1.0,
                 max_side: int = 1024, image_format: str = "jpeg", jpeg_quality: int = 95, temperature: float = 0.0,
                 max_tokens: int = 1024,
                 seed: int = 0, run_dir: str | Path | None = None, ledger: str | Path | None = None,
                 max_billed: int = 0, paid: bool = True) -> None:
        import openai

        for opt, value, low in (("max_concurrency", max_concurrency, 1), ("max_attempts", max_attempts, 1),
                                ("max_side", max_side, 1), ("jpeg_quality", jpeg_quality, 1),
                                ("max_tokens", max_tokens, 1), ("max_billed", max_billed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{self.name} option {opt} must be an int >= {low}, got {value!r}")
        if jpeg_quality > 100:
            raise ValueError(f"{self.name} option jpeg_quality must be in 1..100, got {jpeg_quality!r}")
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"{self.name} option image_format must be one of {list(IMAGE_FORMATS)}, got "
                             f"{image_format!r}")
        if not timeout_s > 0 or not retry_backoff_s >= 0 or not temperature >= 0:
            raise ValueError(f"{self.name} needs timeout_s > 0, retry_backoff_s >= 0 and temperature >= 0, got "
                             f"{timeout_s!r}, {retry_backoff_s!r}, {temperature!r}")
        if not model or not base_url:
            raise ValueError(f"{self.name} needs options model (the served model's name) and base_url")
        if isinstance(retry_on, str) or any(k not in RETRY_KINDS for k in retry_on):
            raise ValueError(f"{self.name} option retry_on must be a list of {list(RETRY_KINDS)}, got {retry_on!r}")
        key = "unused"
        if api_key_env is not None:
            key = os.environ.get(api_key_env, "")
            if not key:
                raise ValueError(f"{self.name}: environment variable {api_key_env} (api_key_env) is not set")
        self.model, self.api_key_env, self.paid = model, api_key_env, bool(paid)
        self.max_concurrency, self.max_attempts, self.backoff = max_concurrency, max_attempts, retry_backoff_s
        self.retry_on, self.max_billed, self.seed = frozenset(retry_on), max_billed, seed
        self.max_side, self.quality, self.image_format = max_side, jpeg_quality, image_format
        self.settings = dict(temperature=float(temperature), max_tokens=max_tokens, seed=seed, max_side=max_side,
                             jpeg_quality=jpeg_quality, **({"image_format": "png"} if image_format == "png" else {}),
                             **self.extra_body())
        self.template_sha256 = hashlib.sha256(self.template.encode()).hexdigest()
        self.client = openai.OpenAI(base_url=base_url, api_key=key, timeout=timeout_s, max_retries=0)
        self._openai = openai
        if ledger is None and run_dir is None:
            log.warning("%s has no run_dir and no ledger path: its request ledger lives in memory only", self.name)
        self.ledger_path = str(ledger if ledger is not None else
                               Path(run_dir) / "judge" / f"{self.name}.sqlite" if run_dir is not None else ":memory:")
        self._ledger: RequestLedger | None = None
        self._lock = threading.Lock()
        self._counts = _counters()
        self.last_error: str | None = None

    # ------------------------------------------------------------------------------------------------ subclass hooks
    def requests(self, image: Tensor, prompt: str, metadata: dict[str, Any]) -> list[tuple[list[Tensor], str]]:
        """The requests that score one sample: per request its ``[3, H, W]`` images in order and its text (default:
        one request, the generated ``image`` and ``template`` with ``{prompt}`` filled in)."""
        return [([image], self.template.format(prompt=prompt))]

    def content(self, urls: list[str], text: str) -> list[dict]:
        """The user message's content parts of one request (default: the images, then the text)."""
        return [*({"type": "image_url", "image_url": {"url": url}} for url in urls), {"type": "text", "text": text}]

    def parse(self, text: str | None, body: str, index: int) -> float:
        """The score in the answer to request ``index`` of a sample (``text``: the reply, ``body``: the raw HTTP
        body).

        Raises:
            MalformedReply: no score can be read (the message says why).
        """
        raise NotImplementedError

    def combine(self, scores: list[float]) -> float:
        """A sample's reward from its requests' scores, in order (default: the one score). NaN in, NaN out."""
        return scores[0]

    def extra_body(self) -> dict[str, Any]:
        """More request body fields (part of the request key through the settings)."""
        return {}

    # ------------------------------------------------------------------------------------------------ scoring
    @property
    def ledger(self) -> RequestLedger:
        """The request ledger (opened on first use)."""
        with self._lock:
            if self._ledger is None:
                self._ledger = RequestLedger(self.ledger_path, budget=self.max_billed)
            return self._ledger

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """Score each sample: ``media`` ``[B, 3, H, W]`` float in [0, 1], one prompt and metadata dict each.

        Returns:
            ``[B]`` float32 on ``media``'s device; NaN for a sample without a score (no answer, malformed, lost).

        Raises:
            ValueError: bad shapes or lengths; a subclass's missing metadata (e.g. an edit's source image).
            JudgeError: the server refuses the credentials, URL or model (401 / 403 / 404).
            BudgetExhausted: ``max_billed`` cannot pay for the samples to send; nothing was sent.
        """
        batch = check_inputs(media, prompts, metadata)
        per_sample = [[self._prepare(images, text, prompts[i], metadata[i], j)
                       for j, (images, text) in enumerate(self.requests(media[i], prompts[i], metadata[i]))]
                      for i in range(batch)]
        ledger = self.ledger
        decided: dict[str, float] = {}
        todo: dict[str, tuple[dict, int]] = {}
        for req in (r for sample in per_sample for r in sample):
            if req["key"] in decided or req["key"] in todo:
                continue
            entry, billed = ledger.claim(req["key"])
            if entry is not None:
                self._count(served_from_ledger=1)
                decided[req["key"]] = float(entry.scores["score"]) if entry.status == "ok" else math.nan
            elif billed >= self.max_attempts or any(retry_kind(o, h, True) not in self.retry_on
                                                    for o, h in ledger.billed_failures(req["key"])):
                decided[req["key"]] = math.nan  # attempts spent, or one may have been billed: never sent again
            else:
                todo[req["key"]] = (req, self.max_attempts - billed)
        if self.max_billed and len(todo) > self.max_billed - ledger.billed():
            raise BudgetExhausted(f"{self.name} max_billed={self.max_billed}: the budget cannot pay for {len(todo)} "
                                  f"more requests ({ledger.billed()} spent, in {ledger.path}); nothing was sent")
        items = list(todo.values())
        workers = min(self.max_concurrency, len(items))
        if workers > 1:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self.name) as pool:
                answers = list(pool.map(lambda item: self._ask(*item), items))
        else:
            answers = [self._ask(*item) for item in items]
        decided.update(zip(todo, answers, strict=True))
        scores = [self.combine([decided[r["key"]] for r in sample]) for sample in per_sample]
        self._count(failures=sum(math.isnan(s) for s in scores))
        return torch.tensor(scores, dtype=torch.float32).to(media.device)

    def pop_metrics(self) -> dict[str, float]:
        """The counters since the last call (module docstring), then reset."""
        with self._lock:
            c, self._counts = self._counts, _counters()
        sent, latency = c.pop("requests_sent"), c.pop("latency_total")
        return {"requests_sent": float(sent), **{k: float(v) for k, v in c.items()},
                "latency_s": latency / sent if sent else math.nan}

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
        self.client.close()

    # ------------------------------------------------------------------------------------------------ internals
    def _count(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def encode(self, image: Tensor) -> tuple[bytes, str]:
        """One ``[3, H, W]`` image in [0, 1] -> ``(bytes, data URL)`` as sent: 8-bit (``round(255 x)``), the longest
        side at most ``max_side`` (bicubic, downscaled only), JPEG at ``jpeg_quality`` or PNG."""
        if self.image_format == "jpeg":
            data = P.jpeg_bytes(image, self.max_side, self.quality)
            return data, P.data_url(data)
        from PIL import Image

        from flowforge.media import to_uint8

        pil = Image.fromarray(to_uint8(image).permute(1, 2, 0).cpu().numpy(), mode="RGB")
        if max(pil.size) > self.max_side:  # the rule of jpeg_bytes, so both formats show the same pixels
            scale = self.max_side / max(pil.size)
            pil = pil.resize((max(1, round(pil.width * scale)), max(1, round(pil.height * scale))), Image.BICUBIC)
        out = io.BytesIO()
        pil.save(out, format="PNG")
        data = out.getvalue()
        return data, "data:image/png;base64," + base64.b64encode(data).decode("ascii")

    def _prepare(self, images: list[Tensor], text: str, prompt: str, metadata: dict[str, Any], index: int) -> dict:
        encoded = [self.encode(image) for image in images]
        hashes = [P.sha256_hex(data) for data, _ in encoded]
        key = P.request_key(self.model, self.template_sha256, text, [], [hashes], self.settings)
        record = {"model": self.model, "scorer": self.name, "template_sha256": self.template_sha256,
                  "settings": self.settings, "prompt": prompt, "text": text, "images": hashes,
                  "sample_id": metadata.get("sample_id")}
        return {"key": key, "content": self.content([url for _, url in encoded], text), "record": record,
                "index": index}

    def _ask(self, req: dict, attempts_left: int) -> float:
        """Send one request (retrying as ``retry_on`` allows), every attempt recorded before it leaves; its score or
        NaN."""
        ledger, key = self.ledger, req["key"]
        ledger.begin(key, model=self.model, template_sha256=self.template_sha256, request=req["record"])
        messages = [{"role": "user", "content": req["content"]}]
        error, kind = "", "first"
        for attempt in range(attempts_left):
            try:
                row = ledger.start_attempt(key, kind)
            except BudgetExhausted as exc:
                error = str(exc)
                break
            self._count(requests_sent=1, retries=int(kind != "first"))
            try:
                text, body, used, seconds = send(self.client, self._openai, messages, model=self.model,
                                                 settings=self.settings, seed=self.seed,
                                                 api_key_env=self.api_key_env, extra=self.extra_body())
            except Unanswered as exc:
                error = str(exc)
                if not settle_unanswered(ledger, row, exc, self.retry_on, self._count, attempt=attempt,
                                         attempts_left=attempts_left, backoff=self.backoff):
                    break
                kind = "retry"
                continue
            except JudgeError as exc:  # refused before any work: not billed
                ledger.finish_attempt(row, "http_error", billed=False, error=str(exc))
                ledger.finish(key, "failed", scores=None, response=[])
                raise JudgeError(str(exc).replace("vlm_judge:", f"{self.name}:", 1)) from exc
            self._count(billed=1, latency_total=seconds, tokens=sum(used))
            try:
                score = self.parse(text, body, req["index"])
            except P.MalformedReply as exc:
                self._count(malformed=1)
                answers = [{"body": body, "verdict": f"malformed: {exc}"}]
                # the answer and the request's end commit together: an answered attempt beside a pending request
                # would be sent again by the next run (claim finds no answer and no billed failure)
                ledger.finish(key, "malformed", scores=None, response=answers, tokens=used, latency_s=seconds,
                              answered=(row, seconds, used))
                self.last_error = f"{self.name}: the server at {self.client.base_url} answered malformed: {exc}"
                log.warning("%s: request %s answered malformed: %s", self.name, key[:12], exc)
                return math.nan
            ledger.finish(key, "ok", scores={"score": score}, response=[{"body": body, "verdict": "ok"}],
                          tokens=used, latency_s=seconds, answered=(row, seconds, used))
            return score
        self.last_error = f"{self.name}: the server at {self.client.base_url} gave no answer: {error}"
        log.warning("%s: request %s has no score: %s", self.name, key[:12], error)
        ledger.finish(key, "failed", scores=None, response=[])
        return math.nan
