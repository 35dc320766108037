"""Real HTTP servers on loopback for the concurrency tests: flowforge's own judge and reward apps served by uvicorn
in a thread (a free port), behind an ASGI middleware that counts the requests in flight.

:class:`InFlight` holds the first requests until ``parties`` of them are in flight at once (or ``hold_s`` passes), so
a client that sends its calls together is seen with exactly that many in flight, whatever the thread timing -- and a
client that sends one at a time is seen with one (it never reaches ``parties``; each of its first requests waits
``hold_s``). The maximum it records is what the tests assert; no timing is asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import torch

TOKEN = "loopback-test-token"
TOKEN_ENV = "FF_TEST_LOOPBACK_TOKEN"


class Brightness:
    """Mean pixel value per image: a deterministic, content-dependent score in [0, 1]."""

    name = "brightness"
    needs_group = False

    def __call__(self, media, prompts, metadata):
        return media.float().mean(dim=tuple(range(1, media.dim())))


class FailingFor:
    """A judge backend: :class:`Brightness` group scores, but HTTP 500 for a group whose prompt contains
    ``marker``."""

    def __init__(self, marker: str = "FAILME", model_id: str = "loopback") -> None:
        from flowforge.serve.judge_backends import ScorerBackend

        self.model_id, self.marker = model_id, marker
        self.inner = ScorerBackend(Brightness(), model_id)

    def complete(self, messages, **kwargs):
        from flowforge.serve.judge_backends import BackendError

        text = " ".join(p.get("text", "") for m in messages if isinstance(m.get("content"), list)
                        for p in m["content"]) + " ".join(m["content"] for m in messages
                                                          if isinstance(m.get("content"), str))
        if self.marker and self.marker in text:
            raise BackendError(500, f"scripted failure ({self.marker})")
        return self.inner.complete(messages, **kwargs)


class InFlight:
    """ASGI middleware: counts concurrent POST requests (``now``, ``max``, ``total``); see the module docstring."""

    def __init__(self, app, parties: int = 1, hold_s: float = 0.5) -> None:
        self.app, self.parties, self.hold_s = app, parties, hold_s
        self.now = self.max = self.total = 0
        self._full: asyncio.Event | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if self._full is None:
            self._full = asyncio.Event()
        self.now += 1
        self.total += 1
        self.max = max(self.max, self.now)
        try:
            if self.now >= self.parties:
                self._full.set()
            if not self._full.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self.hold_s)
            await self.app(scope, receive, send)
        finally:
            self.now -= 1


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """Serve the ASGI ``app`` on 127.0.0.1 (a free port) in a thread; yields its base URL, stops it after."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the loopback server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextlib.contextmanager
def judge_server(parties: int = 1, marker: str = "FAILME") -> Iterator[tuple[str, InFlight]]:
    """flowforge's judge server (:func:`flowforge.serve.judge_server.build_app`, bearer :data:`TOKEN`) over
    :class:`FailingFor`; yields ``(API root .../v1, its InFlight counter)``."""
    from flowforge.serve.judge_server import build_app

    counter = InFlight(build_app(FailingFor(marker), TOKEN), parties)
    with serve(counter) as url:
        yield url + "/v1", counter


@contextlib.contextmanager
def reward_server(scorers: dict, parties: int = 1) -> Iterator[tuple[str, InFlight]]:
    """flowforge's reward service (:func:`flowforge.serve.reward_server.build_app`, bearer :data:`TOKEN`) hosting
    ``scorers``; yields ``(base URL, its InFlight counter)``."""
    from flowforge.serve.reward_server import build_app

    counter = InFlight(build_app(scorers, TOKEN), parties)
    with serve(counter) as url:
        yield url, counter


def groups(n: int, k: int = 4, size: int = 16, fail: tuple[int, ...] = ()):
    """``n`` groups of ``k`` candidates, interleaved in row order (sample ``i`` belongs to group ``i % n``):
    ``(media [n*k, 3, size, size], prompts, metadata, group_ids)``; groups in ``fail`` have "FAILME" in their
    prompt."""
    g = torch.Generator().manual_seed(0)
    media = torch.rand(n * k, 3, size, size, generator=g)
    ids = torch.arange(n * k) % n
    prompts = [f"prompt {int(i)}" + (" FAILME" if int(i) in fail else "") for i in ids]
    return media, prompts, [{"sample_id": f"{int(i)}-{j}"} for j, i in enumerate(ids)], ids
