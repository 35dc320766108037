"""What answers a chat completion in ``flowforge serve judge``: a local Hugging Face vision-language model, or any
flowforge reward scorer wrapped as a group judge.

A backend is an object with ``model_id: str`` and ``complete(messages, *, max_tokens, temperature, seed) ->
Completion`` (a backend that can give token log-probabilities also takes ``top_logprobs: int``, asked for only when a
request sets ``logprobs: true``, and fills :attr:`Completion.logprobs`); ``messages`` are OpenAI chat messages as
plain dicts (``content`` a string or a list of ``text`` / ``image_url`` parts with base64 ``data:image/...`` URLs). A
backend raises ``ValueError`` for a request it cannot serve (the server answers 422 with the message) and
:class:`BackendError` to answer with a chosen HTTP status.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flowforge.rewards.base import RewardScorer, takes_latents, takes_video
from flowforge.rewards.judge import protocol as P
from flowforge.runtime.errors import UserError


@dataclasses.dataclass(frozen=True)
class Completion:
    """One answer: the reply text and the token counts reported as ``usage``; ``logprobs``: the choice's OpenAI
    ``logprobs`` object (``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``, one entry per
    generated token) when the request asked for it."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: dict | None = None


class BackendError(Exception):
    """Answer the request with HTTP ``status_code`` and ``message`` (never a reply)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


def decode_image(data: bytes) -> Tensor:
    """An image_url's bytes -> ``[3, H, W]`` float32 in [0, 1] (:func:`P.decode_image_bytes`).

    Raises:
        ValueError: not a readable image.
    """
    return P.decode_image_bytes(data, "an image_url")


def first_user_content(messages: Sequence[dict]) -> list[dict]:
    """The content parts of the first user message (a string becomes one text part).

    Raises:
        ValueError: no user message.
    """
    for message in messages:
        if message.get("role") == "user":
            content = message.get("content")
            return [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    raise ValueError("the request has no user message")


JUDGE_METADATA = ("label", "reference_media", "condition_media", "example_media")
"""The metadata entries :class:`ScorerBackend` gives a scorer (read from the message); a scorer's other needs come
from the prompt text (e.g. the digit reward's digit, the action scorers' actions, OCR's quoted text)."""


class ScorerBackend:
    """A flowforge scorer as a group judge: reads the group layout of :mod:`flowforge.rewards.judge.protocol`,
    scores every candidate, and replies with the strict JSON ``{label: score}`` the judge client parses.

    A scorer that takes video (``takes_video``) gets each candidate whole, its frames in the order received
    (``[n, 3, F, H, W]``, one call per frame size); any other scores every frame and a candidate's score is the mean
    over its frames, as the trainer does. The scorer's score ``s`` maps to ``100 (s - low) / (high - low)`` clamped
    to ``[0, 100]``. Each candidate's metadata carries ``label`` and, when the request has them, ``reference_media``
    (``[3, H, W]``, or ``[3, F, H, W]`` for several frames of one size), ``condition_media`` (``[3, H, W]``) and
    ``example_media`` (a list of ``[3, H, W]``: the static example images) for scorers that compare against them. Usage
    reports the number of images as ``prompt_tokens`` and the number of
    scores as ``completion_tokens``.

    Raises:
        UserError: (at construction) the scorer lists ``metadata_keys`` outside :data:`JUDGE_METADATA`: nothing in
            a judge request can give them; the scorer takes latents (``takes_latents``): a request carries frames.

    Raises (``complete``):
        ValueError: a request outside the layout; the scorer rejects the input; a NaN score ("not applicable" has
            no strict-JSON answer).
    """

    def __init__(self, scorer: RewardScorer, model_id: str, score_range: tuple[float, float] = (0.0, 1.0)) -> None:
        if takes_latents(scorer):
            raise UserError(f"scorer {getattr(scorer, 'name', model_id)!r}", "takes latents (takes_latents), which a "
                            "judge request does not carry (frames only)", "score it in the training process")
        lacking = [k for k in getattr(scorer, "metadata_keys", ()) if k not in JUDGE_METADATA]
        if lacking:
            raise UserError(f"scorer {getattr(scorer, 'name', model_id)!r}", f"needs metadata {lacking}, which a "
                            "judge request does not carry (the prompt and the frames only: docs/judge_server.md)",
                            "serve it with `flowforge serve reward`, whose requests carry each row's metadata")
        low, high = score_range
        if not (math.isfinite(low) and math.isfinite(high) and high > low):
            raise ValueError(f"score_range must be two finite numbers low < high, got {score_range}")
        self.scorer, self.model_id, self.low, self.high = scorer, model_id, float(low), float(high)
        self._lock = threading.Lock()

    def _call(self, items: list[tuple[str, Tensor]], prompt: str, extra: dict[str, Any]) -> Tensor:
        """Scores ``[n]`` of ``(label, media)`` items, one scorer call per media shape."""
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, (_, media) in enumerate(items):
            by_shape.setdefault(tuple(media.shape), []).append(i)
        values = torch.empty(len(items), dtype=torch.float32)
        with self._lock, torch.no_grad():
            for rows in by_shape.values():
                out = self.scorer(torch.stack([items[i][1] for i in rows]), [prompt] * len(rows),
                                  [{"label": items[i][0], **extra} for i in rows])
                values[rows] = out.detach().float().cpu().view(-1)
        return values

    def scores(self, messages: Sequence[dict]) -> dict[str, float]:
        """``label -> score in [0, 100]`` for the group in ``messages``."""
        group = P.read_group_request(first_user_content(messages))
        reference = [decode_image(b) for b in group.reference]
        extra: dict[str, Any] = {}
        if reference:
            same = all(r.shape == reference[0].shape for r in reference)
            extra["reference_media"] = torch.stack(reference, 1) if same and len(reference) > 1 else reference[0]
        if group.condition:
            extra["condition_media"] = decode_image(group.condition[0])
        if group.examples:  # static example images, each [3, H, W] in [0, 1]
            extra["example_media"] = [decode_image(b) for b in group.examples]
        frames = {label: [decode_image(b) for b in data] for label, data in group.candidates.items()}
        if takes_video(self.scorer) and all(len({f.shape for f in fs}) == 1 for fs in frames.values()):
            videos = [(label, torch.stack(fs, 1)) for label, fs in frames.items()]  # [3, F, H, W] each
            values = self._call(videos, group.prompt, extra)
            means = {label: values[i].item() for i, (label, _) in enumerate(videos)}
        else:
            items = [(label, f) for label, fs in frames.items() for f in fs]
            values = self._call(items, group.prompt, extra)
            means = {label: values[[i for i, (lab, _) in enumerate(items) if lab == label]].mean().item()
                     for label in frames}
        result = {}
        for label, mean in means.items():
            if math.isnan(mean):
                raise ValueError(f"the scorer gave candidate {label} no score (NaN: not applicable)")
            result[label] = min(max(100.0 * (mean - self.low) / (self.high - self.low), 0.0), 100.0)
        return result

    def complete(self, messages: Sequence[dict], *, max_tokens: int | None = None, temperature: float = 0.0,
                 seed: int | None = None) -> Completion:
        scores = self.scores(messages)
        images = sum(p.get("type") == "image_url" for p in first_user_content(messages))
        return Completion(text=P.scores_reply(scores), prompt_tokens=int(images), completion_tokens=len(scores))


class HFVisionLanguageBackend:
    """A local Hugging Face image-text-to-text model (``AutoModelForImageTextToText`` + its processor's chat
    template) answering chat completions with ``generate``: greedy at temperature 0, sampled otherwise (seeded by
    the request's ``seed``). Usage counts the prompt's input ids and the generated ids.

    Args:
        path: model directory. device: torch device. dtype: ``float32`` / ``bfloat16`` / ``float16``.
        max_new_tokens: cap on the request's ``max_tokens``.
    """

    def __init__(self, path: str | Path, *, device: str = "cpu", dtype: str = "float32", max_new_tokens: int = 1024,
                 model_id: str | None = None) -> None:
        from transformers import AutoModelForImageTextToText

        from flowforge.rewards.vl_processor import load_vl_processor
        from flowforge.runtime.dtypes import DTYPES as dtypes
        if dtype not in dtypes:
            raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
        self.model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtypes[dtype]).to(device).eval()
        self.processor = load_vl_processor(path)
        self.device, self.max_new_tokens = torch.device(device), max_new_tokens
        self.model_id = model_id or Path(path).name
        self._lock = threading.Lock()

    def _chat(self, messages: Sequence[dict]) -> tuple[list[dict], list[Any]]:
        """OpenAI messages -> the processor's chat format and the PIL images (:func:`P.chat_from_messages`)."""
        return P.chat_from_messages(messages)

    def complete(self, messages: Sequence[dict], *, max_tokens: int | None = None, temperature: float = 0.0,
                 seed: int | None = None, top_logprobs: int | None = None) -> Completion:
        """Answer ``messages``; with ``top_logprobs`` (0..20) also each generated token's log-probability and the
        ``top_logprobs`` most likely tokens at its place, from the model's raw logits (``log_softmax`` in fp32,
        before any sampling processor -- what vLLM returns by default)."""
        chat, images = self._chat(messages)
        text = self.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=[text], images=images or None, return_tensors="pt").to(self.device)
        budget = min(max_tokens or self.max_new_tokens, self.max_new_tokens)
        sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
        with self._lock, torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(**inputs, max_new_tokens=budget, return_dict_in_generate=True,
                                      output_logits=top_logprobs is not None, **sampling)
        prompt_len = inputs["input_ids"].shape[1]
        new = out.sequences[0, prompt_len:]
        reply = self.processor.batch_decode(new[None], skip_special_tokens=True)[0]
        logprobs = None if top_logprobs is None else self._logprobs(new, out.logits, top_logprobs)
        return Completion(text=reply, prompt_tokens=int(prompt_len), completion_tokens=int(new.numel()),
                          logprobs=logprobs)

    def _logprobs(self, new: Tensor, logits: Sequence[Tensor], top: int) -> dict:
        decode = self.processor.tokenizer.decode

        def entry(token_id: int, row: Tensor) -> dict:
            token = decode([token_id])
            return {"token": token, "logprob": float(row[token_id]), "bytes": list(token.encode())}

        content = []
        for token_id, step in zip(new.tolist(), logits, strict=False):
            row = torch.log_softmax(step[0].float(), dim=-1)
            best = torch.topk(row, top).indices.tolist() if top else []
            content.append({**entry(token_id, row), "top_logprobs": [entry(i, row) for i in best]})
        return {"content": content}


class StudentBackend:
    """A saved ``vlm_json`` student reward model (:mod:`flowforge.reward_model.vlm_json`) answering chat
    completions with its own generation (greedy at temperature 0, stopped at its end of turn); usage counts the
    prompt's tokens and the generated ones."""

    def __init__(self, student: Any, model_id: str) -> None:
        self.student, self.model_id = student, model_id
        self._lock = threading.Lock()

    def complete(self, messages: Sequence[dict], *, max_tokens: int | None = None, temperature: float = 0.0,
                 seed: int | None = None) -> Completion:
        with self._lock:
            text, prompt_tokens, new_tokens = self.student.reply(messages, max_new_tokens=max_tokens,
                                                                 temperature=temperature, seed=seed)
        return Completion(text=text, prompt_tokens=prompt_tokens, completion_tokens=new_tokens)


def student_backend(path: str | Path, *, device: str = "cpu", model_id: str | None = None) -> Any:
    """The backend of ``serve judge --student PATH``, a saved student reward model (:mod:`flowforge.reward_model`):
    ``vlm_json`` answers with its own generation (:class:`StudentBackend`); ``scalar_head`` is a scorer wrapped as a
    group judge (:class:`ScorerBackend`, its scores on [0, 1]). The model id defaults to the directory name.

    Raises:
        ValueError: ``path`` is not a saved student.
    """
    from flowforge.reward_model.students import load_student, student_kind

    name = model_id or Path(path).resolve().name
    if student_kind(path) == "scalar_head":
        from flowforge.reward_model.scalar_head import ScalarHeadScorer

        return ScorerBackend(ScalarHeadScorer(path, device=device), name)
    return StudentBackend(load_student(path, device=device), name)
