"""What every flowforge HTTP server shares: bearer-token auth, the loopback rule, request-size limits, start-up.

Rules (the same for the reward service and the judge server):

* a server binds loopback (``127.0.0.1``) unless told otherwise;
* it wants ``Authorization: Bearer <token>`` on every route except ``GET /health``, checked from the headers
  before any of the body is read (:func:`flowforge.serve.guard.guard_app`); the token is read from a file
  (``--token-file``; a file that does not exist yet is created with a fresh token, mode 0600), or generated and
  printed on stderr when no file is given;
* it runs without a token only when asked (``--no-auth``) **and** bound to a loopback address: anyone who can reach
  a non-loopback port could otherwise score or judge with this machine's models;
* request bodies are streamed under a byte cap (413), a JSON nesting limit (400, :data:`MAX_JSON_DEPTH`, scanned
  chunk by chunk before anything parses) and a read timeout (408): :mod:`flowforge.serve.guard`;
* the pixels a request would decode (all its images and frames together) are read from the image headers (Pillow's
  lazy ``Image.open`` gives the size without decoding; a header past Pillow's decompression-bomb limit counts what
  it claims) and refused with 413 over a per-request budget (:func:`check_pixel_budget`); decoding and scoring run
  under one server-wide :class:`PixelBudget`, so peak memory does not grow with the number of concurrent requests;
* slow and idle clients are bounded by a header deadline and a connection cap that closes the oldest idle
  connection (:mod:`flowforge.serve.listen`);
* ``/docs``, ``/redoc`` and ``/openapi.json`` are off (:data:`NO_DOCS`): they would be served without the token.

When the server is listening, :func:`serve_app` prints one line ``serving <name> at http://HOST:PORT`` on stdout
(flushed), which scripts and tests read to find the port (``--port 0`` picks a free one).
"""

import base64
import binascii
import contextlib
import io
import ipaddress
import os
import secrets
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from flowforge.rewards.judge.protocol import MAX_DECODE_PIXELS, header_pixels
from flowforge.serve.guard import DEFAULT_BODY_TIMEOUT_S, MAX_JSON_DEPTH, guard_app, json_depth  # noqa: F401
from flowforge.serve.listen import serve_app, server_url  # noqa: F401 (re-exported)

LOOPBACK_NAMES = ("localhost",)
TOKEN_BYTES = 32
DEFAULT_MAX_REQUEST_PIXELS = MAX_DECODE_PIXELS
"""Decoded pixels one request may carry, all images and frames together (32 Mi pixels, e.g. 2 x 4096^2 or
128 x 512^2: 384 MiB as float32 RGB); also the pixels all requests together may be decoding at once
(:class:`PixelBudget`)."""
NO_DOCS = {"docs_url": None, "redoc_url": None, "openapi_url": None}
"""``FastAPI(**NO_DOCS)``: no interactive docs or schema routes (FastAPI serves them outside the app's auth)."""

def image_pixels(data: bytes) -> int:
    """``width * height * frames`` of an encoded image, read from its header (``PIL.Image.open`` is lazy: nothing is
    decoded); 0 when ``data`` is not an image Pillow recognises (the decoder reports that later, with context).
    A header past Pillow's decompression-bomb limit counts the pixels it claims (so the budget refuses it: 413)."""
    from PIL import UnidentifiedImageError

    try:
        return header_pixels(io.BytesIO(data))
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


class PixelBudget:
    """Decoded pixels in memory across all requests at once, at most ``total``: a request holds its pixel cost
    (read from its image headers) while it decodes and scores, and waits while the pixels held by others would push
    the total over. So peak memory follows one budget's worth of pixels, not the number of concurrent requests (the
    thread pool runs up to 40). A request costing more than ``total`` alone is refused (413), never queued.

    Use: ``with budget.hold(pixels): media = decode(...); scores = score(media)``.
    """

    def __init__(self, total: int) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"the pixel budget must be an int >= 1, got {total!r}")
        self.total, self.held = total, 0
        self._free = threading.Condition()

    @contextlib.contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        """Hold ``pixels`` of the budget for the ``with`` block (waits for them; 413 over ``total``)."""
        check_pixel_budget(pixels, self.total)
        with self._free:
            self._free.wait_for(lambda: self.held + pixels <= self.total)
            self.held += pixels
        try:
            yield
        finally:
            with self._free:
                self.held -= pixels
                self._free.notify_all()


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and any address in 127.0.0.0/8 or ``::1``; False for every other name or address
    (``0.0.0.0`` included: it listens on every interface)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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


