"""One HTTP attempt of the group judge: a chat completion through the official ``openai`` client, and what each
failure means for billing and retries (:func:`retry_kind`, :data:`RETRY_KINDS`). Used by
:class:`flowforge.rewards.judge.client.VLMJudge`, which records every attempt in its ledger before calling
:func:`send`."""

from __future__ import annotations

import time
import typing
from typing import Any, Literal

from flowforge.runtime.errors import one_line

FATAL_WHAT = {401: "refused the token", 403: "refused the token's access", 404: "has no such model or route"}
RetryKind = Literal["refused", "429", "timeout", "connection", "408", "409", "5xx"]
RETRY_KINDS: tuple[str, ...] = typing.get_args(RetryKind)
UNBILLED_RETRIES: tuple[str, ...] = ("refused", "429")
"""The default ``retry_on``: failures that cannot have been billed."""


class JudgeError(ValueError):
    """The judge cannot work at all (bad credentials, URL or model name): an error, never a reward. A ``ValueError``:
    the judge's options are at fault, reported by the command line in one line (exit 2)."""


def retry_kind(outcome: str, http_status: int | None, billed: bool) -> str | None:
    """The :data:`RETRY_KINDS` entry of an attempt that ended without an answer (ledger ``outcome``, HTTP status,
    billed), or None for one that is never sent again (a 4xx other than 408 / 409 / 429, a 200 that is no chat
    completion, an attempt lost in a crash)."""
    if outcome == "timeout":
        return "timeout"
    if outcome == "connection_error":
        return "connection" if billed else "refused"
    if outcome == "http_error" and http_status is not None and http_status != 200:
        return "5xx" if http_status >= 500 else str(http_status) if str(http_status) in RETRY_KINDS else None
    return None


class Unanswered(Exception):
    """One HTTP attempt without an answer: ``outcome`` (ledger), ``billed``, its retry kind (:data:`RETRY_KINDS`;
    None: never retried), the HTTP status."""

    def __init__(self, message: str, outcome: str, *, billed: bool, kind: str | None, status: int | None = None,
                 seconds: float = 0.0) -> None:
        super().__init__(message)
        self.outcome, self.billed, self.kind, self.status, self.seconds = outcome, billed, kind, status, seconds


def settle_unanswered(ledger: Any, attempt_id: int, exc: Unanswered, retry_on: Any, count: Any, *, attempt: int,
                      attempts_left: int, backoff: float) -> bool:
    """Record attempt ``attempt_id`` that got no answer (``exc``) in ``ledger`` and count it (``count(billed=...,
    latency_total=...)``); returns whether to send again: only when its kind is in ``retry_on`` (what may have been
    billed is never paid for twice unless opted in), after the back-off ``backoff * 2 ** attempt`` when an attempt
    is left. Shared by the group judge and the pointwise scorers, so both follow one rule."""
    ledger.finish_attempt(attempt_id, exc.outcome, billed=exc.billed, http_status=exc.status, error=str(exc),
                          latency_s=exc.seconds)
    count(billed=int(exc.billed), latency_total=exc.seconds)
    if exc.kind not in retry_on:
        return False
    if attempt + 1 < attempts_left:
        time.sleep(backoff * 2 ** attempt)
    return True


def send(client: Any, openai: Any, messages: list[dict], *, model: str, settings: dict, seed: int,
         api_key_env: str | None, extra: dict | None = None) -> tuple[str | None, str, tuple[int, int], float]:
    """One chat completion (one HTTP attempt) with ``client`` (an ``openai.OpenAI``; ``openai`` the module, for its
    exception classes): ``(reply text, raw HTTP body, (prompt, completion) tokens, seconds)``. ``extra``: more body
    fields (e.g. ``{"logprobs": True, "top_logprobs": 20}``; the raw body then carries them back).

    Raises:
        Unanswered: no answer (a timeout, a connection error, an HTTP error other than the fatal ones, a 200 whose
            body is no chat completion).
        JudgeError: 401 / 403 / 404.
    """
    start = time.perf_counter()
    try:
        # the messages go in extra_body, which the SDK merges into the JSON body after its request transform:
        # the transform walks every content part in Python with the GIL held (6 ms for 8 frames, 60 ms for
        # 124) and returns plain-JSON messages unchanged, so it is skipped. ``messages=[]`` keeps the key's
        # place: the body is byte-identical (tests/rewards/judge/test_client_http.py).
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[], temperature=settings["temperature"],
            max_tokens=settings["max_tokens"], seed=seed, extra_body={**(extra or {}), "messages": messages})
    except openai.APITimeoutError as exc:
        raise Unanswered(f"timed out: {exc}", "timeout", billed=True, kind=retry_kind("timeout", None, True),
                         seconds=time.perf_counter() - start) from exc
    except openai.APIConnectionError as exc:
        # refused: nothing left this machine (the client's httpx may be a vendored copy: matched by name)
        refused = any(c.__name__ == "ConnectError" for c in type(exc.__cause__).__mro__)
        raise Unanswered(f"{type(exc.__cause__ or exc).__name__}: {exc}", "connection_error",
                         billed=not refused, kind=retry_kind("connection_error", None, not refused),
                         seconds=time.perf_counter() - start) from exc
    except openai.APIStatusError as exc:
        status, body = exc.status_code, exc.response.text[:500]
        if status in FATAL_WHAT:
            token = f" from api_key_env={api_key_env}" if status in (401, 403) and api_key_env else ""
            raise JudgeError(f"vlm_judge: the judge at {client.base_url} {FATAL_WHAT[status]}{token} "
                             f"(HTTP {status}; model {model!r}): {one_line(body)}") from exc
        raise Unanswered(f"HTTP {status}: {body}", "http_error", billed=status != 429, status=status,
                         kind=retry_kind("http_error", status, status != 429),
                         seconds=time.perf_counter() - start) from exc
    try:
        completion = raw.parse()
        if not isinstance(completion.choices, list) or not completion.choices:
            raise TypeError("no choices")
        text = completion.choices[0].message.content
    except Exception as exc:  # noqa: BLE001 - a 200 whose body is no chat completion: answered, billed, unusable
        raise Unanswered(f"HTTP 200 with a body that is not a chat completion ({type(exc).__name__}): "
                         f"{one_line(raw.text[:300])}", "http_error", billed=True, status=200, kind=None,
                         seconds=time.perf_counter() - start) from exc
    seconds = time.perf_counter() - start
    used = completion.usage
    tokens = (used.prompt_tokens or 0, used.completion_tokens or 0) if used is not None else (0, 0)
    return text, raw.text, tokens, seconds
