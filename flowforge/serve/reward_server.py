"""``flowforge serve reward``: reward scorers behind HTTP, for rewards whose dependencies or devices clash with the
training process. The client is the ``remote`` scorer (:class:`flowforge.rewards.scorers.remote.RemoteScorer`).

Routes (``POST /score`` wants ``Authorization: Bearer <token>`` unless the server runs ``--no-auth`` on loopback;
``GET /health`` is open, as the judge server's: :mod:`flowforge.serve.common`):

``GET /health`` -> ``{"status": "ok", "scorers": {name: {"needs_group": false, "class": "pkg.mod:Cls"}},
"versions": {"flowforge", "torch", "python"}, "limits": {"max_batch", "max_bytes", "max_pixels", "max_frames",
"max_request_pixels"}}``: what a client needs to pick components and size its requests, nothing secret (no token,
no path, no option values, no scores).

``POST /score`` with a JSON body (:class:`ScoreRequest`)::

    {"prompts": [str] * B,
     "metadata": [object] * B,              optional, default {} each
     "media": [media item] * B,             flowforge.rewards.wire: png / jpeg / float32 images, or {"frames": [...]}
     "components": [str]}                   optional, default: every hosted scorer

-> ``{"scores": {name: [float | null] * B}}``: the scorer's float32 scores as JSON numbers (the shortest decimal
that reads back to the same float, so a float32 survives exactly), ``null`` = NaN ("not applicable"). A video is
scored frame by frame and each component averaged over its frames, as the trainer does.

Errors: 401 without the token (checked before the body is read); 408 for a body that stalls; 413 for a body over
``max_bytes``, more than ``max_batch`` items or media decoding to more than ``max_request_pixels`` pixels (read from the
image headers first); 400 for a body nested deeper than :data:`~flowforge.serve.common.MAX_JSON_DEPTH`; 422 with a
one-line ``detail`` for a malformed body (schema, base64, image bytes, sizes, lengths, unknown components, a scorer
rejecting its input with ``ValueError``); 500 when a scorer fails otherwise or returns a wrong shape or an infinite
score. A failure is never answered with a score.
"""

from __future__ import annotations

import math
import platform
import threading
from collections.abc import Mapping
from typing import Any, Literal

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from flowforge.media import video_frames
from flowforge.rewards.base import RewardScorer, takes_latents
from flowforge.rewards.wire import decode_wire_media
from flowforge.serve.common import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_PIXELS, NO_DOCS, PixelBudget,
                                    b64_image_pixels, guard_app)

DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_BYTES = 64 * 2**20
DEFAULT_MAX_PIXELS = 4096 * 4096
DEFAULT_MAX_FRAMES = 256


class ImageItem(BaseModel):
    """One image: ``format`` png / jpeg / float32, base64 ``data``, ``shape`` [3, H, W] for float32."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["png", "jpeg", "float32"]
    data: str
    shape: list[int] | None = None


class VideoItem(BaseModel):
    """One video: its frames in order."""

    model_config = ConfigDict(extra="forbid")
    frames: list[ImageItem] = Field(min_length=1)


class ScoreRequest(BaseModel):
    """The body of ``POST /score`` (module docstring)."""

    model_config = ConfigDict(extra="forbid")
    prompts: list[str]
    media: list[ImageItem | VideoItem]
    metadata: list[dict[str, Any]] | None = None
    components: list[str] | None = None


def _item_pixels(item: ImageItem) -> int:
    """Decoded pixels of one image item, from its ``shape`` (float32) or its header (png / jpeg)."""
    if item.format == "float32":
        shape = item.shape or []
        return shape[1] * shape[2] if len(shape) == 3 and all(isinstance(d, int) and d > 0 for d in shape) else 0
    return b64_image_pixels(item.data)


def request_pixels(media: list[ImageItem | VideoItem]) -> int:
    """Every pixel a request's media decode to, images and video frames together, read without decoding."""
    return sum(sum(_item_pixels(f) for f in m.frames) if isinstance(m, VideoItem) else _item_pixels(m) for m in media)


class ScoreResponse(BaseModel):
    scores: dict[str, list[float | None]]


def check_hosted(scorers: Mapping[str, RewardScorer]) -> None:
    """Refuse scorers this server cannot serve faithfully.

    Raises:
        ValueError: no scorers, a ``needs_group`` scorer (a client splits batches without regard to groups:
            run group scorers in the training process, which gathers whole groups), or a ``takes_latents`` scorer
            (requests carry pixels, not latents).
    """
    if not scorers:
        raise ValueError("serve reward needs at least one scorer (--scorers NAME[,NAME...])")
    grouped = [name for name, s in scorers.items() if getattr(s, "needs_group", False)]
    if grouped:
        raise ValueError(f"group scorers {grouped} cannot be served remotely (a client's batches do not follow "
                         "groups); score them in the training process")
    latent = [name for name, s in scorers.items() if takes_latents(s)]
    if latent:
        raise ValueError(f"latent scorers {latent} (takes_latents) cannot be served remotely: requests carry "
                         "pixels, not latents; score them in the training process")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("flowforge")
    except PackageNotFoundError:
        ours = "unknown"
    return {"flowforge": ours, "torch": torch.__version__, "python": platform.python_version()}


def _score_one(name: str, scorer: RewardScorer, media: torch.Tensor, prompts: list[str],
               metadata: list[dict[str, Any]]) -> list[float | None]:
    """Call one scorer (videos frame by frame, averaged) -> JSON-ready scores. Raises ``ValueError`` for input the
    scorer rejects and ``RuntimeError`` for any other failure."""
    frames = media.shape[2] if media.dim() == 5 else 1
    if media.dim() == 5:
        media = video_frames(media)
        prompts = [p for p in prompts for _ in range(frames)]
        metadata = [m for m in metadata for _ in range(frames)]
    try:
        with torch.no_grad():
            out = scorer(media, prompts, metadata)
    except ValueError as exc:
        raise ValueError(f"component {name!r} rejected the request: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any other scorer failure is the server's (500), reported, never a score
        raise RuntimeError(f"component {name!r} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor) or out.shape != (media.shape[0],):
        raise RuntimeError(f"component {name!r} returned {getattr(out, 'shape', type(out))}, expected "
                           f"[{media.shape[0]}]")
    out = out.detach().float().cpu().view(-1, frames).mean(1)
    if torch.isinf(out).any():
        raise RuntimeError(f"component {name!r} returned an infinite score")
    return [None if math.isnan(v) else v for v in out.tolist()]


def build_app(scorers: Mapping[str, RewardScorer], token: str | None, *, max_batch: int = DEFAULT_MAX_BATCH,
              max_bytes: int = DEFAULT_MAX_BYTES, max_pixels: int = DEFAULT_MAX_PIXELS,
              max_frames: int = DEFAULT_MAX_FRAMES, max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS,
              device: str = "cpu", body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
    """The ASGI app serving ``scorers`` (name -> scorer; the name is the component name clients ask for).

    Args:
        token: the bearer token ``/score`` requires (``/health`` is open); ``None`` = no auth (the CLI allows it on
            loopback only).
        max_batch: most media items per request. max_bytes: largest request body. max_pixels: largest image
            (``H * W``). max_frames: most frames per video. max_request_pixels: decoded pixels per request, all
            images and frames together (read from the headers before anything is decoded; 413 over it); also the
            pixels all requests together decode at once (:class:`~flowforge.serve.common.PixelBudget`).
        device: where decoded media are put before scoring (``"cpu"`` / ``"cuda[:N]"``).
        body_timeout_s: longest pause while a request body arrives (408).

    Raises:
        ValueError: :func:`check_hosted`; a limit < 1.
    """
    check_hosted(scorers)
    limits = {"max_batch": max_batch, "max_bytes": max_bytes, "max_pixels": max_pixels, "max_frames": max_frames,
              "max_request_pixels": max_request_pixels}
    for key, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an int >= 1, got {value!r}")
    scorers = dict(scorers)
    versions = _versions()
    lock = threading.Lock()  # scorers hold models that are not safe to call from two request threads at once
    budget = PixelBudget(max_request_pixels)  # decoded pixels of all requests at once (peak memory)
    app = FastAPI(title="flowforge reward service", **NO_DOCS)

    @app.exception_handler(RequestValidationError)
    async def readable_422(request: Request, exc: RequestValidationError):
        problems = ["/".join(str(p) for p in e.get("loc", ())) + f": {e.get('msg', '')}" for e in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": "; ".join(problems[:8]) or "malformed request"})

    @app.exception_handler(Exception)  # anything unexpected: JSON, logged in one line by guard_app
    async def json_500(request: Request, exc: Exception):
        return JSONResponse(status_code=500, content={"detail": f"internal error: {type(exc).__name__}: {exc}"})

    @app.get("/health")
    async def health() -> dict[str, Any]:
        hosted = {name: {"needs_group": bool(getattr(s, "needs_group", False)),
                         "class": f"{type(s).__module__}:{type(s).__qualname__}"} for name, s in scorers.items()}
        return {"status": "ok", "scorers": hosted, "versions": versions, "limits": limits}

    @app.post("/score", response_model=ScoreResponse)  # the token is checked by guard_app, before the body
    def score(request: ScoreRequest) -> ScoreResponse:
        batch = len(request.media)
        if batch > max_batch:
            raise HTTPException(413, f"{batch} media items exceed the batch limit of {max_batch}; split the request")
        metadata = request.metadata if request.metadata is not None else [{} for _ in range(batch)]
        if len(request.prompts) != batch or len(metadata) != batch:
            raise HTTPException(422, f"prompts ({len(request.prompts)}), metadata ({len(metadata)}) and media "
                                     f"({batch}) must have one entry per item")
        names = request.components if request.components is not None else list(scorers)
        unknown = [n for n in names if n not in scorers]
        if unknown or not names:
            raise HTTPException(422, f"unknown components {unknown}; this server hosts {sorted(scorers)}")
        try:
            with budget.hold(request_pixels(request.media)):  # 413 over the budget; waits while others decode
                media = decode_wire_media([item.model_dump(exclude_none=True) for item in request.media],
                                     max_pixels=max_pixels, max_frames=max_frames).to(device)
                with lock:
                        return ScoreResponse(scores={n: _score_one(n, scorers[n], media, request.prompts, metadata)
                                                 for n in dict.fromkeys(names)})
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        except RuntimeError as exc:
            raise HTTPException(500, str(exc)) from None

    return guard_app(app, token=token, max_bytes=max_bytes, body_timeout_s=body_timeout_s)
