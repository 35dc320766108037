"""What every flowforge HTTP server shares: bearer-token auth, the loopback rule, request-size limits, start-up.

Rules (the same for the reward service and the judge server):

* a server binds loopback (``127.0.0.1``) unless told otherwise;
* it wants ``Authorization: Bearer <token>`` on every route except ``GET /health``; the token is read from a file
  (``--token-file``; a file that does not exist yet is created with a fresh token, mode 0600), or generated and
  printed on stderr when no file is given;
* it runs without a token only when asked (``--no-auth``) **and** bound to a loopback address: anyone who can reach
  a non-loopback port could otherwise score or judge with this machine's models;
* request bodies over a byte limit are refused with 413 before they are read whole (:func:`limit_body`), and a JSON
  body nested deeper than :data:`MAX_JSON_DEPTH` with 400 before it is parsed (the parser would recurse into a
  ``RecursionError``, a 500);
* the pixels a request would decode (all its images and frames together) are read from the image headers (Pillow's
  lazy ``Image.open`` gives the size without decoding) and refused with 413 over a per-request budget
  (:func:`check_pixel_budget`), so memory per request is bounded by the budget, not by how well an image compresses;
* ``/docs``, ``/redoc`` and ``/openapi.json`` are off (:data:`NO_DOCS`): they would be served without the token.

When the server is listening, :func:`serve_app` prints one line ``serving <name> at http://HOST:PORT`` on stdout
(flushed), which scripts and tests read to find the port (``--port 0`` picks a free one).
"""

import base64
import binascii
import hmac
import io
import ipaddress
import json
import os
import re
import secrets
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOOPBACK_NAMES = ("localhost",)
TOKEN_BYTES = 32
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays / objects a JSON request body may have (the servers' schemas need fewer than 10)."""
DEFAULT_MAX_REQUEST_PIXELS = 2**25
"""Decoded pixels one request may carry, all images and frames together (32 Mi pixels, e.g. 2 x 4096^2 or
128 x 512^2: 384 MiB as float32 RGB)."""
NO_DOCS = {"docs_url": None, "redoc_url": None, "openapi_url": None}
"""``FastAPI(**NO_DOCS)``: no interactive docs or schema routes (FastAPI serves them outside the app's auth)."""

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_depth(body: bytes) -> int:
    """The deepest nesting of ``[`` / ``{`` in a JSON text, strings skipped, without parsing it (a vectorised scan,
    so a hostile 64 MiB body costs a fraction of a second and no recursion)."""
    import numpy as np

    skeleton = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)
    step = np.isin(skeleton, (0x5B, 0x7B)).astype(np.int64) - np.isin(skeleton, (0x5D, 0x7D)).astype(np.int64)
    return int(np.cumsum(step).max(initial=0))


def image_pixels(data: bytes) -> int:
    """``width * height * frames`` of an encoded image, read from its header (``PIL.Image.open`` is lazy: nothing is
    decoded); 0 when ``data`` is not an image Pillow recognises (the decoder reports that later, with context)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            return width * height * max(1, int(getattr(image, "n_frames", 1) or 1))
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return 0


def b64_image_pixels(text: str) -> int:
    """:func:`image_pixels` of base64 text, or of a ``data:image/...;base64,`` URL; 0 for anything else."""
    if text.startswith("data:"):
        head, _, text = text.partition(",")
        if ";base64" not in head:
            return 0
    try:
        return image_pixels(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        return 0


def check_pixel_budget(pixels: int, limit: int) -> None:
    """Refuse (HTTP 413) a request whose images and frames would decode to more than ``limit`` pixels."""
    from fastapi import HTTPException

    if pixels > limit:
        raise HTTPException(413, f"the request's images and frames decode to {pixels} pixels, over the limit of "
                                 f"{limit} per request; send fewer or smaller images per request")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and any address in 127.0.0.0/8 or ``::1``; False for every other name or address
    (``0.0.0.0`` included: it listens on every interface)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` (an IPv6 address in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def resolve_token(token_file: str | Path | None, no_auth: bool, host: str) -> str | None:
    """The bearer token a server requires, or ``None`` when it runs without auth.

    Args:
        token_file: a file whose content (stripped) is the token. A file that does not exist yet is created with a
            fresh random token (``secrets.token_urlsafe``, 32 bytes), mode 0600, exclusively (an existing file is
            never overwritten: one that appears meanwhile is read instead), and its path printed on stderr, so the
            clients read the same file. ``None`` generates a token and prints it on stderr.
        no_auth: run without a token; allowed only on a loopback ``host`` and without ``token_file``.
        host: the address the server binds.

    Raises:
        ValueError: ``no_auth`` with a non-loopback host or with a token file; an empty token file.
        OSError: the token file cannot be read or created (e.g. its directory does not exist).
    """
    if no_auth:
        if token_file is not None:
            raise ValueError("--no-auth and --token-file contradict each other; give one")
        if not is_loopback(host):
            raise ValueError(f"--no-auth is refused on the non-loopback host {host!r}: anyone reaching the port "
                             "could use the server; bind 127.0.0.1 or give --token-file")
        return None
    if token_file is None:
        token = secrets.token_urlsafe(TOKEN_BYTES)
        print(f"bearer token (pass --token-file to choose one): {token}", file=sys.stderr, flush=True)
        return token
    token = _create_token_file(Path(token_file))
    if token is not None:
        return token
    token = Path(token_file).read_text().strip()
    if not token:
        raise ValueError(f"token file {str(token_file)!r} is empty; write the bearer token into it")
    return token


def _create_token_file(path: Path) -> str | None:
    """Write a fresh token into ``path`` if no file is there (``O_CREAT | O_EXCL``, mode 0600: only the owner reads
    it) and return it; ``None`` when ``path`` already exists (a symlink included: its target is read, never
    written)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return None
    token = secrets.token_urlsafe(TOKEN_BYTES)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    print(f"bearer token written to {path} (mode 0600); clients read it from there", file=sys.stderr, flush=True)
    return token


def require_token(token: str | None) -> Callable[..., None]:
    """A FastAPI dependency that refuses a request without ``Authorization: Bearer <token>`` (401, with a
    ``WWW-Authenticate: Bearer`` header). ``token=None`` accepts every request (``--no-auth``). The comparison
    takes constant time (``hmac.compare_digest``).

    Use: ``app.post("/score", dependencies=[Depends(require_token(token))])``."""
    from fastapi import HTTPException, Request

    # no postponed annotations in this module: FastAPI must see the real ``Request`` class on ``check``
    expected = None if token is None else token.encode()

    def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token (Authorization: Bearer ...)",
                                headers={"WWW-Authenticate": "Bearer"})

    return check


def detail_error(status: int, message: str) -> dict[str, Any]:
    """FastAPI's error body, ``{"detail": message}`` (the reward service's)."""
    return {"detail": message}


def limit_body(app: Any, max_bytes: int, max_depth: int = MAX_JSON_DEPTH,
               error_body: Callable[[int, str], dict[str, Any]] = detail_error) -> Callable:
    """Wrap an ASGI ``app`` so that an HTTP request body over ``max_bytes`` is answered 413: at once from
    ``Content-Length``, else as soon as the streamed body passes the limit (the body is read here, at most
    ``max_bytes`` of it, and handed to ``app`` whole); a body nested deeper than ``max_depth`` (brackets outside JSON
    strings, whatever its ``Content-Type``) is answered 400 before anything parses it. The JSON body of those
    answers is ``error_body(status, message)`` (default ``{"detail": message}``; the judge server's is OpenAI's
    error object)."""

    async def send_413(send, size: str) -> None:
        await send_error(send, 413, f"request body {size} exceeds the limit of {max_bytes} bytes")

    async def send_error(send, status: int, detail: str) -> None:
        body = json.dumps(error_body(status, detail)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def limited(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            return await send_413(send, f"of {int(declared)} bytes")
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > max_bytes:
                return await send_413(send, "streamed")
        if body and (depth := json_depth(bytes(body))) > max_depth:  # any content type: the judge parses every body
            return await send_error(send, 400, f"the JSON body is nested {depth} levels deep, over the limit of "
                                               f"{max_depth}")
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for the client to disconnect, as the server would
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await app(scope, replay, send)

    return limited


def serve_app(app: Any, host: str, port: int, ready_message: str) -> None:
    """Serve the ASGI ``app`` with uvicorn on ``host:port`` until interrupted (SIGINT / SIGTERM).

    ``port=0`` binds a free port. Once listening, prints ``serving <ready_message> at http://HOST:PORT`` on stdout,
    flushed (``ready_message`` names the server, e.g. ``"reward"``).

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

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                print(f"serving {ready_message} at {url}", flush=True)

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    Server(config).run(sockets=[sock])
