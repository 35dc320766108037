"""Audio-video onset agreement: does the sound change when the picture does?

A generated clip whose audio is in sync with its video has sound onsets (a door slam, a footstep, a word) where the
picture moves. :class:`AVOnsetSync` measures that agreement without any learned model, on the CPU or GPU:

* **video motion** of frame transition ``f`` (``f = 1 .. F-1``): the mean absolute difference of frames ``f`` and
  ``f - 1`` (pixels in [0, 1], all channels);
* **audio onset strength** of the same transition: the waveform (channels averaged) is cut into ``F`` equal
  consecutive segments, one per frame (the clip's audio spans its frames, as LTX-2 generates it); each segment's
  log-magnitude spectrum is ``log(1 + |rfft(hann * segment)|)``, and the onset strength is the *spectral flux*
  between segments ``f - 1`` and ``f``: the sum of the positive spectral increases (the standard onset detection
  function of Bello et al., "A Tutorial on Onset Detection in Music Signals", IEEE TASLP 2005, section III-B);
* **score**: the Pearson correlation of the two ``F - 1``-long series, in [-1, 1] (1: the sound changes exactly
  as much as the picture, transition by transition). NaN ("not applicable") when either series is constant (a
  still video or a steady sound) or the clip has fewer than 3 frames.

It scores agreement, not quality: silence over a still picture is NaN, and a loud clip that changes in step with the
picture scores as well as a quiet one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowforge.media import AudioBatch
from flowforge.rewards.base import check_media_batch


def video_motion(video: Tensor) -> Tensor:
    """``[B, 3, F, H, W]`` in [0, 1] -> ``[B, F - 1]`` mean absolute difference of consecutive frames (fp32)."""
    v = video.detach().float()
    return (v[:, :, 1:] - v[:, :, :-1]).abs().mean(dim=(1, 3, 4))


def spectral_flux(waveform: Tensor, segments: int) -> Tensor:
    """``[B, C, T]`` -> ``[B, segments - 1]``: the waveform (channels averaged) cut into ``segments`` equal parts
    (a remainder of ``T mod segments`` samples at the end is dropped), the positive increase of each part's
    ``log(1 + |rfft(hann * part)|)`` spectrum over the previous part's, summed over frequencies (fp32).

    Raises:
        ValueError: fewer than 2 samples per segment.
    """
    mono = waveform.detach().float().mean(dim=1)
    length = mono.shape[-1] // segments
    if length < 2:
        raise ValueError(f"audio of {mono.shape[-1]} samples cannot be cut into {segments} segments of >= 2 samples")
    parts = mono[:, : length * segments].reshape(mono.shape[0], segments, length)
    window = torch.hann_window(length, periodic=False, device=parts.device, dtype=parts.dtype)
    spectrum = torch.log1p(torch.fft.rfft(parts * window, dim=-1).abs())
    return (spectrum[:, 1:] - spectrum[:, :-1]).clamp_min(0).sum(dim=-1)


def pearson(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise Pearson correlation of ``[B, N]`` series; NaN for a row where either series is constant."""
    a = a - a.mean(dim=1, keepdim=True)
    b = b - b.mean(dim=1, keepdim=True)
    denom = a.norm(dim=1) * b.norm(dim=1)
    return torch.where(denom > 0, (a * b).sum(dim=1) / denom.clamp_min(1e-30), torch.full_like(denom, float("nan")))


class AVOnsetSync:
    """``av_onset_sync``: Pearson correlation, over frame transitions, of video motion and audio spectral flux (the
    module docstring). Takes whole videos and their audio (``takes_video``, ``takes_audio``).

    Raises (on call):
        ValueError: media that are not videos ``[B, 3, F, H, W]``; no ``audio`` or not one row per video.
    """

    name = "av_onset_sync"
    needs_group: ClassVar[bool] = False
    takes_video: ClassVar[bool] = True
    takes_audio: ClassVar[bool] = True

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], *,
                 audio: AudioBatch | None = None) -> Tensor:
        batch = check_media_batch(media, prompts, metadata)
        if media.ndim != 5:
            raise ValueError(f"av_onset_sync scores videos [B, 3, F, H, W], got shape {tuple(media.shape)}")
        if audio is None or len(audio) != batch:
            raise ValueError(f"av_onset_sync needs audio= with one waveform per video ({batch}), got "
                             f"{None if audio is None else len(audio)}")
        frames = media.shape[2]
        if frames < 3:
            return torch.full((batch,), float("nan"), dtype=torch.float32, device=media.device)
        flux = spectral_flux(audio.waveform.to(media.device), frames)
        return pearson(video_motion(media), flux).float()
