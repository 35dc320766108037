"""``unified_reward``: UnifiedReward's pointwise image-generation assessment through an OpenAI-compatible server.

UnifiedReward (Wang et al., "Unified Reward Model for Multimodal Understanding and Generation", arXiv:2503.05236;
hub ids ``CodeGoat24/UnifiedReward-qwen-7b`` (Qwen2.5-VL-7B), ``CodeGoat24/UnifiedReward-qwen-3b``,
``CodeGoat24/UnifiedReward-2.0-qwen-7b``, ...) is a Qwen2.5-VL fine-tuned to judge generated media. Its pointwise
image-generation prompt asks for the caption's key elements and a score from 1 to 5 after ``Final Score:``. Serve the
checkpoint with vLLM (``vllm serve CodeGoat24/UnifiedReward-qwen-7b --served-model-name UnifiedReward``, as the
repository's ``vllm_server.sh`` does) and point ``base_url`` at it.

Request (one per image): a user message whose content is the image, then the prompt text -- the order of the
official scripts. The text is :data:`TEMPLATE` with ``{prompt}`` replaced by the sample's prompt: verbatim the
f-string of ``inference_qwen/image_generation/qwen_point_score_image_generation.py`` in CodeGoat24/UnifiedReward
(commit ed52f98). The image is sent as the repository's vLLM client does
(``inference_qwen/UnifiedReward-2.0-inference/vllm_request.py``): RGB, JPEG quality 95, a
``data:image/jpeg;base64,`` URL; the tensor is first rounded to 8 bits (``round(255 x)``) and downscaled only when
its longest side exceeds ``max_side`` (the official script sends the file as it is; keep ``max_side`` at or above
the generated size to match it byte for byte -- tests/rewards/scorers/test_unified_reward.py compares the bytes).

Reply (:func:`parse_final_score`): exactly one ``Final Score: s`` with ``s`` a decimal number in ``[1, 5]``;
anything else is malformed (NaN, recorded, never re-sent). flow_grpo's reader (``flow_grpo/rewards.py``,
``unifiedreward_score_sglang``: ``re.search(r"Final Score:\\s*([1-5](?:\\.\\d+)?)")``, 0 when it finds none) would
read ``Final Score: 10`` as 1 and a missing score as 0; here neither becomes a reward. The reward is ``s / 5`` in
``[0.2, 1]``, flow_grpo's scale.

Billing, ledger and retries: :mod:`flowforge.rewards.scorers.vlm_pointwise` (the group judge's own ledger and
transport).
"""

from __future__ import annotations

import re
from typing import ClassVar

from flowforge.rewards.judge.protocol import MalformedReply
from flowforge.rewards.scorers.vlm_pointwise import PointwiseVLM

TEMPLATE = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the provided "
    "caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in the "
    "caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nExtract key elements from the provided text "
    "caption, evaluate their presence in the generated image using the format: 'element (type): value' (where "
    "value=0 means not generated, and value=1 means generated), and assign a score from 1 to 5 after "
    "'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]")
"""UnifiedReward's pointwise image-generation prompt (module docstring), ``{prompt}`` the caption."""

SCORE_RANGE = (1.0, 5.0)
_FINAL = re.compile(r"Final Score:")
_NUMBER = re.compile(r"\s*(?:\*\*)?\s*([+-]?\d+(?:\.\d+)?)")


def parse_final_score(text: str | None) -> float:
    """The ``s`` of the one ``Final Score: s`` in a reply, ``s`` a decimal number in ``[1, 5]`` (markdown bold
    around the number is allowed: ``Final Score: **4**``).

    Raises:
        MalformedReply: no reply, no or several ``Final Score:``, no number after it, or a number outside [1, 5].
    """
    if not text:
        raise MalformedReply("the reply is empty")
    found = _FINAL.findall(text)
    if len(found) != 1:
        raise MalformedReply(f"the reply must contain exactly one 'Final Score:', found {len(found)}")
    after = text[_FINAL.search(text).end():]
    match = _NUMBER.match(after)
    if match is None:
        raise MalformedReply(f"no number after 'Final Score:' ({after[:40]!r})")
    score = float(match.group(1))
    if not SCORE_RANGE[0] <= score <= SCORE_RANGE[1]:
        raise MalformedReply(f"Final Score {score:g} is outside [1, 5]")
    return score


class UnifiedReward(PointwiseVLM):
    """UnifiedReward pointwise scorer (module docstring): ``[B]`` float32 ``Final Score / 5`` in [0.2, 1], NaN
    without a score. Options: :class:`~flowforge.rewards.scorers.vlm_pointwise.PointwiseVLM` (``model`` is the
    served name, e.g. ``UnifiedReward``; ``max_tokens`` default 1024: the element list comes before the score)."""

    name: ClassVar[str] = "unified_reward"
    template: ClassVar[str] = TEMPLATE

    def parse(self, text: str | None, body: str, index: int) -> float:
        return parse_final_score(text) / SCORE_RANGE[1]
