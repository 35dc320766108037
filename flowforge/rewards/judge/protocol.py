"""The group-judge wire protocol: prompt template, media encoding, candidate permutation, message layout, parser.

One request judges one group: the ``K`` candidates generated for one prompt, each an image or a video shown as its
ordered frames, with the condition's first frame (image-to-video, world models) and a reference the candidates should
match when the task has them. Everything here is shared by the client (:mod:`flowforge.rewards.judge.client`), the
judge server (``flowforge serve judge``) and the student's data (:mod:`flowforge.reward_model.data`), so training,
audits and the student see one layout:

====================  ===============================================================================================
message part          content
====================  ===============================================================================================
instructions          the rendered template (:class:`JudgeTemplate`; its sha256 is part of every request key)
``Prompt: <text>``    the prompt / condition text of the group
``Condition:``        (optional) followed by the condition's first frame: the image the candidates start from
``Examples:``         (optional) followed by static example images (e.g. a game's sprites and screens), one each
``Reference:``        (optional) followed by the reference's frames as images (a clip: its ordered frames)
``Candidate A:`` ...  each candidate's label line followed by its ``N`` frames as images, in presented order
====================  ===============================================================================================

Media: a video ``[3, F, H, W]`` is shown as ``N = min(frames, F)`` ordered frames, frame ``i`` at index
``floor((i + 1/2) F / N)`` (the centres of ``N`` equal segments: evenly spaced, the middle frame for ``N = 1``);
an image ``[3, H, W]`` is one frame. Each frame is 8-bit RGB (``round(255 x)``), downscaled (never upscaled) so its
longest side is at most ``max_side`` (bicubic), JPEG-encoded, and sent as a ``data:image/jpeg;base64,`` URL; the
sha256 of the JPEG bytes names the frame in request keys and ledgers.

Position bias (judges prefer some positions) is controlled by showing the candidates in a seeded permutation
(:func:`group_permutation`): presented position ``j`` shows candidate ``perm[j]``, and a score returned for label
``j`` belongs to candidate ``perm[j]``. The permutation depends on the seed and the group's content only, so the same
group always gives the same request (a ledger hit), while different groups are shuffled differently.

Reply (:func:`parse_scores`): exactly one JSON object, one key per candidate label, each value a number in
``[0, 100]``; anything else is :class:`MalformedReply`. Scores are returned divided by 100, in ``[0, 1]``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import json
import math
import random
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flowforge.media import to_uint8

DEFAULT_TEMPLATE = Path(__file__).resolve().parents[1] / "judge_templates" / "group_v2.txt"
"""The shipped group-judge template (``group_v2``: ``group_v1`` plus the condition frame's note). Shipped templates
are never edited (their sha256 is in every request key: an edit would re-send every recorded group); ``group_v3``
adds the examples' note and is needed when a group carries example images."""
PLACEHOLDERS = frozenset({"num_candidates", "labels", "media_kind", "frames_note", "reference_note", "video_note",
                          "json_example", "prompt", "condition_note", "examples_note"})
"""Names a template may use as ``{{name}}``; any other ``{{...}}`` is an error at load time."""
SCORE_MAX = 100.0
"""Replies score on ``[0, SCORE_MAX]``; :func:`parse_scores` divides by it."""
DATA_URL_PREFIX = "data:image/jpeg;base64,"
PROMPT_PREFIX = "Prompt: "
REFERENCE_HEADER = "Reference:"
CONDITION_HEADER = "Condition:"
EXAMPLES_HEADER = "Examples:"
CANDIDATE_HEADER = re.compile(r"^Candidate ([A-Z]{1,2}):$")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


class MalformedReply(ValueError):
    """A judge reply that is not exactly one score in ``[0, 100]`` per candidate label; the message says why."""


def candidate_labels(k: int) -> list[str]:
    """``k`` labels ``A, B, ..., Z, AA, AB, ...`` (at most 702).

    Raises:
        ValueError: ``k`` not in ``[1, 702]``.
    """
    letters = string.ascii_uppercase
    if not 1 <= k <= 26 + 26 * 26:
        raise ValueError(f"a group must have 1..702 candidates, got {k}")
    return [letters[i] if i < 26 else letters[i // 26 - 1] + letters[i % 26] for i in range(k)]


@dataclasses.dataclass(frozen=True)
class JudgeTemplate:
    """A versioned instruction template: its text, the sha256 of its UTF-8 bytes and its file name stem."""

    text: str
    sha256: str
    version: str

    @classmethod
    def load(cls, path: str | Path | None = None) -> JudgeTemplate:
        """Read a template file (``None``: :data:`DEFAULT_TEMPLATE`; a bare shipped name such as ``group_v3``: that
        shipped file).

        Raises:
            OSError: the file cannot be read.
            ValueError: it uses a placeholder outside :data:`PLACEHOLDERS` (the message lists the allowed ones).
        """
        path = Path(DEFAULT_TEMPLATE if path is None else path)
        if path.parent == Path(".") and not path.suffix and not path.exists():
            shipped = DEFAULT_TEMPLATE.with_name(f"{path.name}.txt")
            path = shipped if shipped.is_file() else path
        data = path.read_bytes()
        text = data.decode("utf-8")
        unknown = sorted(set(_PLACEHOLDER.findall(text)) - PLACEHOLDERS)
        if unknown:
            raise ValueError(f"template {str(path)!r} uses unknown placeholders {unknown}; allowed: "
                             f"{sorted(PLACEHOLDERS)}")
        return cls(text=text, sha256=hashlib.sha256(data).hexdigest(), version=path.stem)

    def render(self, prompt: str, labels: Sequence[str], frames: int, has_reference: bool,
               has_condition: bool = False, has_examples: bool = False) -> str:
        """The instructions for one group: ``labels`` in presented order, ``frames`` per candidate (1: images).

        Raises:
            ValueError: ``has_examples`` with a template that never mentions them (no ``{{examples_note}}``).
        """
        if has_examples and "{{examples_note}}" not in self.text:
            raise ValueError(f"the judge template {self.version!r} has no {{{{examples_note}}}}: a group with example "
                             "images needs a template that tells the judge what they are (template: group_v3)")
        video = frames > 1
        example = json.dumps({label: 50 + 10 * (i % 3) for i, label in enumerate(labels)})
        values = {
            "num_candidates": str(len(labels)),
            "labels": ", ".join(labels),
            "media_kind": "video" if video else "image",
            "frames_note": f"; each video is shown as {frames} frames in temporal order" if video else "",
            "reference_note": ("A reference, shown first after the line \"Reference:\", is what the candidates "
                               "should match; it is not scored." if has_reference else ""),
            "video_note": " and, for videos, temporal consistency and motion" if video else "",
            "condition_note": ("The condition, shown after the line \"Condition:\", is the first frame every "
                               "candidate starts from; it is not scored." if has_condition else ""),
            "examples_note": ("Example images, shown after the line \"Examples:\", show what the world looks like "
                              "(its objects and screens); they are not scored." if has_examples else ""),
            "json_example": example,
            "prompt": prompt,
        }
        return _PLACEHOLDER.sub(lambda m: values[m.group(1)], self.text)


def frame_indices(num_frames: int, frames: int) -> list[int]:
    """``min(frames, num_frames)`` evenly spaced frame indices: ``floor((i + 1/2) F / N)``.

    Raises:
        ValueError: ``num_frames`` or ``frames`` below 1.
    """
    if num_frames < 1 or frames < 1:
        raise ValueError(f"num_frames and frames must be >= 1, got {num_frames} and {frames}")
    n = min(frames, num_frames)
    return [int((2 * i + 1) * num_frames // (2 * n)) for i in range(n)]


def jpeg_bytes(image: Tensor, max_side: int, quality: int = 90) -> bytes:
    """One ``[3, H, W]`` float image in [0, 1] -> JPEG bytes (8-bit RGB, longest side <= ``max_side``).

    Raises:
        ValueError: ``image`` is not ``[3, H, W]``; ``max_side`` < 1.
    """
    from PIL import Image

    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"a frame must be [3, H, W], got {tuple(image.shape)}")
    if max_side < 1:
        raise ValueError(f"max_side must be >= 1, got {max_side}")
    pixels = to_uint8(image).permute(1, 2, 0).cpu().numpy()
    pil = Image.fromarray(pixels, mode="RGB")
    longest = max(pil.size)
    if longest > max_side:
        scale = max_side / longest
        pil = pil.resize((max(1, round(pil.width * scale)), max(1, round(pil.height * scale))), Image.BICUBIC)
    out = io.BytesIO()
    pil.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def encode_media(item: Tensor, frames: int, max_side: int, quality: int = 90) -> list[bytes]:
    """One candidate (image ``[3, H, W]`` or video ``[3, F, H, W]``) -> its JPEG frames, in order.

    Raises:
        ValueError: ``item`` is neither shape.
    """
    if item.dim() == 3 and item.shape[0] == 3:
        return [jpeg_bytes(item, max_side, quality)]
    if item.dim() == 4 and item.shape[0] == 3:
        return [jpeg_bytes(item[:, f], max_side, quality) for f in frame_indices(item.shape[1], frames)]
    raise ValueError(f"a candidate must be an image [3, H, W] or a video [3, F, H, W], got {tuple(item.shape)}")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def data_url(jpeg: bytes) -> str:
    """JPEG bytes -> a ``data:image/jpeg;base64,...`` URL."""
    return DATA_URL_PREFIX + base64.b64encode(jpeg).decode("ascii")


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 ``data:image/...`` URL.

    Raises:
        ValueError: not a base64 ``data:image/`` URL (remote URLs are never fetched).
    """
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ValueError(f"image_url must be a base64 data:image/... URL, got {url[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"image_url data is not valid base64: {exc}") from None


def group_permutation(seed: int, prompt: str, media_hashes: Sequence[Sequence[str]]) -> list[int]:
    """The presented order of a group: position ``j`` shows candidate ``perm[j]`` (recorded with every request).

    A ``random.Random`` shuffle seeded with the first 8 bytes of ``sha256(seed, prompt, hashes)``: each request is
    shuffled its own way, and the same seed and group give the same order (so the same request, a ledger hit).
    """
    material = json.dumps([seed, prompt, [list(h) for h in media_hashes]], separators=(",", ":"))
    rng = random.Random(int.from_bytes(hashlib.sha256(material.encode()).digest()[:8], "big"))
    perm = list(range(len(media_hashes)))
    rng.shuffle(perm)
    return perm


def request_key(model: str, template_sha256: str, prompt: str, reference: Sequence[str],
                presented: Sequence[Sequence[str]], settings: dict) -> str:
    """sha256 hex of the canonical JSON of everything that decides a reply: the model name, the template hash, the
    prompt, the reference's frame hashes, the presented candidates' frame hashes (in presented order) and the
    generation settings (sorted keys, no spaces)."""
    payload = {"version": 1, "model": model, "template_sha256": template_sha256, "prompt": prompt,
               "reference": list(reference), "candidates": [list(c) for c in presented], "settings": settings}
    return sha256_hex(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode())


def build_content(instructions: str, prompt: str, reference: Sequence[str] | None,
                  candidates: Sequence[Sequence[str]], labels: Sequence[str], *,
                  condition: Sequence[str] | None = None, examples: Sequence[str] | None = None) -> list[dict]:
    """The user message's content parts (module table) from image URLs; ``reference`` / ``condition`` /
    ``examples`` None: none."""
    parts: list[dict] = [{"type": "text", "text": instructions}, {"type": "text", "text": PROMPT_PREFIX + prompt}]

    def images(urls: Sequence[str]) -> None:
        parts.extend({"type": "image_url", "image_url": {"url": url}} for url in urls)

    if condition is not None:
        parts.append({"type": "text", "text": CONDITION_HEADER})
        images(condition)
    if examples is not None:
        parts.append({"type": "text", "text": EXAMPLES_HEADER})
        images(examples)
    if reference is not None:
        parts.append({"type": "text", "text": REFERENCE_HEADER})
        images(reference)
    for label, urls in zip(labels, candidates, strict=True):
        parts.append({"type": "text", "text": f"Candidate {label}:"})
        images(urls)
    return parts


@dataclasses.dataclass
class GroupRequest:
    """A group request as the server reads it: prompt text, condition and reference frames and each label's frames
    (bytes, in the order sent)."""

    prompt: str
    reference: list[bytes]
    candidates: dict[str, list[bytes]]  # label -> JPEG / PNG bytes of its frames, presented order
    condition: list[bytes] = dataclasses.field(default_factory=list)
    examples: list[bytes] = dataclasses.field(default_factory=list)


def read_group_request(content: Sequence[dict]) -> GroupRequest:
    """Parse a user message's content parts laid out as in the module table (text before the first header is the
    instructions and is skipped).

    Raises:
        ValueError: an image before any header, a repeated label, no candidate, a candidate without frames, a
            part of an unknown type, or a bad image URL.
    """
    prompt, reference, condition, examples, candidates = "", [], [], [], {}
    current: list[bytes] | None = None
    for part in content:
        kind = part.get("type")
        if kind == "text":
            text = part.get("text", "")
            match = CANDIDATE_HEADER.match(text.strip())
            if text.startswith(PROMPT_PREFIX):
                prompt = text[len(PROMPT_PREFIX):]
            elif text.strip() == REFERENCE_HEADER:
                current = reference
            elif text.strip() == CONDITION_HEADER:
                current = condition
            elif text.strip() == EXAMPLES_HEADER:
                current = examples
            elif match:
                if match.group(1) in candidates:
                    raise ValueError(f"candidate label {match.group(1)!r} appears twice")
                current = candidates[match.group(1)] = []
        elif kind == "image_url":
            if current is None:
                raise ValueError("an image comes before any 'Condition:' / 'Examples:' / 'Reference:' / "
                                 "'Candidate X:' line")
            current.append(decode_data_url((part.get("image_url") or {}).get("url", "")))
        else:
            raise ValueError(f"unknown content part type {kind!r}; expected 'text' or 'image_url'")
    if not candidates:
        raise ValueError("no 'Candidate X:' line in the message")
    empty = [label for label, frames in candidates.items() if not frames]
    if empty:
        raise ValueError(f"candidates without images: {empty}")
    return GroupRequest(prompt=prompt, reference=reference, candidates=candidates, condition=condition,
                        examples=examples)


def _reject_constant(name: str) -> float:
    raise MalformedReply(f"non-finite number {name} is not a score")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise MalformedReply(f"duplicate keys in {keys}")
    return dict(pairs)


def parse_scores(text: str, labels: Sequence[str]) -> list[float]:
    """The scores of a judge reply, in ``labels`` order, each divided by 100 (so in ``[0, 1]``).

    Accepted: the whole reply (surrounding whitespace aside) is one JSON object whose keys are exactly ``labels``
    (no key missing, none extra, none repeated) and whose values are JSON numbers (not booleans) in ``[0, 100]``.

    Raises:
        MalformedReply: anything else: not JSON, trailing text, a code fence, not an object, wrong count, extra or
            duplicate keys, a non-number, NaN / Infinity, or a value outside ``[0, 100]``.
    """
    if not isinstance(text, str) or not text.strip():
        raise MalformedReply("empty reply")
    try:
        obj = json.loads(text.strip(), parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise MalformedReply(f"not a single JSON object ({exc.msg} at char {exc.pos})") from None
    if not isinstance(obj, dict):
        raise MalformedReply(f"the reply is a JSON {type(obj).__name__}, not an object")
    missing = [label for label in labels if label not in obj]
    extra = sorted(k for k in obj if k not in set(labels))
    if extra:
        raise MalformedReply(f"extra keys {extra}; only the labels {list(labels)} are allowed")
    if missing:
        raise MalformedReply(f"wrong count: expected {len(labels)} scores (labels {list(labels)}), got "
                             f"{len(obj)}; missing {missing}")
    scores = []
    for label in labels:
        value = obj[label]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MalformedReply(f"score of {label} is {value!r}, not a number")
        if not math.isfinite(value) or not 0 <= value <= SCORE_MAX:
            raise MalformedReply(f"score of {label} is {value!r}, outside [0, {SCORE_MAX:g}]")
        scores.append(float(value) / SCORE_MAX)
    return scores


def reply_text(body: str) -> str | None:
    """The assistant's text in a raw chat-completions HTTP body (``choices[0].message.content``), as the client
    read it when the answer came; None when the body holds none (no choices, a null content)."""
    choices = json.loads(body).get("choices") or [{}]
    return (choices[0].get("message") or {}).get("content")


def repair_message(reason: str, labels: Sequence[str]) -> str:
    """The short user message sent after a malformed reply."""
    return (f"Your reply was rejected: {reason}. Reply again with only one JSON object with exactly the keys "
            f"{', '.join(labels)}, each a number from 0 to {SCORE_MAX:g}, and nothing else.")


def scores_reply(scores: dict[str, float]) -> str:
    """The strict reply for ``label -> score in [0, 100]`` (what :func:`parse_scores` accepts)."""
    return json.dumps({label: float(value) for label, value in scores.items()}, allow_nan=False)


def chat_from_messages(messages: Sequence[dict]) -> tuple[list[dict], list[Any]]:
    """OpenAI chat messages (``text`` / ``image_url`` data-URL parts) -> the processor's chat format (``{"type":
    "image"}`` placeholders) and the PIL images in order.

    Raises:
        ValueError: an unknown part type, a non-data URL, or image bytes that do not decode.
    """
    from PIL import Image

    chat, images = [], []
    for message in messages:
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        converted = []
        for part in parts:
            if part.get("type") == "text":
                converted.append({"type": "text", "text": part.get("text", "")})
            elif part.get("type") == "image_url":
                data = decode_data_url((part.get("image_url") or {}).get("url", ""))
                try:
                    images.append(Image.open(io.BytesIO(data)).convert("RGB"))
                except OSError as exc:
                    raise ValueError(f"an image_url does not hold a readable image: {exc}") from None
                converted.append({"type": "image"})
            else:
                raise ValueError(f"unknown content part type {part.get('type')!r}")
        chat.append({"role": message.get("role", "user"), "content": converted})
    return chat, images


MAX_DECODE_PIXELS = 2**25
"""Pixels (``width * height * frames``) an image may decode to where no other budget is given: a judge reference or
condition image, and the judge / reward servers' default per-request budget (32 Mi pixels: 384 MiB as float32 RGB)."""


def header_pixels(source: Any) -> int:
    """``width * height * frames`` of an image file or file object, read from its header only (``PIL.Image.open`` is
    lazy). A header past Pillow's decompression-bomb limit (``Image.open`` refuses to open it, or warns) counts the
    pixels it claims, from Pillow's message (at least twice ``Image.MAX_IMAGE_PIXELS``), so a budget refuses it.

    Raises:
        PIL.UnidentifiedImageError / OSError: not an image Pillow recognises; FileNotFoundError.
    """
    from PIL import Image

    try:
        with Image.open(source) as image:
            width, height = image.size
            return width * height * max(1, int(getattr(image, "n_frames", 1) or 1))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # the warning: under -W error
        claimed = re.search(r"\((\d+) pixels\)", str(exc))
        return int(claimed.group(1)) if claimed else 2 * int(Image.MAX_IMAGE_PIXELS or 0) + 1


def decode_image_bytes(data: bytes, what: str = "image") -> Tensor:
    """Image bytes (JPEG / PNG / ...) -> ``[3, H, W]`` float32 RGB in [0, 1].

    Raises:
        ValueError: ``what`` is not a readable image.
    """
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"{what} is not a readable image: {exc}") from None
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def read_request_log(path: str | Path) -> list[dict[str, Any]]:
    """Every line of a judge server's request log (``flowforge serve judge --request-log``); a torn last line after
    a kill is skipped; ``[]`` when the file is missing."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def billed_per_group(records: list[dict[str, Any]]) -> dict[str, int]:
    """Group -> requests the server received for it (first sends, retries and repairs: every billed attempt), from
    :func:`read_request_log`'s records; requests that are not group requests count under their own key."""
    counts: dict[str, int] = {}
    for record in records:
        group = record.get("group") or record["key"]
        counts[group] = counts.get(group, 0) + 1
    return counts
