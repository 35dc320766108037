"""``clap``: audio-text agreement of a CLAP model (contrastive language-audio pretraining), for the sound an
audio-video family makes (``model.adapter=ltx2``).

    r = cos(f_A(a), f_T(p)) = <f_A(a), f_T(p)> / (||f_A(a)|| ||f_T(p)||)        in [-1, 1]

=========  =========================================================================================================
``a``      one sample's sound: its waveform (an :class:`~flowforge.rewards.base.AudioBatch` row ``[C, T]``) averaged
           to mono, resampled to the feature extractor's rate (48 kHz for LAION's CLAP) with
           ``scipy.signal.resample_poly`` (polyphase, Kaiser window), cut to the first ``max_length_s`` seconds
           (10 s for LAION's CLAP), then turned into log-mel features by the model's own ``ClapFeatureExtractor``
``p``      its prompt, tokenized by the model's own tokenizer (truncated to the tokenizer's ``model_max_length``)
``f_A``    ``ClapModel.get_audio_features`` (HTSAT audio tower + projection), ``f_T`` ``get_text_features``
           (RoBERTa text tower + projection) of a transformers ``ClapModel``
=========  =========================================================================================================

The score is the plain cosine similarity, not scaled by the model's ``logit_scale`` and not clipped at 0 (unlike
CLIPScore's ``2.5 * max(cos, 0)``). This is the CLAP score of Make-An-Audio (Huang et al., "Make-An-Audio:
Text-To-Audio Generation with Prompt-Enhanced Diffusion Models", ICML 2023, arXiv:2301.12661; its
``wav_evaluation/cal_clap_score.py``), of audiocraft's ``CLAPTextConsistencyMetric`` ("the average cosine similarity
between these embeddings") and of ``frechet_audio_distance.CLAPScore`` (``mean(cosine_similarity(text, audio))``);
the model is LAION's CLAP (Wu et al., "Large-scale Contrastive Language-Audio Pretraining with Feature Fusion and
Keyword-to-Caption Augmentation", ICASSP 2023, arXiv:2211.06687), e.g. ``laion/clap-htsat-unfused``.

Why the crop: the official feature extractor crops a clip longer than ``max_length_s`` at a *random* offset
(``truncation="rand_trunc"``, or random chunks with ``"fusion"``); a reward must give the same media the same score,
so longer clips are cut to their first ``max_length_s`` seconds before it. Shorter clips go to it unchanged (it
repeats them to the window, ``padding="repeatpad"``): for them the features are exactly the official processor's.
Resampling is a library call (scipy's ``resample_poly``; ``torchaudio`` is not a dependency); it is skipped when the
sound is already at the model's rate.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from flowforge.media import AudioBatch
from flowforge.rewards.base import check_batch_size
from flowforge.rewards.scorers.clip_common import load_cached, resolve_device, resolve_dtype

DEFAULT_MODEL = "laion/clap-htsat-unfused"
"""LAION's CLAP (HTSAT audio tower, no feature fusion) as a transformers ``ClapModel`` + ``ClapProcessor``."""


def resample(waveform: Tensor, sample_rate: int, target_rate: int) -> np.ndarray:
    """``[B, C, T]`` float waveforms at ``sample_rate`` -> mono ``[B, T']`` float32 numpy at ``target_rate``
    (channels averaged, then ``scipy.signal.resample_poly`` with the reduced ratio ``target / rate``; unchanged when
    the rates are equal)."""
    mono = waveform.detach().float().mean(dim=1).cpu().numpy()
    if sample_rate == target_rate:
        return mono
    from scipy.signal import resample_poly

    g = math.gcd(int(target_rate), int(sample_rate))
    return resample_poly(mono, target_rate // g, sample_rate // g, axis=-1).astype(np.float32)


class ClapScore:
    """Cosine similarity of CLAP audio and text embeddings (module docstring), per sample.

    Args:
        model_path: a local directory holding a transformers ``ClapModel`` and its ``ClapProcessor`` files
            (``save_pretrained``, or ``huggingface-cli download laion/clap-htsat-unfused --local-dir DIR``), or a hub
            id found in the local Hugging Face cache (default ``laion/clap-htsat-unfused``). Nothing is downloaded:
            loading is ``local_files_only``.
        device: ``"cpu"`` or a CUDA device. dtype: the model's dtype (scores are computed in float32).
        batch_size: samples per model forward, ``>= 1``.

    Called as ``scorer(media, prompts, metadata, audio=AudioBatch)`` (``takes_audio``): ``media`` (the videos) is
    not read; ``audio.waveform`` ``[B, C, T]`` at ``audio.sample_rate``. Returns ``[B]`` float32 on ``media``'s device.

    Raises:
        ValueError: a model that is not found locally or does not load (the message names ``model_path`` and how to
            download it); a stub tokenizer; a bad ``device`` / ``dtype`` / ``batch_size``. On call: no ``audio`` or
            not one row per prompt.
    """

    name = "clap"
    needs_group: ClassVar[bool] = False
    takes_audio: ClassVar[bool] = True
    takes_video: ClassVar[bool] = True  # the whole clip is one sample (its frames are not scored one by one)

    def __init__(self, model_path: str | os.PathLike = DEFAULT_MODEL, *, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "float32", batch_size: int = 16) -> None:
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.batch_size = check_batch_size(batch_size)
        source = os.path.expanduser(os.fspath(model_path))
        self._loaded = load_cached(("transformers.ClapModel", source, str(self.device), self.dtype),
                                   lambda: self._load(source))  # held: the cache is weak
        self.model, self.processor = self._loaded.model, self._loaded.processor
        self.sampling_rate = int(self.processor.feature_extractor.sampling_rate)
        self.max_samples = int(self.processor.feature_extractor.nb_max_samples)

    def _load(self, source: str):
        from transformers import ClapModel, ClapProcessor

        try:
            model = ClapModel.from_pretrained(source, local_files_only=True)
            processor = ClapProcessor.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(f"reward.options.clap.model_path={source!r}: no CLAP model found locally ({error}); "
                             f"download it first, e.g. `huggingface-cli download {DEFAULT_MODEL} --local-dir DIR` "
                             "and pass DIR") from None
        if len(processor.tokenizer) < 10:  # transformers' 2-token placeholder when the tokenizer files are missing
            raise ValueError(f"reward.options.clap.model_path={source!r}: the tokenizer has only "
                             f"{len(processor.tokenizer)} tokens (a stub); the tokenizer files are missing")
        model = model.to(device=self.device, dtype=self.dtype).eval()
        model.requires_grad_(False)
        return _Loaded(model, processor)

    def features(self, prompts: Sequence[str], audio: AudioBatch) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The model inputs of a batch, on the CPU: ``(audio inputs, text inputs)``; the audio ones are the feature
        extractor's ``input_features`` ``[B, 1, frames, mel]`` float32 and ``is_longer`` ``[B, 1]`` of the mono,
        resampled, cropped waveforms (module docstring), the text ones the tokenizer's ``input_ids`` /
        ``attention_mask`` ``[B, L]`` (padded to the longest)."""
        waves = resample(audio.waveform, audio.sample_rate, self.sampling_rate)[:, : self.max_samples]
        sound = self.processor.feature_extractor(list(waves), sampling_rate=self.sampling_rate, return_tensors="pt")
        text = self.processor.tokenizer(list(prompts), padding=True, truncation=True, return_tensors="pt")
        return dict(sound), dict(text)

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], *,
                 audio: AudioBatch | None = None) -> Tensor:
        if audio is None:
            raise ValueError("clap scores the generated sound: call it with audio=AudioBatch (an audio-video model)")
        if len(audio) != len(prompts) or len(metadata) != len(prompts):
            raise ValueError(f"clap needs one audio row and one metadata entry per prompt ({len(prompts)}), got "
                             f"{len(audio)} and {len(metadata)}")
        out = torch.empty(len(prompts), dtype=torch.float32)
        for start in range(0, len(prompts), self.batch_size):
            rows = list(range(start, min(start + self.batch_size, len(prompts))))
            sound, text = self.features([prompts[i] for i in rows], audio.index(rows))
            a = self._embed(self.model.get_audio_features, sound)
            t = self._embed(self.model.get_text_features, text)
            out[rows] = (F.normalize(a, dim=-1) * F.normalize(t, dim=-1)).sum(dim=-1).cpu()
        return out.to(media.device if isinstance(media, Tensor) else "cpu")

    def _embed(self, fn, inputs: dict[str, Tensor]) -> Tensor:
        """``fn(**inputs)``'s projected embedding ``[n, D]`` in float32 (transformers 5 returns it as the output's
        ``pooler_output``, earlier versions as a tensor)."""
        moved = {k: v.to(self.device, dtype=self.dtype) if v.is_floating_point() else v.to(self.device)
                 for k, v in inputs.items()}
        result = fn(**moved)
        return (result if isinstance(result, Tensor) else result.pooler_output).float()


class _Loaded:
    """A loaded ``(model, processor)`` pair, weakly cacheable (a tuple is not)."""

    def __init__(self, model, processor) -> None:
        self.model, self.processor = model, processor
