"""``flowforge serve judge``: an OpenAI-compatible chat-completions server in front of a judge backend
(:mod:`flowforge.serve.judge_backends`): a local Hugging Face vision-language model (``--model PATH``) or a flowforge
scorer wrapped as a group judge (``--scorer NAME``). The ``vlm_judge`` reward talks to it like to any
OpenAI-compatible API.

Routes (bearer token as in :mod:`flowforge.serve.common`; ``GET /health`` is open):

``GET /v1/models`` -> ``{"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0,
"owned_by": "flowforge"}]}``

``POST /v1/chat/completions`` with ``{"model", "messages": [{"role", "content": str | [{"type": "text", "text"} |
{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}]}], "max_tokens" | "max_completion_tokens",
"temperature", "seed", "n": 1, "stream": false, "logprobs", "top_logprobs"}`` -> a ``chat.completion`` object with
one choice and ``usage`` (``prompt_tokens``, ``completion_tokens``, ``total_tokens``). With ``logprobs: true`` the
choice carries OpenAI's ``logprobs`` object (``top_logprobs`` <= 20 alternatives per token) from a backend that can
give them (``--model``), else 400 ``unsupported_parameter``. Other OpenAI fields are accepted and ignored.

Errors come in OpenAI's error shape, so OpenAI clients show the message (the ``openai`` SDK: ``exc.message``,
``exc.body["message"]``, ``exc.code``, ``exc.param``)::

    {"error": {"message": "...", "type": "invalid_request_error" | "server_error", "param": "model" | null,
               "code": "invalid_json" | ...}}

=====  ==========================  ==================================================================================
HTTP   ``code``                    when
=====  ==========================  ==================================================================================
400    ``invalid_json``            the body is not JSON, or nested deeper than the limit
400    ``unsupported_parameter``   ``n != 1`` or ``stream: true`` (``param`` names it)
401    ``invalid_api_key``         no or a wrong bearer token (checked from the headers, before the body is read)
408    ``request_timeout``             the body stalled for the client timeout (the connection is closed)
404    ``model_not_found``         an unknown model id (``param: "model"``); ``not_found``: an unknown route
413    ``request_too_large``       body over ``max_bytes``, more than ``max_images`` images, or over the pixel budget
                                   (a header past Pillow's decompression-bomb limit included)
422    ``invalid_request``         schema errors and requests the backend cannot serve (bad image data, a message
                                   outside the judge layout, a scorer that refuses its input)
500    ``backend_error``           a backend failure (``type: "server_error"``); ``request_log_failed``: the request
                                   log could not be written (the request is not served); ``internal_error``: a bug
=====  ==========================  ==================================================================================

Remote image URLs are never fetched. The message layout a ``--scorer`` backend reads: ``docs/judge_server.md``.

``request_log``: every received request (after auth, as soon as its body parses as JSON) appends one JSON line,
flushed and fsynced before the request is served -- the server's own record of what it was asked (and, for a paid
judge, billed), e.g. that a resumed run re-sent nothing::

    {"key": sha256 of the body's canonical JSON (sorted keys, no spaces),
     "group": sha256 of the first user message's content (the group; the same for its retries and repairs) or null,
     "messages": number of messages (1: a first send or a retry; 3, 5, ...: a repair),
     "candidates": {label: [sha256 of each frame's bytes, in the order received]} or null (not a group request),
     "condition": [...], "reference": [...], "unix": time received}

:func:`read_request_log` reads it back; :func:`billed_per_group` counts the requests of each group.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flowforge.serve.common import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_PIXELS, NO_DOCS, PixelBudget,
                                    b64_image_pixels, guard_app)
from flowforge.rewards.judge.protocol import billed_per_group, read_request_log  # noqa: F401 (re-exported)
from flowforge.serve.judge_backends import BackendError

DEFAULT_MAX_BYTES = 64 * 2**20
_log = logging.getLogger("flowforge.serve")
DEFAULT_MAX_IMAGES = 512


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart | ImagePart]


class ChatRequest(BaseModel):
    """The body of ``POST /v1/chat/completions`` (fields this server uses; others are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def request_key(body: Any) -> str:
    """sha256 hex of ``body``'s canonical JSON (sorted keys, ``(",", ":")`` separators)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def log_record(body: Any) -> dict[str, Any]:
    """The request-log line of a received body (module docstring); the group fields are null when the body is not
    a group request of the judge layout."""
    from flowforge.rewards.judge import protocol as P
    from flowforge.serve.judge_backends import first_user_content

    record: dict[str, Any] = {"key": request_key(body), "group": None, "messages": None, "candidates": None,
                              "condition": None, "examples": None, "reference": None, "unix": time.time()}
    try:
        messages = body["messages"]
        content = first_user_content(messages)
        record["messages"] = len(messages)
        record["group"] = request_key(content)
        group = P.read_group_request(content)
    except (KeyError, TypeError, ValueError, AttributeError):
        return record
    digest = P.sha256_hex
    record.update(candidates={label: [digest(f) for f in frames] for label, frames in group.candidates.items()},
                  condition=[digest(f) for f in group.condition], examples=[digest(f) for f in group.examples],
                  reference=[digest(f) for f in group.reference])
    return record


class RequestLog:
    """Appends one JSON line per received request to ``path`` (flushed + fsynced, thread-safe).

    Raises:
        ValueError: ``path`` is neither a regular file nor a new name in an existing directory (a directory, a device
            such as ``/dev/full``, a FIFO), or cannot be opened for appending.
    Raises (``append``):
        OSError: the line could not be written (disk full, the file replaced by a directory, ...).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        check_log_path(self.path)
        self._lock = threading.Lock()

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def check_log_path(path: Path) -> None:
    """Refuse a request-log ``path`` the server could not append to: anything that exists and is not a regular file
    (a directory; ``/dev/full``, a character device where every write fails with ENOSPC though it opens fine), a new
    name whose directory does not exist, or a file that cannot be opened for appending.

    Raises:
        ValueError: one line naming ``--request-log``, the path and why.
    """
    import stat

    what = f"--request-log {str(path)!r}"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise ValueError(f"{what}: its directory does not exist; create it or choose another path") from None
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device, FIFO or socket)"
        raise ValueError(f"{what} is {kind}; give a file path (new, or a regular file to append to)")
    existed = mode is not None
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"{what} cannot be opened for appending: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()  # created by the probe: the first request creates it again


ERROR_CODES = {400: "invalid_json", 401: "invalid_api_key", 408: "request_timeout", 403: "permission_denied",
               404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 422: "invalid_request",
               429: "rate_limited", 500: "backend_error"}
"""The ``code`` of an error answer by HTTP status (module docstring), when the raiser names none."""


def openai_error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body for an answer with HTTP ``status``: ``{"error": {"message", "type", "param", "code"}}``;
    ``type`` is ``server_error`` from 500 on, else ``invalid_request_error``; ``code`` defaults to
    :data:`ERROR_CODES`' entry for ``status`` (``http_<status>`` for any other)."""
    return {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                      "param": param, "code": code or ERROR_CODES.get(status, f"http_{status}")}}


def refuse(status: int, message: str, *, param: str | None = None, code: str | None = None) -> HTTPException:
    """An ``HTTPException`` the app answers as :func:`openai_error` (``param`` / ``code`` carried in its detail)."""
    return HTTPException(status, {"message": message, "param": param, "code": code})


def _completion(model: str, text: str, prompt_tokens: int, completion_tokens: int,
                logprobs: dict | None = None) -> dict[str, Any]:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                         "logprobs": logprobs}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def build_app(backend: Any, token: str | None, *, request_log: str | Path | None = None,
              max_bytes: int = DEFAULT_MAX_BYTES, max_images: int = DEFAULT_MAX_IMAGES,
              max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS,
              body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
    """The ASGI app serving ``backend`` (``model_id`` + ``complete``; :mod:`flowforge.serve.judge_backends`).

    Args:
        token: bearer token every route but ``/health`` requires; ``None`` = no auth (loopback only, by the CLI).
        request_log: file receiving one request key per received request (module docstring).
        max_bytes: largest request body. max_images: most images in one request. max_request_pixels: decoded
            pixels per request, read from the image headers before any is decoded (413 over it); also the pixels
            all requests together decode at once (:class:`~flowforge.serve.common.PixelBudget`).
        body_timeout_s: longest pause while a request body arrives (408).

    Raises:
        ValueError: a limit < 1; ``request_log`` that cannot be appended to (:func:`check_log_path`).
    """
    for name, value in (("max_bytes", max_bytes), ("max_images", max_images)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    log = RequestLog(request_log) if request_log is not None else None
    budget = PixelBudget(max_request_pixels)  # decoded pixels of all requests at once (peak memory)
    app = FastAPI(title="flowforge judge server", **NO_DOCS)

    def readable(exc: ValidationError | RequestValidationError) -> str:
        problems = ["/".join(str(p) for p in e.get("loc", ())) + f": {e.get('msg', '')}" for e in exc.errors()]
        return "; ".join(problems[:8]) or "malformed request"

    @app.exception_handler(RequestValidationError)
    async def readable_422(request: Request, exc: RequestValidationError):
        return JSONResponse(status_code=422, content=openai_error(422, readable(exc)))

    @app.exception_handler(StarletteHTTPException)  # FastAPI's own, the token check's and unknown routes' too
    async def openai_shaped(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, dict) else {"message": str(exc.detail)}
        return JSONResponse(status_code=exc.status_code, headers=getattr(exc, "headers", None),
                            content=openai_error(exc.status_code, str(detail.get("message")),
                                                 param=detail.get("param"), code=detail.get("code")))

    @app.exception_handler(Exception)  # anything unexpected: OpenAI-shaped JSON, logged in one line by guard_app
    async def json_500(request: Request, exc: Exception):
        return JSONResponse(status_code=500, content=openai_error(500, f"internal error: {type(exc).__name__}: {exc}",
                                                                  code="internal_error"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": backend.model_id}

    @app.get("/v1/models")  # the token: guard_app, before any body is read
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": backend.model_id, "object": "model", "created": 0,
                                            "owned_by": "flowforge"}]}

    @app.post("/v1/chat/completions")
    def chat(body: Any = _json_body()) -> dict[str, Any]:
        if log is not None:
            try:
                log.append(log_record(body))
            except OSError as exc:  # not served unrecorded: the log is the record of what was billed
                _log.error("request log %s: write failed: %s", log.path, exc.strerror or exc)
                raise refuse(500, f"the server could not record the request in its request log: "
                                  f"{exc.strerror or exc}", code="request_log_failed") from None
        try:
            req = ChatRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
            raise refuse(422, readable(exc), param=str(first[0]) if first else None) from None
        if req.n != 1 or req.stream:
            raise refuse(400, "only n=1 and stream=false are supported", param="n" if req.n != 1 else "stream",
                         code="unsupported_parameter")
        if req.model != backend.model_id:
            raise refuse(404, f"unknown model {req.model!r}; this server serves {backend.model_id!r}", param="model",
                         code="model_not_found")
        images = sum(isinstance(p, ImagePart) for m in req.messages if isinstance(m.content, list) for p in m.content)
        if images > max_images:
            raise refuse(413, f"{images} images exceed the limit of {max_images} per request", param="messages")
        pixels = sum(b64_image_pixels(p.image_url.url) for m in req.messages if isinstance(m.content, list)
                     for p in m.content if isinstance(p, ImagePart))
        messages = [m.model_dump() for m in req.messages]
        # token log-probabilities only when asked for (OpenAI's logprobs / top_logprobs), from a backend that has them
        wants = {"top_logprobs": req.top_logprobs or 0} if req.logprobs else {}
        if wants and "top_logprobs" not in inspect.signature(backend.complete).parameters:
            raise refuse(400, f"the backend of {backend.model_id!r} gives no token log-probabilities",
                         param="logprobs", code="unsupported_parameter")
        try:
            with budget.hold(pixels):  # 413 over the budget; decode + answer wait while others hold it
                done = backend.complete(messages, max_tokens=req.max_completion_tokens or req.max_tokens,
                                        temperature=req.temperature or 0.0, seed=req.seed, **wants)
        except HTTPException:
            raise
        except BackendError as exc:
            raise refuse(exc.status_code, exc.message) from None
        except ValueError as exc:
            raise refuse(422, str(exc), param="messages") from None
        except Exception as exc:  # noqa: BLE001 - a backend failure is the server's (500), reported, never a reply
            raise refuse(500, f"backend failed: {type(exc).__name__}: {exc}") from exc
        return _completion(backend.model_id, done.text, done.prompt_tokens, done.completion_tokens,
                           getattr(done, "logprobs", None))

    return guard_app(app, token=token, max_bytes=max_bytes, body_timeout_s=body_timeout_s,
                     error_body=lambda status, message: openai_error(status, message))


def _json_body():
    """A FastAPI dependency: the request body parsed as JSON (400 with a message when it is not)."""

    async def parse(request: Request) -> Any:
        from starlette.concurrency import run_in_threadpool

        raw = await request.body()
        try:
            return await run_in_threadpool(json.loads, raw)  # seconds for a large body: not on the event loop
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise refuse(400, f"the body is not JSON: {exc}") from None

    return Depends(parse)


def build_backend(*, scorer: str | None = None, model: str | None = None, scorer_options: dict | None = None,
                  score_range: tuple[float, float] = (0.0, 1.0), device: str = "cpu", dtype: str = "float32",
                  max_new_tokens: int = 1024, model_id: str | None = None) -> Any:
    """The backend for ``--scorer NAME`` (a registry name or ``pkg.module:Factory``) or ``--model PATH``.

    Raises:
        ValueError: both or neither given; an unknown scorer; a model directory that does not load.
    """
    from flowforge.serve.judge_backends import HFVisionLanguageBackend, ScorerBackend

    if (scorer is None) == (model is None):
        raise ValueError("serve judge needs exactly one of --scorer NAME and --model PATH")
    if model is not None:
        if not Path(model).is_dir():
            raise ValueError(f"--model {model!r} is not a model directory")
        return HFVisionLanguageBackend(model, device=device, dtype=dtype, max_new_tokens=max_new_tokens,
                                       model_id=model_id)
    from flowforge.rewards.registry import build_scorer

    return ScorerBackend(build_scorer(scorer, **dict(scorer_options or {})), model_id or scorer, score_range)
