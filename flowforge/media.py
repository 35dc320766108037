"""Generated media as tensors, below both the rollout (which makes them) and the reward scorers (which read them).

- images ``[B, 3, H, W]`` (or ``[B, 1, H, W]`` grey) and videos ``[B, 3, F, H, W]``, float in ``[0, 1]``;
- :func:`video_frames`: a video batch laid out as images, for per-frame scorers and grids;
- :func:`reference_video`: a reference clip, given as a video or as a strip of frames, as a video;
- :func:`to_uint8`: media as 8-bit pixels, ``round(clamp(x, 0, 1) * 255)`` (PNG / JPEG / PIL / OCR inputs);
- :class:`AudioBatch`: the sound of an audio-video batch, a waveform per media row.

Torch only; the JSON wire form of media is :mod:`flowforge.rewards.wire`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor


def video_frames(video: Tensor) -> Tensor:
    """``[B, 3, F, H, W]`` -> ``[B * F, 3, H, W]``, the frames of each video consecutive."""
    return video.permute(0, 2, 1, 3, 4).flatten(0, 1)


def to_uint8(media: Tensor) -> Tensor:
    """Float media in ``[0, 1]`` (any shape, any float dtype) -> uint8 ``round(clamp(x, 0, 1) * 255)`` computed in
    float32, same shape and device, detached."""
    return (media.detach().float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)


def reference_video(reference: Tensor, frames: int, shape: tuple[int, int], *,
                    field: str = "metadata.reference_media") -> Tensor:
    """A reference clip (the real future a world model's candidates are graded against) as ``[3, F, H, W]``: a
    ``[3, F, H, W]`` video as it is, a ``[3, H, F W]`` strip (the frames side by side, as the ``real_clip`` files of
    ``demo:world`` store it) cut into its ``F = frames`` frames. Same dtype and device.

    Raises:
        ValueError: neither shape fits ``frames`` x ``shape`` (``field`` names the input in the message).
    """
    h, w = shape
    if reference.dim() == 4 and tuple(reference.shape[1:]) == (frames, h, w):
        return reference
    if reference.dim() == 3 and tuple(reference.shape[1:]) == (h, frames * w):
        return reference.reshape(3, h, frames, w).permute(0, 2, 1, 3)
    raise ValueError(f"{field} must be the real future [3, {frames}, {h}, {w}] or a strip [3, {h}, {frames * w}], "
                     f"got {tuple(reference.shape)}")


@dataclasses.dataclass(frozen=True)
class AudioBatch:
    """The generated sound of a batch: ``waveform [B, C, T]`` float (about [-1, 1]) at ``sample_rate`` Hz, row ``i``
    the sound of media row ``i``.

    Raises:
        ValueError: ``waveform`` not a floating ``[B, C, T]`` tensor; ``sample_rate`` not an int > 0.
    """

    waveform: Tensor
    sample_rate: int

    def __post_init__(self) -> None:
        if not isinstance(self.waveform, Tensor) or self.waveform.ndim != 3 or not self.waveform.is_floating_point():
            shape = tuple(self.waveform.shape) if isinstance(self.waveform, Tensor) else type(self.waveform).__name__
            raise ValueError(f"audio waveform must be a floating [B, C, T] tensor, got {shape}")
        if isinstance(self.sample_rate, bool) or not isinstance(self.sample_rate, int) or self.sample_rate <= 0:
            raise ValueError(f"audio sample_rate must be an int > 0, got {self.sample_rate!r}")

    def __len__(self) -> int:
        return int(self.waveform.shape[0])

    def index(self, idx: Tensor | Sequence[int]) -> AudioBatch:
        """Rows ``idx`` (int tensor or list) of the batch."""
        idx = torch.as_tensor(idx, dtype=torch.long).to(self.waveform.device)
        return AudioBatch(self.waveform.index_select(0, idx), self.sample_rate)

    @staticmethod
    def cat(items: Sequence[AudioBatch]) -> AudioBatch:
        """Concatenate batches of one sample rate and clip length along the batch.

        Raises:
            ValueError: no items, or different sample rates.
        """
        items = list(items)
        if not items or len({a.sample_rate for a in items}) != 1:
            raise ValueError(f"AudioBatch.cat needs batches of one sample rate, got {[a.sample_rate for a in items]}")
        return AudioBatch(torch.cat([a.waveform for a in items]), items[0].sample_rate)
