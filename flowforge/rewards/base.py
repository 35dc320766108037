"""The reward-scorer protocol and the input checks shared by the built-in scorers and the reward processor.

A scorer maps a batch of generated media plus their prompts and metadata to one float per sample:

    scorer(media [B, 3, H, W] float in [0, 1], prompts: Sequence[str] (len B), metadata: Sequence[dict] (len B))
        -> Tensor [B] float32, higher is better, NaN = "not applicable to this sample"

A scorer that reads whole videos sets ``takes_video = True`` and is given ``[B, 3, F, H, W]``; the others see a
video batch frame by frame (their scores averaged per video, :class:`~flowforge.rewards.processor.RewardProcessor`).
A scorer that reads the generated sound sets ``takes_audio = True``: it is called as ``scorer(media, prompts, metadata,
audio=AudioBatch)`` with the whole videos and their waveforms (an audio-video family, e.g. ``model.adapter=ltx2``;
any other model produces no audio and such a scorer is refused).
A scorer that reads the generated latents instead of pixels sets ``takes_latents = True``: it is called with the
rollout's clean latents ``x_0`` (``Trajectory.final``) in the place of ``media``: ``[B, *latent]`` float32 as the
model's :meth:`~flowforge.models.base.FlowModel.latent_shape` gives them (e.g. ``[B, C, h, w]`` for SD3,
``[B, C, F, h, w]`` for Wan, ``[B, S_v + L, D]`` packed tokens for LTX-2; a pixel-space model's latents are its
pixels in [-1, 1]), whole (never frame by frame).
A training step decodes its latents with the VAE only when one of its scorers reads pixels
(:meth:`~flowforge.rewards.processor.RewardProcessor.inputs`): with latent scorers alone there is no decode.
Scorers set ``needs_group = True`` when they must see a whole group of candidates for one prompt at once (ranking,
VLM judges comparing candidates); the reward processor then gathers the group before calling them. A scorer that
cannot score without some metadata entries (nothing in the prompt or the pixels stands in for them) lists their keys
in ``metadata_keys`` (optional, default none): ``flowforge serve judge``, whose requests carry only the prompt and
the frames, refuses such a scorer at start-up, naming them. A scorer whose calls cost money sets ``paid = True``
(``vlm_judge`` does unless its option ``paid: false`` says otherwise, e.g. the pipeline's own student): evaluation
asks it only for the first ``eval.teacher_groups`` held-out groups (default 0: never), in every run
(:class:`~flowforge.rewards.processor.RewardProcessor`, ``paid_groups``). Advantages are
not computed here (see ``flowforge.algorithms.advantages``). Where scoring sits in the training loop:
``docs/architecture.md``, section "Rewards".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import Tensor

from flowforge.media import AudioBatch  # noqa: F401 - the scorer protocol's audio type, imported from here too


@runtime_checkable
class RewardScorer(Protocol):
    """One reward component. See the module docstring for the call contract."""

    name: str
    needs_group: ClassVar[bool]

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor: ...


def check_media(media: Tensor) -> int:
    """Validate a media batch and return ``B``.

    Raises:
        ValueError: ``media`` is not a floating-point ``[B, 3, H, W]`` tensor.
    """
    if not isinstance(media, Tensor) or media.dim() != 4 or media.shape[1] != 3:
        shape = tuple(media.shape) if isinstance(media, Tensor) else type(media).__name__
        raise ValueError(f"media must be a [B, 3, H, W] tensor in [0, 1], got {shape}")
    if not media.is_floating_point():
        raise ValueError(f"media must be floating point in [0, 1], got dtype {media.dtype}")
    return media.shape[0]


def check_inputs(media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> int:
    """Validate a scorer call and return the batch size ``B``.

    Raises:
        ValueError: ``media`` is not a floating ``[B, 3, H, W]`` tensor, or ``prompts`` / ``metadata`` do not have
            ``B`` entries.
    """
    batch = check_media(media)
    if len(prompts) != batch:
        raise ValueError(f"prompts must have one entry per image ({batch}), got {len(prompts)}")
    if len(metadata) != batch:
        raise ValueError(f"metadata must have one entry per image ({batch}), got {len(metadata)}")
    return batch


def takes_video(scorer: Any) -> bool:
    """Whether ``scorer`` declares ``takes_video = True``: it scores whole videos ``[B, 3, F, H, W]`` (e.g. motion
    across frames); every other scorer sees a video batch as its frames and its scores are averaged per video."""
    return bool(getattr(scorer, "takes_video", False))


def takes_latents(scorer: Any) -> bool:
    """Whether ``scorer`` declares ``takes_latents = True``: it is called with the clean latents ``[B, *latent]``
    (float32, the model's latent layout) in the place of decoded media (module docstring)."""
    return bool(getattr(scorer, "takes_latents", False))


def scorer_reads(scorer: Any) -> frozenset[str]:
    """What ``scorer`` reads of a sample: ``{"latents"}`` for a latent scorer, else ``{"pixels"}`` (decoded media),
    plus ``"audio"`` for one that takes audio."""
    return frozenset({"latents" if takes_latents(scorer) else "pixels"} | ({"audio"} if takes_audio(scorer) else set()))


def is_paid(scorer: Any) -> bool:
    """Whether ``scorer`` declares ``paid = True``: each call costs money (a hosted VLM judge), so evaluation asks it
    only for the groups ``eval.teacher_groups`` allows (module docstring)."""
    return bool(getattr(scorer, "paid", False))


def takes_audio(scorer: Any) -> bool:
    """Whether ``scorer`` declares ``takes_audio = True``: it is called with ``audio=AudioBatch`` (the waveform and
    sample rate of each sample) besides the whole videos."""
    return bool(getattr(scorer, "takes_audio", False))


def check_media_batch(media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> int:
    """Validate a reward-processor call: images ``[B, 3, H, W]`` or videos ``[B, 3, F, H, W]``, floating point, one
    prompt and one metadata entry per sample; returns ``B``.

    Raises:
        ValueError: another shape or dtype; ``prompts`` / ``metadata`` not of length ``B``.
    """
    if isinstance(media, Tensor) and media.dim() == 5:
        check_media(media[:, :, 0])
        if len(prompts) != media.shape[0] or len(metadata) != media.shape[0]:
            raise ValueError(f"prompts and metadata must have one entry per video ({media.shape[0]}), got "
                             f"{len(prompts)} and {len(metadata)}")
        return media.shape[0]
    return check_inputs(media, prompts, metadata)


def check_batch_size(batch_size: int) -> int:
    """Return ``batch_size`` (samples per forward / scorer call) after checking it.

    Raises:
        ValueError: ``batch_size`` is not an ``int >= 1`` (a ``bool`` is rejected too).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return batch_size
