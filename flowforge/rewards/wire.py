"""Media on the wire: the JSON form of images and videos shared by the remote scorer client and the reward server.

One media item is a JSON object:

==========================================================  =========================================================
``{"format": "png", "data": B64}``                          8-bit RGB (or L / RGBA, converted to RGB) PNG
``{"format": "jpeg", "data": B64}``                         JPEG (lossy: for clients that only have JPEGs)
``{"format": "float32", "data": B64, "shape": [3, H, W]}``  raw little-endian float32, channel-major: lossless
``{"frames": [image item, ...]}``                           a video, its frames in order (``F >= 1``, one size)
==========================================================  =========================================================

``B64`` is standard base64 (RFC 4648, with padding). Decoded images are ``[3, H, W]`` float32: 8-bit formats map a
byte ``u`` to ``u / 255`` (float32 division), ``float32`` is taken as sent.

Sending is :func:`encode_images` (a batch) / :func:`encode_image`; receiving :func:`decode_wire_media` (a request's
list of items) / :func:`decode_image`. The rollout's decode of latents into media tensors is another thing
(:func:`flowforge.rollout.decode_media`); the media tensors themselves are :mod:`flowforge.media`.

Lossless sending (:func:`encode_images` with ``encoding="auto"``): an image whose every value is exactly
``float32(u) / 255`` for a byte ``u`` is sent as PNG (bit-identical after decoding, and small); any other image is
sent as ``float32``. A deterministic scorer therefore scores the same bits remotely as in process.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from flowforge.media import to_uint8

IMAGE_FORMATS = ("png", "jpeg", "float32")
ENCODINGS = ("auto", "png", "float32")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: data is not valid base64 ({exc})") from None


def to_bytes_grid(image: Tensor) -> Tensor:
    """``[3, H, W]`` float in [0, 1] -> ``[3, H, W]`` uint8 ``round(clamp(x, 0, 1) * 255)`` on the CPU."""
    return to_uint8(image).cpu()


def on_byte_grid(image: Tensor) -> bool:
    """True when the float32 ``image`` equals ``float32(u) / 255`` for its bytes ``u`` bit for bit (a PNG carries it
    losslessly)."""
    return image.dtype == torch.float32 and torch.equal(to_bytes_grid(image).float() / 255.0, image.detach().cpu())


def encode_image(image: Tensor, fmt: str = "png") -> dict[str, Any]:
    """One ``[3, H, W]`` float image (values in [0, 1]) as a media item (module table).

    ``"png"`` rounds to bytes (lossless only for images :func:`on_byte_grid`); ``"float32"`` sends the values as
    float32 (exact for float32 / bfloat16 / float16 inputs).

    Raises:
        ValueError: not a floating ``[3, H, W]`` tensor, or ``fmt`` not ``"png"`` / ``"float32"``.
    """
    if not isinstance(image, Tensor) or image.dim() != 3 or image.shape[0] != 3 or not image.is_floating_point():
        raise ValueError(f"an image must be a float [3, H, W] tensor, got {getattr(image, 'shape', type(image))}")
    if fmt == "float32":
        values = image.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().astype("<f4", copy=False)
        return {"format": "float32", "data": _b64(values.tobytes()), "shape": list(image.shape)}
    if fmt != "png":
        raise ValueError(f"encoding format must be 'png' or 'float32', got {fmt!r}")
    pixels = to_bytes_grid(image).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels), mode="RGB").save(buffer, format="PNG", compress_level=1)
    return {"format": "png", "data": _b64(buffer.getvalue())}


def encode_images(media: Tensor, encoding: str = "auto") -> list[dict[str, Any]]:
    """A ``[B, 3, H, W]`` float batch as ``B`` media items; ``encoding`` is ``"auto"`` (PNG where lossless, else
    float32: the module docstring), ``"png"`` (always bytes: smaller, rounds) or ``"float32"``.

    Raises:
        ValueError: a bad ``encoding`` or media shape.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {list(ENCODINGS)}, got {encoding!r}")
    if not isinstance(media, Tensor) or media.dim() != 4:
        raise ValueError(f"media must be a [B, 3, H, W] tensor, got {getattr(media, 'shape', type(media))}")
    items = []
    for image in media:
        fmt = encoding
        if encoding == "auto":
            fmt = "png" if on_byte_grid(image) else "float32"
        items.append(encode_image(image, fmt))
    return items


def decode_image(item: dict[str, Any], where: str = "media", *, max_pixels: int | None = None) -> Tensor:
    """One image item -> ``[3, H, W]`` float32 (module table).

    Args:
        item: ``{"format", "data"[, "shape"]}``.
        where: names the item in error messages (e.g. ``"media[3]"``).
        max_pixels: refuse images with more than ``H * W`` pixels (checked before the pixels are decoded).

    Raises:
        ValueError: unknown format, bad base64, undecodable or mislabelled image bytes, a ``float32`` payload whose
            length or ``shape`` is wrong, an image over ``max_pixels`` (each message starts with ``where``).
    """
    fmt = item.get("format")
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"{where}: format must be one of {list(IMAGE_FORMATS)}, got {fmt!r}")
    raw = _unb64(item.get("data", ""), where)
    if fmt == "float32":
        shape = item.get("shape")
        if not (isinstance(shape, list) and len(shape) == 3 and shape[0] == 3
                and all(isinstance(s, int) and s >= 1 for s in shape)):
            raise ValueError(f"{where}: a float32 image needs shape [3, H, W] with H, W >= 1, got {shape!r}")
        if max_pixels is not None and shape[1] * shape[2] > max_pixels:
            raise ValueError(f"{where}: {shape[1]}x{shape[2]} exceeds the limit of {max_pixels} pixels")
        if len(raw) != 4 * 3 * shape[1] * shape[2]:
            raise ValueError(f"{where}: {len(raw)} bytes do not hold float32 values of shape {shape}")
        return torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(shape))
    try:
        with Image.open(io.BytesIO(raw)) as opened:
            if opened.format != fmt.upper():
                raise ValueError(f"{where}: declared {fmt} but the bytes are {opened.format or 'not an image'}")
            if max_pixels is not None and opened.size[0] * opened.size[1] > max_pixels:
                raise ValueError(f"{where}: {opened.size[1]}x{opened.size[0]} exceeds the limit of {max_pixels} "
                                 "pixels")
            pixels = np.asarray(opened.convert("RGB"), dtype=np.uint8)
    except (OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"{where}: not a decodable {fmt} image ({exc})") from None
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255.0


def decode_wire_media(items: Sequence[dict[str, Any]], *, max_pixels: int | None = None,
                 max_frames: int | None = None) -> Tensor:
    """A list of media items -> ``[B, 3, H, W]`` (all images) or ``[B, 3, F, H, W]`` (all videos) float32.

    Raises:
        ValueError: an empty list; images mixed with videos; items (or frames) of different sizes; videos with
            different frame counts or more than ``max_frames`` frames; any :func:`decode_image` error.
    """
    if not items:
        raise ValueError("media is empty: send at least one item")
    videos = ["frames" in item for item in items]
    if any(videos) and not all(videos):
        raise ValueError("media mixes images and videos; send one kind per request")
    if not all(videos):
        decoded = [decode_image(item, f"media[{i}]", max_pixels=max_pixels) for i, item in enumerate(items)]
        return _stack(decoded, "media")
    clips = []
    for i, item in enumerate(items):
        frames = item["frames"]
        if not frames:
            raise ValueError(f"media[{i}]: a video needs at least one frame")
        if max_frames is not None and len(frames) > max_frames:
            raise ValueError(f"media[{i}]: {len(frames)} frames exceed the limit of {max_frames}")
        decoded = [decode_image(f, f"media[{i}].frames[{j}]", max_pixels=max_pixels) for j, f in enumerate(frames)]
        clips.append(_stack(decoded, f"media[{i}].frames").permute(1, 0, 2, 3))
    return _stack(clips, "media")


def _stack(tensors: list[Tensor], where: str) -> Tensor:
    shapes = sorted({tuple(t.shape) for t in tensors})
    if len(shapes) > 1:
        raise ValueError(f"{where}: every item must have one shape, got {shapes[:4]}")
    return torch.stack(tensors)
