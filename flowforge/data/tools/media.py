"""Decode checks for the media files a prompt row lists (``flowforge data inspect --decode-media``).

==================================  ============================================================================
media                               how it is checked
==================================  ============================================================================
image file                          PIL opens it and decodes every pixel (``Image.load``), not just the header
video: a directory of frames        every file in it with an image suffix (:data:`FRAME_SUFFIXES`) decodes as an
                                    image, and there is at least one
video: a ``.gif`` file              PIL decodes every frame
video: any other file (``.mp4``)    not decodable here: flowforge has no video-file reader; reported as
                                    unsupported, never as passing
audio: a ``.wav`` file              the standard library's ``wave`` reads the header and every frame, and
                                    there is at least one
audio: any other file (``.mp3``)    not decodable here; reported as unsupported, never as passing
==================================  ============================================================================
"""

from __future__ import annotations

from pathlib import Path

from flowforge.runtime.errors import one_line

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
"""File suffixes (lower case) counted as frames in a frames directory."""


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {one_line(str(exc)) or 'no message'}"


def image_problem(path: Path) -> str | None:
    """None when ``path`` decodes as an image (every frame of a multi-frame file), else why not."""
    from PIL import Image, ImageSequence

    try:
        with Image.open(path) as image:
            for frame in ImageSequence.Iterator(image):
                frame.load()
    except Exception as exc:  # PIL raises several types (UnidentifiedImageError, OSError, SyntaxError, ...)
        return f"does not decode as an image ({_error_text(exc)})"
    return None


def _frames_problem(directory: Path) -> str | None:
    frames = sorted(p for p in directory.iterdir() if p.suffix.lower() in FRAME_SUFFIXES and p.is_file())
    if not frames:
        return f"is a frames directory with no frame images ({', '.join(FRAME_SUFFIXES)})"
    for frame in frames:
        problem = image_problem(frame)
        if problem:
            return f"has frame {frame.name} that {problem}"
    return None


def audio_problem(path: Path) -> str | None:
    """None when ``path`` is a WAV file whose every frame reads (and has at least one), else why not."""
    import wave

    if path.suffix.lower() != ".wav":
        return (f"is an audio file of a kind flowforge cannot decode ({path.suffix or 'no suffix'}; it reads WAV), "
                "so it was not checked")
    try:
        with wave.open(str(path), "rb") as sound:
            count = sound.getnframes()
            data = sound.readframes(count)
    except Exception as exc:  # wave raises wave.Error, EOFError, OSError
        return f"does not decode as WAV audio ({_error_text(exc)})"
    if count == 0 or not data:
        return "is a WAV file with no audio frames"
    return None


def decode_problem(kind: str, path: Path) -> str | None:
    """None when the media file ``path`` of ``kind`` (``image`` / ``video`` / ``audio``) decodes (module docstring
    table), else a phrase saying why not (it follows the path in a message). ``path`` must exist."""
    if kind == "image":
        return image_problem(path)
    if kind == "audio":
        return audio_problem(path)
    if path.is_dir():
        return _frames_problem(path)
    if path.suffix.lower() == ".gif":
        return image_problem(path)
    return (f"is a video file of a kind flowforge cannot decode ({path.suffix or 'no suffix'}; it reads frame "
            "directories and GIFs), so it was not checked")
