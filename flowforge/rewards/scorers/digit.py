"""Digit reward of the embedded default: how sure the reward classifier is that the image shows the prompted digit.

``r_i = softmax(RewardNet(x_i))[d_i]`` with ``d_i = metadata[i]["digit"]`` (a row without one: the digit its prompt
names, :func:`flowforge.demo.prompts.prompt_digit`), a probability in [0, 1]. ``RewardNet`` is
trained on the demo's ``"reward"`` split only (:mod:`flowforge.demo.classifiers`); evaluation uses the independent
``EvalNet`` (DigitEval), so a policy that learns to fool ``RewardNet`` is caught by evaluation. ``RewardNet`` was
trained with label smoothing and outlier exposure: a clean real digit scores about 0.95 (not 1.0) and pure noise
about 0.1 for any digit.

``cap`` (option, default none) makes the reward satisficing: ``r_i = min(p_i, cap)``. Past the cap a sample earns
nothing more, so a group whose candidates all clear it has no advantage left to push them towards the classifier's
favourite prototype, while the candidates below it are still pulled up. On the real ``eval_clf`` digits the
reward's quantiles are 0.73 / 0.86 / 0.96 / 0.98 (5 / 10 / 25 / 50 %); ``cap: 0.8`` is cleared by 93.5 % of real
digits, and 99.7 % of those are read correctly by DigitEval's classifier.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flowforge.rewards.base import check_batch_size, check_inputs


def requested_digits(metadata: Sequence[dict[str, Any]], prompts: Sequence[str] | None = None) -> Tensor:
    """``[B]`` int64 digits: ``metadata[i]["digit"]``, else (no such key) the one digit ``prompts[i]`` names
    (:func:`flowforge.demo.prompts.prompt_digit`), as for a plain-text prompt file or a judge request, which carry
    the prompt only.

    Raises:
        ValueError: a ``"digit"`` that is not an int in 0..9; an entry without one whose prompt names no digit or
            several (the message names the sample index).
    """
    digits = []
    for index, entry in enumerate(metadata):
        if not isinstance(entry, dict) or "digit" not in entry:
            if prompts is None:
                raise ValueError(f"metadata[{index}] has no 'digit' key; the digit reward needs metadata['digit'] "
                                 "in 0..9 or a prompt naming the digit")
            from flowforge.demo.prompts import prompt_digit

            try:
                digits.append(prompt_digit(prompts[index]))
            except ValueError as exc:
                raise ValueError(f"sample {index}: metadata has no 'digit' key and {exc}") from None
            continue
        digit = entry["digit"]
        if isinstance(digit, bool) or not isinstance(digit, int) or not 0 <= digit <= 9:
            raise ValueError(f"metadata[{index}]['digit'] must be an int in 0..9, got {digit!r}")
        digits.append(digit)
    return torch.tensor(digits, dtype=torch.int64)


class DigitScorer:
    """Reward = the reward classifier's softmax probability of the requested digit (``metadata["digit"]``).

    Args:
        model: a classifier mapping ``[B, 3, H, W]`` in [0, 1] to logits ``[B, 10]``; defaults to the packaged
            ``RewardNet`` (:func:`flowforge.demo.classifiers.load_reward_classifier`).
        batch_size: images per classifier forward, >= 1.

    The model is copied to each device it is asked to score on (kept, not moved back and forth); it is never trained.
    """

    name = "digit"
    needs_group: ClassVar[bool] = False
    differentiable: ClassVar[bool] = True  # softmax of a CNN, gathered and capped: no argmax or rounding on the way

    def __init__(self, model: nn.Module | None = None, batch_size: int = 256, cap: float | None = None) -> None:
        check_batch_size(batch_size)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap <= 1):
            raise ValueError(f"digit cap must be a number in (0, 1] or null, got {cap!r}")
        self.cap = None if cap is None else float(cap)
        if model is None:
            from flowforge.demo.classifiers import load_reward_classifier

            model = load_reward_classifier()
        self.model = model
        self.batch_size = batch_size
        self._per_device: dict[torch.device, nn.Module] = {}

    def _model_on(self, device: torch.device) -> nn.Module:
        if device not in self._per_device:
            model = copy.deepcopy(self.model).to(device).eval()
            model.requires_grad_(False)
            self._per_device[device] = model
        return self._per_device[device]

    def _probabilities(self, media: Tensor, prompts, metadata) -> tuple[Tensor, Tensor]:
        """``[B, 10]`` float32 softmax of the classifier and the ``[B]`` requested digits.

        Differentiable in ``media`` (no ``no_grad`` here: the classifier's weights are frozen, so media without grad
        build no graph; the reward-gradient objectives call it on media that have one)."""
        check_inputs(media, prompts, metadata)
        digits = requested_digits(metadata, prompts).to(media.device)
        model = self._model_on(media.device)
        probs = [torch.softmax(model(media[start : start + self.batch_size].float()).float(), dim=1)
                 for start in range(0, media.shape[0], self.batch_size)]
        if not probs:
            return torch.empty(0, 10, device=media.device), digits
        return torch.cat(probs), digits

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 probabilities on ``media``'s device (at most ``cap``).

        Differentiable in ``media`` (``differentiable = True``); above ``cap`` the gradient is 0.

        Raises:
            ValueError: bad shapes or lengths; a ``"digit"`` that is not an int in 0..9; a row without one whose
                prompt names no digit or several.
        """
        probs, digits = self._probabilities(media, prompts, metadata)
        reward = probs.gather(1, digits[:, None]).squeeze(1).float()
        return reward if self.cap is None else reward.clamp(max=self.cap)


class DigitEvalScorer(DigitScorer):
    """DigitEval (GenEval's role at small scale): 1.0 where the *independent* eval classifier's argmax is the
    requested digit, else 0.0; its batch mean is the DigitEval accuracy.

    ``EvalNet`` has a different architecture and seed than the reward's ``RewardNet`` and was trained on a split
    ``RewardNet`` never saw, so a policy that fools the reward model is caught here. Meant as an eval scorer
    (``eval.scorers: [digit_eval]``), not as a training reward.
    """

    name = "digit_eval"
    differentiable: ClassVar[bool] = False  # an argmax: no gradient

    def __init__(self, model: nn.Module | None = None, batch_size: int = 256) -> None:
        if model is None:
            from flowforge.demo.classifiers import load_eval_classifier

            model = load_eval_classifier()
        super().__init__(model, batch_size)

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``[B]`` float32 in {0, 1}: argmax of the eval classifier equals ``metadata["digit"]``."""
        probs, digits = self._probabilities(media, prompts, metadata)
        return (probs.argmax(dim=1) == digits).float()
