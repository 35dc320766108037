"""The ASGI layer in front of every flowforge server (:func:`guard_app`): the bearer token is checked from the headers
before a byte of the body is read, the body is streamed under a size cap, a nesting limit and a read timeout, and an
unexpected exception becomes one log line and a JSON 500 (never a plain-text traceback page).

Order of the checks for one HTTP request::

    token (headers only; 401)  ->  Content-Length over the cap (413)  ->  stream the body: running size (413),
    running JSON nesting depth (400), time between chunks (408, connection closed)  ->  the app

Memory: the body is kept as the list of chunks received (at most the cap) and joined once for the app; the nesting
depth is scanned chunk by chunk (:class:`JsonDepthScan`, a few MiB whatever the body), so a refused body costs no
more than the cap, and a body without a valid token costs nothing (it is never read: uvicorn discards it).
"""

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays / objects a JSON request body may have (the servers' schemas need fewer than 10)."""
DEFAULT_BODY_TIMEOUT_S = 30.0
"""Seconds a client may pause between two chunks of a request body before the request is answered 408."""
SCAN_CHUNK = 1 << 18
"""Bytes the nesting scan handles at once (its temporaries are ~20 bytes per byte scanned: ~5 MiB)."""

log = logging.getLogger("flowforge.serve")


class RateLimitedLog:
    """``warning(key, message)`` logs at most one line per ``key`` every ``period_s`` seconds, and says how many were
    left out since (a flood of refused connections or failed writes is one line a minute, not one per event)."""

    def __init__(self, period_s: float = 60.0) -> None:
        self.period_s = period_s
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warning(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.period_s) < self.period_s:
            self._skipped[key] = self._skipped.get(key, 0) + 1
            return
        skipped = self._skipped.pop(key, 0)
        self._last[key] = now
        log.warning("%s%s", message, f" (and {skipped} more like it in the last {self.period_s:.0f} s)"
                    if skipped else "")


RATE_LIMITED = RateLimitedLog()


class JsonDepthScan:
    """The deepest nesting of ``[`` / ``{`` in a JSON text fed in pieces (strings and their escapes skipped), without
    parsing it and without holding more than one :data:`SCAN_CHUNK` of temporaries: the state carried between pieces
    is the current depth, whether the text is inside a string, and the number of backslashes the last piece ended
    with."""

    def __init__(self) -> None:
        self.depth = 0
        self.deepest = 0
        self._inside = False  # within a string at the end of the text fed so far
        self._backslashes = 0  # length of the run of backslashes the text fed so far ends with

    def feed(self, data: bytes) -> int:
        """Scan ``data`` (the next piece of the text); returns the deepest nesting seen so far."""
        view = memoryview(data)
        for start in range(0, len(view), SCAN_CHUNK):
            self._scan(np.frombuffer(view[start:start + SCAN_CHUNK], dtype=np.uint8))
        return self.deepest

    def _scan(self, b: np.ndarray) -> None:
        n = b.size
        idx = np.arange(n, dtype=np.int64)
        slash = b == 0x5C
        last_other = np.maximum.accumulate(np.where(slash, -1, idx))  # last non-backslash at or before i (-1: none)
        before = np.concatenate(([-1], last_other[:-1]))  # ... strictly before i
        run = idx - 1 - before + np.where(before < 0, self._backslashes, 0)  # backslashes right before i
        quote = (b == 0x22) & (run % 2 == 0)  # a quote not escaped opens or closes a string
        inside = (np.cumsum(quote) + self._inside) % 2 == 1  # at a bracket (never a quote): inside a string
        step = ((b == 0x5B) | (b == 0x7B)).astype(np.int64) - ((b == 0x5D) | (b == 0x7D))
        step[inside] = 0
        depths = self.depth + np.cumsum(step)
        self.deepest = max(self.deepest, int(depths.max(initial=self.depth)))
        self.depth = int(depths[-1])
        self._inside = bool((int(quote.sum()) + self._inside) % 2)
        self._backslashes = self._backslashes + n if last_other[-1] < 0 else int(n - 1 - last_other[-1])


def json_depth(body: bytes) -> int:
    """The deepest nesting of ``[`` / ``{`` in a JSON text (:class:`JsonDepthScan` over all of it)."""
    return JsonDepthScan().feed(body)


def bearer_ok(headers: Iterable[tuple[bytes, bytes]], expected: bytes) -> bool:
    """Whether the ASGI ``headers`` carry ``Authorization: Bearer <expected>`` (constant-time comparison)."""
    value = dict(headers).get(b"authorization", b"")
    scheme, _, given = value.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), expected)


def detail_error(status: int, message: str) -> dict[str, Any]:
    """FastAPI's error body, ``{"detail": message}`` (the reward service's)."""
    return {"detail": message}


def guard_app(app: Any, *, token: str | None, max_bytes: int, open_paths: Iterable[str] = ("/health",),
              max_depth: int = MAX_JSON_DEPTH, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
              error_body: Callable[[int, str], dict[str, Any]] = detail_error) -> Callable:
    """Wrap the ASGI ``app`` with the checks of the module docstring.

    Args:
        token: the bearer token every path but ``open_paths`` requires (``None``: none, ``--no-auth``); a request
            without it is answered 401 (``WWW-Authenticate: Bearer``) before its body is read.
        max_bytes: the largest body (413 from ``Content-Length`` or as soon as the streamed body passes it).
        max_depth: deepest JSON nesting (400; brackets outside strings, whatever the content type).
        body_timeout_s: longest wait for the next body chunk (408 and the connection closed).
        error_body: ``(status, message) -> JSON body`` of every answer given here (the judge: OpenAI's error shape).
    """
    expected = None if token is None else token.encode()
    open_paths = frozenset(open_paths)

    async def answer(send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
        body = json.dumps(error_body(status, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *headers]})
        await send({"type": "http.response.body", "body": body})

    async def guarded(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        if expected is not None and scope["path"] not in open_paths and not bearer_ok(scope["headers"], expected):
            return await answer(send, 401, "missing or wrong bearer token (Authorization: Bearer ...)",
                                [(b"www-authenticate", b"Bearer")])
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > max_bytes:
            return await answer(send, 413, f"request body of {int(declared)} bytes exceeds the limit of {max_bytes} "
                                           "bytes")
        chunks, size, scan, more = [], 0, JsonDepthScan(), True
        while more:
            try:
                message = await asyncio.wait_for(receive(), body_timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                RATE_LIMITED.warning("body-timeout", f"a client sent no body data for {body_timeout_s:g} s: "
                                                     "answered 408 and closed its connection")
                return await answer(send, 408, f"no request body data for {body_timeout_s:g} s",
                                    [(b"connection", b"close")])
            if message["type"] == "http.disconnect":
                return None
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            if size > max_bytes:
                return await answer(send, 413, f"request body streamed past the limit of {max_bytes} bytes",
                                    [(b"connection", b"close")])
            if scan.feed(chunk) > max_depth:  # any content type: the judge parses every body
                return await answer(send, 400, f"the JSON body is nested at least {scan.deepest} levels deep, "
                                               f"over the limit of {max_depth}", [(b"connection", b"close")])
            if chunk:
                chunks.append(chunk)
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        replayed = False

        async def replay():
            nonlocal replayed, body
            if replayed:
                return await receive()  # after the body: wait for the client to disconnect, as the server would
            replayed, whole = True, body
            body = b""  # the app holds the only reference from here on
            return {"type": "http.request", "body": whole, "more_body": False}

        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            return await app(scope, replay, tracking_send)
        except Exception as exc:  # noqa: BLE001 - one line and a JSON 500, never a traceback per request
            log.error("%s %s failed: %s: %s", scope.get("method"), scope.get("path"), type(exc).__name__,
                      re.sub(r"\s+", " ", str(exc))[:300])
            if not started:
                await answer(send, 500, f"internal error: {type(exc).__name__}: {exc}")
            return None

    return guarded
