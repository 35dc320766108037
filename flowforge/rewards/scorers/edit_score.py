"""``edit_score``: EditScore -- a reward for instruction-guided image editing from the source image, the instruction
and the edited image, through an OpenAI-compatible server.

EditScore (Luo et al., "EditScore: Unlocking Online RL for Image Editing via High-Fidelity Reward Modeling",
arXiv:2509.23909; code VectorSpaceLab/EditScore, ``pip install editscore``) is a Qwen2.5-VL-7B-Instruct LoRA (hub id
``EditScore/EditScore-7B``; also ``EditScore/EditScore-32B``, ``EditScore/EditScore-72B`` and the Qwen3-VL
``EditScore/EditScore-Qwen3-VL-4B-Instruct`` / ``-8B-Instruct``). Serve the base model with the LoRA merged (or vLLM's
``--enable-lora --lora-modules``) and point ``base_url`` at it.

Per sample, as ``editscore/__init__.py`` (``EditScore.evaluate``, commit 6e0f1b9) does, two requests:

=========  ====================================  =====================================================================
request    images (in order)                     text
=========  ====================================  =====================================================================
SC         source image, edited image            :data:`CONTEXT`, :data:`TWO_IMAGE_RULE`, :data:`SC_RULE` joined by
                                                 newlines, ``<instruction>`` replaced by the prompt
PQ         edited image                          :data:`CONTEXT`, :data:`PQ_RULE` joined by a newline
=========  ====================================  =====================================================================

with every ``10`` of the rules replaced by ``score_range`` (default 25, the released models'), as the official code
does. The prompt pieces are verbatim ``editscore/vie_prompts.py``. Token layout: the official vLLM path writes the
prompt as ``<img1>: <|vision_start|><|image_pad|><|vision_end|><img2>: ...<text>`` after Qwen's default system
message (``editscore/mllm_tools/qwen25vl_vllm.py``, ``apply_chat_template``); here the user message is the parts
``"<img1>: "``, image, ``"<img2>: "``, image, text, which Qwen2.5-VL's chat template on the server renders to the
same tokens (tests/rewards/scorers/test_edit_score.py renders the parts and compares). Sampling: the official
``temperature=0.7, top_p=0.9, top_k=20, seed=42, max_tokens=512`` are the defaults (``top_k`` is a vLLM field;
``top_k: null`` leaves it out for servers that refuse it).

Reply (:func:`parse_edit_reply`): exactly one JSON object ``{"reasoning": str, "score": [a, b]}`` (a markdown code
fence around it allowed), both scores numbers in ``[0, score_range]``; anything else is malformed (NaN, recorded,
never re-sent). The official parser (``editscore/json_parser.py``) repairs broken JSON, falls back to any numbers in
the text and, in ``batch_evaluate``, to ``score_range / 2`` for a reply without scores; none of that becomes a
reward here. Scores, as the official code computes them::

    SC = min(a_SC, b_SC) * 10 / score_range      PQ = min(a_PQ, b_PQ) * 10 / score_range      r = sqrt(SC * PQ)

``r`` (EditScore's "overall", on ``[0, 10]``) is the reward. The official ``num_pass > 1`` (the mean of several
sampled passes) is not offered: one pass, the official default.

The source image: the sample's condition image, ``metadata["image"]`` (or the one entry of ``metadata["images"]``),
the path an image-editing prompt file names (:func:`flowforge.data.prompts.condition_images`; relative paths under
``reference_root``), read once per path. It is sent like the edited image: 8-bit, PNG by default (the official
offline path hands vLLM the decoded images; PNG carries those pixels exactly -- max abs diff 0 in the test; JPEG,
``image_format: jpeg``, is smaller and lossy), the longest side at most ``max_side``. Billing, ledger and retries:
:mod:`flowforge.rewards.scorers.vlm_pointwise`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, ClassVar

from torch import Tensor

from flowforge.rewards.judge.protocol import MalformedReply
from flowforge.rewards.scorers.vlm_pointwise import PointwiseVLM

CONTEXT = (
    'You are a professional digital artist. You will have to evaluate the effectiveness '
    'of the AI-generated image(s) based on given rules.\n'
    'All the input images are AI-generated. All human in the images are AI-generated '
    'too. so you need not worry about the privacy confidentials.\n'
    '\n'
    'IMPORTANT: You will have to give your output in this way (Keep your reasoning concise '
    'and short.):\n'
    '{\n'
    '"reasoning" : "...",\n'
    '"score" : [...]\n'
    '}\n'
)
TWO_IMAGE_RULE = (
    'RULES:\n'
    '\n'
    'Two images will be provided: The first being the original AI-generated image and '
    'the second being an edited version of the first.\n'
    'The objective is to evaluate how successfully the editing instruction has been executed '
    'in the second image.\n'
    '\n'
    'Note that sometimes the two images might look identical due to the failure of image '
    'edit.\n'
)
SC_RULE = (
    '\n'
    'From scale 0 to 10: \n'
    'A score from 0 to 10 will be given based on the success of the editing. (0 indicates '
    'that the scene in the edited image does not follow the editing instruction at all. '
    '10 indicates that the scene in the edited image follow the editing instruction text '
    'perfectly.)\n'
    'A second score from 0 to 10 will rate the degree of overediting in the second image. '
    '(0 indicates that the scene in the edited image is completely different from the '
    'original. 10 indicates that the edited image can be recognized as a minimal edited '
    'yet effective version of original.)\n'
    "Put the score in a list such that output score = [score1, score2], where 'score1' "
    "evaluates the editing success and 'score2' evaluates the degree of overediting.\n"
    '\n'
    'Editing instruction: <instruction>\n'
)
PQ_RULE = (
    'RULES:\n'
    '\n'
    'The image is an AI-generated image.\n'
    'The objective is to evaluate how successfully the image has been generated.\n'
    '\n'
    'From scale 0 to 10: \n'
    'A score from 0 to 10 will be given based on image naturalness. \n'
    '(\n'
    '    0 indicates that the scene in the image does not look natural at all or give '
    'a unnatural feeling such as wrong sense of distance, or wrong shadow, or wrong lighting. '
    '\n'
    '    10 indicates that the image looks natural.\n'
    ')\n'
    'A second score from 0 to 10 will rate the image artifacts. \n'
    '(\n'
    '    0 indicates that the image contains a large portion of distortion, or watermark, '
    'or scratches, or blurred faces, or unusual body parts, or subjects not harmonized. '
    '\n'
    '    10 indicates the image has no artifacts.\n'
    ')\n'
    'Put the score in a list such that output score = [naturalness, artifacts]\n'
)
"""The pieces of EditScore's prompts, verbatim ``editscore/vie_prompts.py`` (``_context_no_delimit_reasoning_first``,
``_prompts_0shot_two_image_edit_rule``, ``_prompts_0shot_tie_rule_SC``, ``_prompts_0shot_rule_PQ``)."""

_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def edit_prompts(instruction: str, score_range: int = 25) -> tuple[str, str]:
    """The SC and PQ texts of one sample (module docstring), ``instruction`` the editing instruction."""
    scale = str(score_range)
    sc = "\n".join([CONTEXT, TWO_IMAGE_RULE, SC_RULE.replace("10", scale)]).replace("<instruction>", instruction)
    return sc, "\n".join([CONTEXT, PQ_RULE.replace("10", scale)])


def parse_edit_reply(text: str | None, score_range: int = 25) -> list[float]:
    """The two scores of a reply that is exactly one JSON object ``{"reasoning": str, "score": [a, b]}`` (optionally
    in a markdown code fence), ``a``, ``b`` numbers in ``[0, score_range]``.

    Raises:
        MalformedReply: anything else (the message says what).
    """
    if not text or not text.strip():
        raise MalformedReply("the reply is empty")
    body = text.strip()
    fenced = _FENCE.match(body)
    try:
        data = json.loads(fenced.group(1) if fenced else body)
    except json.JSONDecodeError as exc:
        raise MalformedReply(f"the reply is not one JSON object: {exc}") from None
    if not isinstance(data, dict) or set(data) != {"reasoning", "score"} or not isinstance(data["reasoning"], str):
        raise MalformedReply("the reply must be an object with exactly the keys 'reasoning' (a string) and 'score'")
    scores = data["score"]
    if (not isinstance(scores, list) or len(scores) != 2
            or any(isinstance(s, bool) or not isinstance(s, (int, float)) for s in scores)):
        raise MalformedReply(f"'score' must be a list of two numbers, got {scores!r}")
    if any(not 0 <= s <= score_range for s in scores):
        raise MalformedReply(f"'score' {scores} is outside [0, {score_range}]")
    return [float(s) for s in scores]


class EditScore(PointwiseVLM):
    """EditScore (module docstring): ``[B]`` float32 ``sqrt(SC * PQ)`` on ``[0, 10]``, NaN without a score.

    Args:
        score_range: the scale the model was trained on (25 for the released models), >= 1.
        top_p: sent with each request. top_k: sent with each request (a vLLM field); None leaves it out.
        reference_root: directory relative source-image paths are read from (default: the working directory).
        temperature, seed, max_tokens: as :class:`~flowforge.rewards.scorers.vlm_pointwise.PointwiseVLM`, with the
            official defaults 0.7, 42, 512. image_format: ``png`` by default (lossless, as the official code hands
            the model the decoded images).
        **options: the other :class:`~flowforge.rewards.scorers.vlm_pointwise.PointwiseVLM` options (``model``,
            ``base_url``, ``api_key_env``, ``retry_on``, ``max_billed``, ...).

    Raises:
        ValueError: a bad option. When called: a sample without exactly one source image (``metadata.image``).
    """

    name: ClassVar[str] = "edit_score"
    template: ClassVar[str] = "\n".join([CONTEXT, TWO_IMAGE_RULE, SC_RULE, PQ_RULE])
    metadata_keys: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, *, score_range: int = 25, top_p: float = 0.9, top_k: int | None = 20,
                 reference_root: str | Path | None = None, temperature: float = 0.7, seed: int = 42,
                 max_tokens: int = 512, image_format: str = "png", **options: Any) -> None:
        if isinstance(score_range, bool) or not isinstance(score_range, int) or score_range < 1:
            raise ValueError(f"edit_score option score_range must be an int >= 1, got {score_range!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"edit_score option top_p must be in (0, 1], got {top_p!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"edit_score option top_k must be an int >= 1 or null, got {top_k!r}")
        self.score_range, self.top_p, self.top_k = score_range, float(top_p), top_k
        self.reference_root = Path(reference_root) if reference_root is not None else None
        self._sources: dict[str, Tensor] = {}
        super().__init__(temperature=temperature, seed=seed, max_tokens=max_tokens, image_format=image_format,
                         **options)

    def extra_body(self) -> dict[str, Any]:
        return {"top_p": self.top_p, **({"top_k": self.top_k} if self.top_k is not None else {})}

    def source(self, metadata: dict[str, Any]) -> Tensor:
        """The sample's source image ``[3, H, W]`` float32 in [0, 1] (module docstring), cached per path.

        Raises:
            ValueError: no or several source images, or an unreadable one.
        """
        from flowforge.data.prompts import condition_images
        from flowforge.rewards.judge.reference import load_reference

        paths = condition_images(metadata)
        if len(paths) != 1:
            raise ValueError(f"edit_score needs the source image of each edit in metadata.image (one path), got "
                             f"{len(paths)} images for sample {metadata.get('sample_id')!r}")
        path = Path(paths[0])
        if not path.is_absolute() and self.reference_root is not None:
            path = self.reference_root / path
        if str(path) not in self._sources:
            image = load_reference(path)
            if image.dim() != 3:
                raise ValueError(f"edit_score: the source {str(path)!r} must be one image, got a frame directory")
            self._sources[str(path)] = image
        return self._sources[str(path)]

    def requests(self, image: Tensor, prompt: str, metadata: dict[str, Any]) -> list[tuple[list[Tensor], str]]:
        sc, pq = edit_prompts(prompt, self.score_range)
        return [([self.source(metadata), image], sc), ([image], pq)]

    def content(self, urls: list[str], text: str) -> list[dict]:
        parts: list[dict] = []
        for n, url in enumerate(urls, start=1):  # "<imgN>: " before each image, as the official prompt writes it
            parts += [{"type": "text", "text": f"<img{n}>: "}, {"type": "image_url", "image_url": {"url": url}}]
        return [*parts, {"type": "text", "text": text}]

    def parse(self, text: str | None, body: str, index: int) -> float:
        return min(parse_edit_reply(text, self.score_range)) * 10 / self.score_range

    def combine(self, scores: list[float]) -> float:
        sc, pq = scores
        return math.sqrt(sc * pq)
