"""The rollout / reward boundary: clean latents become media the reward models read.

A rollout ends in clean latents ``x_0`` (``Trajectory.final``); scorers, sample grids and sidecars take media in
``[0, 1]``. :func:`decode_media` is the one place that conversion happens, in chunks so a large step never decodes
its whole batch at once; :func:`decode_needed` calls it (and :func:`decode_audio`) only when something reads its
result, so a step whose reward scorers all read latents (``takes_latents``) runs no VAE decode at all (the wire
form's decoding is another thing: :func:`flowforge.rewards.wire.decode_wire_media`). The media types themselves
(:func:`~flowforge.media.video_frames`, :class:`~flowforge.media.AudioBatch`) live in :mod:`flowforge.media`, below
both the rollout and the reward scorers.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from flowforge.media import AudioBatch
from flowforge.models.base import AudioDecoding, FlowModel


@torch.no_grad()
def decode_media(adapter: FlowModel, latents: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``adapter.decode`` of clean latents in consecutive chunks, concatenated in row order, without gradients.

    Args:
        adapter: the model family's adapter (its VAE, or the identity for pixel-space models).
        latents: ``[B, *latent]`` clean latents ``x_0`` (fp32, as the rollout leaves them).
        batch_size: rows decoded per ``adapter.decode`` call (``reward.batch_size``), ``>= 1``.

    Returns:
        Images ``[B, 3, H, W]`` (or ``[B, 1, H, W]`` grey) or video ``[B, 3, F, H, W]`` in ``[0, 1]``, on the
        adapter's device.

    Raises:
        ValueError: ``batch_size < 1``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return torch.cat([adapter.decode(latents[i:i + batch_size]) for i in range(0, latents.shape[0], batch_size)])


@torch.no_grad()
def decode_audio(adapter: FlowModel, latents: torch.Tensor, batch_size: int) -> AudioBatch | None:
    """The sound of clean latents for an audio-video adapter (:class:`~flowforge.models.base.AudioDecoding`:
    ``adapter.decode_audio``), decoded ``batch_size`` rows at a time as :func:`decode_media`; ``None`` for a model
    that produces no audio.

    Raises:
        ValueError: ``batch_size < 1``; chunks decoded at different sample rates.
    """
    if not isinstance(adapter, AudioDecoding):
        return None
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return AudioBatch.cat([AudioBatch(*adapter.decode_audio(latents[i:i + batch_size]))
                           for i in range(0, latents.shape[0], batch_size)])


def decode_needed(adapter: FlowModel, latents: torch.Tensor, batch_size: int,
                  needs: Collection[str]) -> tuple[torch.Tensor | None, AudioBatch | None]:
    """The decoded media that ``needs`` asks for, and nothing else: ``(media, audio)``.

    Args:
        adapter, latents, batch_size: as :func:`decode_media` (``latents`` ``[B, *latent]``).
        needs: what the readers of the step read (:meth:`flowforge.rewards.processor.RewardProcessor.inputs`, plus
            what the trainer itself writes, e.g. sidecars): ``"pixels"`` and / or ``"audio"``; other names
            (``"latents"``) need no decode.

    Returns:
        ``media`` as :func:`decode_media` (``None`` unless ``"pixels"`` is needed) and ``audio`` as
        :func:`decode_audio` (``None`` unless ``"audio"`` is needed, or for a model without sound).
    """
    media = decode_media(adapter, latents, batch_size) if "pixels" in needs else None
    audio = decode_audio(adapter, latents, batch_size) if "audio" in needs else None
    return media, audio

