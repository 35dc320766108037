"""``vqa_score``: VQAScore -- the probability a vision-language model answers "Yes" to a question about the image.

    r = P(answer | image, question(prompt)) = softmax(z)[id(answer)]     z: the next-token logits after the question

Source: Lin et al., "Evaluating Text-to-Visual Generation with Image-to-Text Generation" (VQAScore), ECCV 2024,
arXiv:2404.01291, and its code, linzhiqiu/t2v_metrics: the question ``Does this figure show "{prompt}"? Please
answer yes or no.`` and the answer ``Yes`` (``t2v_metrics/models/vqascore_models/clip_t5_model.py``'s defaults);
GenEval 2 / VQAScore-style rewards ask it of a generated image. For Qwen2-VL / Qwen2.5-VL
(``t2v_metrics/models/vqascore_models/qwen2vl_model.py``; hub ids ``Qwen/Qwen2.5-VL-7B-Instruct``,
``Qwen/Qwen2-VL-7B-Instruct``, ...): one user message holding the image then the question, the chat template with
the generation prompt, and ``P(Yes) = softmax(scores[0])[tokenizer.encode(answer)[0]]`` of a one-token greedy
``generate``. Here the same probability is read from one forward pass's last logits (fp32 ``softmax``): equal to
t2v_metrics' whenever the model's generation config adds no logits processor (a repetition penalty would change
theirs, not the model's distribution); tests/rewards/scorers/test_vqa_score.py compares the two on a tiny random
Qwen2-VL (max abs diff stated there). The image is the tensor rounded to 8 bits (``round(255 x)``) as a PIL RGB
image, resized by the model's own processor (t2v_metrics' ``qwen_vl_utils.process_vision_info`` resizes to the same
``smart_resize`` size first; the processor's resize of an already-fitting image is then the identity).

Two ways to run it (one registered name; :class:`VQAScore` picks by the options):

* ``path``: a local checkpoint directory (``AutoModelForImageTextToText`` and its processor), on ``device``;
* ``base_url`` + ``model``: any OpenAI-compatible server that returns token log-probabilities (vLLM,
  ``flowforge serve judge --model``): the request asks ``max_tokens: 1, logprobs: true, top_logprobs: k`` and
  ``r = exp(logprob)`` of the listed alternative whose token is exactly ``answer`` (t2v_metrics' token), or else of
  the likeliest one equal to it up to surrounding spaces (e.g. ``" Yes"``). An answer
  not among the ``k`` listed is malformed (NaN, recorded, never re-sent): its probability is only bounded, never
  guessed. Billing, ledger and retries: :mod:`flowforge.rewards.scorers.vlm_pointwise`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowforge.rewards.base import check_inputs
from flowforge.rewards.judge.protocol import MalformedReply
from flowforge.rewards.scorers.vlm_pointwise import PointwiseVLM

QUESTION = 'Does this figure show "{}"? Please answer yes or no.'
"""VQAScore's question template (t2v_metrics), ``{}`` the prompt."""
ANSWER = "Yes"


def _check_template(question_template: str) -> str:
    if not isinstance(question_template, str) or question_template.count("{}") != 1:
        raise ValueError(f"vqa_score option question_template must hold '{{}}' (the prompt) once, got "
                         f"{question_template!r}")
    return question_template


class LocalVQAScore:
    """VQAScore from a local vision-language checkpoint (module docstring): ``[B]`` float32 ``P(answer)`` in [0, 1].

    Args:
        path: model directory (``AutoModelForImageTextToText``; its processor beside it).
        question_template: the question, ``{}`` the prompt. answer: the answer whose first token is scored.
        device: torch device. dtype: ``float32`` / ``bfloat16`` / ``float16`` (the softmax is fp32 either way).

    Raises:
        ValueError: a bad option; ``answer`` is the tokenizer's unknown token (the model cannot say it).
    """

    name: ClassVar[str] = "vqa_score"
    needs_group: ClassVar[bool] = False

    def __init__(self, *, path: str, question_template: str = QUESTION, answer: str = ANSWER, device: str = "cpu",
                 dtype: str = "float32") -> None:
        from transformers import AutoModelForImageTextToText

        from flowforge.rewards.vl_processor import load_vl_processor
        from flowforge.runtime.dtypes import DTYPES

        if dtype not in DTYPES:
            raise ValueError(f"vqa_score option dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.question = _check_template(question_template)
        self.model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=DTYPES[dtype]).to(device).eval()
        self.processor = load_vl_processor(path)
        tokenizer = self.processor.tokenizer
        ids = tokenizer.encode(answer, add_special_tokens=False)
        if not ids or ids[0] == tokenizer.unk_token_id:
            raise ValueError(f"vqa_score option answer {answer!r} is not in the vocabulary of {str(path)!r}")
        self.answer_id, self.device = ids[0], torch.device(device)

    def inputs(self, image: Tensor, prompt: str) -> Any:
        """The processor's inputs for one ``[3, H, W]`` image in [0, 1] and its prompt (t2v_metrics' layout)."""
        from PIL import Image

        from flowforge.media import to_uint8

        pil = Image.fromarray(to_uint8(image).permute(1, 2, 0).cpu().numpy(), mode="RGB")
        chat = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": self.question.format(prompt)}]}]
        text = self.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return self.processor(text=[text], images=[pil], return_tensors="pt").to(self.device)

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media`` ``[B, 3, H, W]`` float in [0, 1] -> ``[B]`` float32 ``P(answer)``, one forward per image."""
        check_inputs(media, prompts, metadata)
        out = []
        for image, prompt in zip(media, prompts, strict=True):
            logits = self.model(**self.inputs(image, prompt)).logits[0, -1].float()
            out.append(torch.softmax(logits, dim=-1)[self.answer_id])
        return torch.stack(out).to(torch.float32).to(media.device) if out else torch.zeros(0, device=media.device)


class ServerVQAScore(PointwiseVLM):
    """VQAScore through an OpenAI-compatible server's ``top_logprobs`` (module docstring): ``[B]`` float32 in [0, 1],
    NaN without a score. Options: :class:`~flowforge.rewards.scorers.vlm_pointwise.PointwiseVLM` (``max_tokens``
    is 1; ``image_format`` png: the pixels the local path sees) plus ``question_template``, ``answer`` and
    ``top_logprobs`` (1..20, default 20)."""

    name: ClassVar[str] = "vqa_score"
    template: ClassVar[str] = QUESTION

    def __init__(self, *, question_template: str = QUESTION, answer: str = ANSWER, top_logprobs: int = 20,
                 image_format: str = "png", **options: Any) -> None:
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 1 <= top_logprobs <= 20:
            raise ValueError(f"vqa_score option top_logprobs must be an int in 1..20, got {top_logprobs!r}")
        if not isinstance(answer, str) or not answer.strip():
            raise ValueError(f"vqa_score option answer must be a non-empty string, got {answer!r}")
        self.question, self.answer, self.top_logprobs = _check_template(question_template), answer, top_logprobs
        self.template = self.question  # the request key covers the question actually asked
        super().__init__(**{"max_tokens": 1, **options}, image_format=image_format)

    def extra_body(self) -> dict[str, Any]:
        return {"logprobs": True, "top_logprobs": self.top_logprobs}

    def requests(self, image: Tensor, prompt: str, metadata: dict[str, Any]) -> list[tuple[list[Tensor], str]]:
        return [([image], self.question.format(prompt))]

    def parse(self, text: str | None, body: str, index: int) -> float:
        try:
            first = json.loads(body)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            listed = [(str(e["token"]), float(e["logprob"])) for e in first]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise MalformedReply(f"the answer has no top_logprobs for its first token ({type(exc).__name__}: "
                                 f"{exc}); the server must support logprobs") from None
        # t2v_metrics scores exactly the token ``answer``; "Yes" and " Yes" are different tokens of different
        # probability, so a spaced variant counts only when the exact token is not listed (then the likeliest one)
        exact = [lp for token, lp in listed if token == self.answer]
        variants = [lp for token, lp in listed if token.strip() == self.answer.strip()]
        if not variants:
            raise MalformedReply(f"{self.answer!r} is not among the {len(listed)} top_logprobs of the first token")
        logprob = exact[0] if exact else max(variants)
        if not math.isfinite(logprob) or logprob > 0:
            raise MalformedReply(f"the log-probability of {self.answer!r} is {logprob!r}, not a log-probability")
        return math.exp(logprob)


class VQAScore:
    """The registered ``vqa_score`` factory: :class:`LocalVQAScore` with option ``path``, :class:`ServerVQAScore`
    with ``base_url`` (and ``model``); ``VQAScore(**options)`` returns an instance of the chosen one, whose signature
    the registry checks the options against (:meth:`choose`).

    Raises:
        ValueError: both or neither of ``path`` and ``base_url``.
        TypeError: an option the chosen one does not take.
    """

    name: ClassVar[str] = "vqa_score"
    needs_group: ClassVar[bool] = False

    @staticmethod
    def choose(options: dict[str, Any]) -> type[LocalVQAScore] | type[ServerVQAScore]:
        """The class that ``options`` build.

        Raises:
            ValueError: both or neither of ``path`` and ``base_url``.
        """
        if ("path" in options) == ("base_url" in options):
            raise ValueError("vqa_score needs exactly one of the options path (a local model directory) and base_url "
                             "(an OpenAI-compatible server that returns logprobs)")
        return LocalVQAScore if "path" in options else ServerVQAScore

    def __new__(cls, **options: Any) -> LocalVQAScore | ServerVQAScore:  # type: ignore[misc]
        return cls.choose(options)(**options)
