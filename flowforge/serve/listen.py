"""Serving an ASGI app with uvicorn so that slow or idle clients cannot hold the server (:func:`serve_app`).

uvicorn's own settings bound what they can: ``timeout_keep_alive`` (idle between requests), the h11 parser's
``h11_max_incomplete_event_size`` (request line + headers, 16 KiB), ``backlog``. Two gaps are closed by a subclass of
uvicorn's h11 protocol (:func:`_protocol`):

* **a header deadline**: a connection that has not sent a whole request head ``client_timeout_s`` after it opened
  (or after its last response) is closed. uvicorn has none: its keep-alive timer is cancelled by the first byte, so a
  client that sends half a header is otherwise held forever;
* **a connection cap with eviction**: at most ``max_connections`` open connections (by default 1000, and never more
  than the process's open-file limit less a reserve of :data:`FD_RESERVE`); a connection over the cap closes the
  oldest *idle* one (no request in progress: still sending its head, or between requests), as nginx reuses idle
  keep-alive connections. So a flood of idle sockets neither exhausts file descriptors (``accept`` failing with
  ``EMFILE``, asyncio logging a traceback per retry) nor keeps ``/health`` out. uvicorn's ``limit_concurrency`` is
  not used: it counts idle connections too and answers every request 503 once they reach it.

A request body's read timeout is :func:`flowforge.serve.guard.guard_app`'s. Refused or evicted connections are logged
at most once a minute (:data:`flowforge.serve.guard.RATE_LIMITED`); asyncio's ``socket.accept() out of system
resource`` error, should the descriptors run out anyway, is reduced to the same rate-limited line, no traceback.
"""

import logging
import resource
import socket
from typing import Any

from flowforge.serve.guard import RATE_LIMITED

DEFAULT_MAX_CONNECTIONS = 1000
DEFAULT_CLIENT_TIMEOUT_S = 30.0
ACCEPT_BURST = 128
"""uvicorn's ``backlog``: the listen queue, and (asyncio) how many connections are accepted in one go before any of
them runs ``connection_made``, where the cap is enforced."""
FD_RESERVE = 2 * ACCEPT_BURST
"""File descriptors kept free of client connections: an accept burst over the cap (and the next one, while the
evicted sockets close), model files, the request log, the listening socket."""
MAX_HEAD_BYTES = 16 * 1024
"""Largest request line + headers (uvicorn's ``h11_max_incomplete_event_size``; a larger head is a 400)."""


MMAP_THRESHOLD = 1 << 20
"""Allocations from this size on are mmapped by glibc and returned to the system when freed (:func:`return_freed`)."""


def return_freed() -> None:
    """Make glibc mmap every allocation of :data:`MMAP_THRESHOLD` bytes or more (``mallopt(M_MMAP_THRESHOLD)``), so
    the buffers a request decodes go back to the system when freed. By default glibc raises the threshold up to
    32 MiB after the first large free, and the decode buffers below it then stay in the arena of the thread that
    decoded them: with 8 request threads, the servers' resident memory grew by one request's buffers per thread
    (measured: 8 budget-sized requests one after another in the pool, +226 MiB against +113 MiB for one). No-op
    without glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD; also turns off the dynamic adjustment
    except (OSError, AttributeError):
        pass


def connection_cap(max_connections: int) -> int:
    """``max_connections``, lowered to the open-file soft limit less :data:`FD_RESERVE` (at least 1)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft - FD_RESERVE))


class _AcceptErrors(logging.Filter):
    """asyncio's ``socket.accept() out of system resource`` (with a traceback, once per retry) -> one rate-limited
    line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "socket.accept() out of system resource" not in record.getMessage():
            return True
        RATE_LIMITED.warning("accept", "accept() failed: out of file descriptors (raise `ulimit -n` or lower "
                                       "--max-connections); new connections wait in the backlog")
        return False


def _protocol(cap: int, client_timeout_s: float) -> type:
    """uvicorn's ``H11Protocol`` with the header deadline and the connection cap of the module docstring."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        _deadline = None

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(client_timeout_s, self._overdue)

        def _overdue(self) -> None:
            if self._idle() and not self.transport.is_closing():
                RATE_LIMITED.warning("head-timeout", f"closed a connection that sent no whole request head in "
                                                     f"{client_timeout_s:g} s")
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._opened = self.loop.time()
            self._arm()
            live = [c for c in self.connections if not c.transport.is_closing()]  # closed ones leave next tick
            if len(live) > cap:
                idle = [c for c in live if c is not self and c._idle()]
                victim = min(idle, key=lambda c: c._opened) if idle else self
                what = "closed the oldest idle one" if idle else "all busy, refused the new one"
                RATE_LIMITED.warning("cap", f"{len(live)} connections over the cap of {cap}: " + what)
                victim.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head has the same deadline

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

    return GuardedH11


def server_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` (an IPv6 address in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def serve_app(app: Any, host: str, port: int, ready_message: str, *,
              max_connections: int = DEFAULT_MAX_CONNECTIONS,
              client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S) -> None:
    """Serve the ASGI ``app`` with uvicorn on ``host:port`` until interrupted (SIGINT / SIGTERM).

    ``port=0`` binds a free port. Once listening, prints ``serving <ready_message> at http://HOST:PORT`` on stdout,
    flushed (``ready_message`` names the server, e.g. ``"reward"``). ``max_connections`` / ``client_timeout_s``:
    the module docstring (the timeout also bounds the keep-alive wait, at most 5 s).

    Raises:
        OSError: the address cannot be bound (in use, not local).
    """
    import uvicorn

    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit TCP_NODELAY: without it a response written in two parts (headers, body) waits
    # for the client's delayed ACK, about 40 ms per request on Linux
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host.strip("[]"), port))
    url = server_url(host, sock.getsockname()[1])
    logging.getLogger("asyncio").addFilter(_AcceptErrors())
    return_freed()
    logging.basicConfig(format="%(levelname)s: %(message)s")  # flowforge.serve's rate-limited lines on stderr

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                print(f"serving {ready_message} at {url}", flush=True)

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            http=_protocol(connection_cap(max_connections), client_timeout_s),
                            timeout_keep_alive=max(1, min(5, int(client_timeout_s))),
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES, backlog=ACCEPT_BURST)
    Server(config).run(sockets=[sock])
