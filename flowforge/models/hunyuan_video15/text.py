"""HunyuanVideo 1.5's text conditioning: its Qwen2.5-VL and ByT5 glyph encoder, called through the pipeline's own
``encode_prompt`` in a text-only pipeline, their outputs joined into one record (:func:`join_text`); see
:mod:`flowforge.models.hunyuan_video15.adapter` for the conventions and the pipeline lines they were checked against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowforge.models.common import DEFAULT_MIN_TOKENIZER_SIZE, PipelineText, read_json
from flowforge.models.hunyuan_video15.spec import GLYPH_LENGTH


def _hunyuan_encode_fn(max_sequence_length: int | None, glyph_length: int):
    def encode(pipe, prompts: list[str]) -> tuple[Tensor, Tensor, None]:
        if max_sequence_length is not None:  # the pipeline's hard-coded 1000 otherwise
            pipe.tokenizer_max_length = int(max_sequence_length)
        pipe.tokenizer_2_max_length = int(glyph_length)
        e1, m1, e2, m2 = pipe.encode_prompt(prompt=list(prompts), device=pipe.text_encoder.device,
                                            dtype=pipe.text_encoder.dtype,
                                            batch_size=len(prompts))
        embeds, mask = join_text(e1, m1, e2, m2)
        return embeds, mask, None

    return encode


def join_text(e1: Tensor, m1: Tensor, e2: Tensor, m2: Tensor) -> tuple[Tensor, Tensor]:
    """The two encoders' outputs ``e1 [B, S1, D1]`` / ``m1 [B, S1]`` (Qwen2.5-VL) and ``e2 [B, S2, D2]`` /
    ``m2 [B, S2]`` (ByT5) as one record: ``([B, S1 + S2, max(D1, D2)]`` zero-padded features, ``[B, S1 + S2]``
    long mask)."""
    width = max(e1.shape[-1], e2.shape[-1])
    pad = torch.nn.functional.pad
    embeds = torch.cat([pad(e1, (0, width - e1.shape[-1])), pad(e2.to(e1.dtype), (0, width - e2.shape[-1]))], dim=1)
    mask = torch.cat([m1.long(), m2.to(m1.device).long()], dim=1)
    return embeds, mask


class _NoVAE(nn.Module):
    """What the pipelines' ``__init__`` reads of a VAE (``latent_channels`` and the compression ratios), for a
    text-only pipeline: ``HunyuanVideo15Pipeline(vae=None)`` fails on ``self.vae.config``."""

    config = type("Config", (), {"latent_channels": 0})()
    temporal_compression_ratio = 4
    spatial_compression_ratio = 16


TEXT_COMPONENTS = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")


class HunyuanVideo15Text(PipelineText):
    """:class:`~flowforge.models.common.PipelineText` of a HunyuanVideo 1.5 pipeline: the text components
    (``TEXT_COMPONENTS``) loaded by the classes ``model_index.json`` names (from ``transformers``, never
    downloading) or given in memory, in a pipeline of the directory's class built without transformer, VAE,
    guider and image encoder, whose own ``encode_prompt`` encodes. The placeholder-tokenizer guard
    (``min_tokenizer_size``) applies to the Qwen tokenizer only: ByT5's byte-level vocabulary has 384 tokens."""

    def _build(self):
        import inspect

        import diffusers
        import transformers

        cls = getattr(diffusers, self.pipeline_class)
        if self.path is not None:
            root = Path(self.path)
            index = read_json(root / "model_index.json")
            parts = {}
            for name in TEXT_COMPONENTS:
                loader = getattr(transformers, index[name][1])
                kw = {"dtype": self.dtype} if name.startswith("text_encoder") else {}
                parts[name] = loader.from_pretrained(str(root / name), local_files_only=True, **kw)
        else:
            if self._released:
                raise RuntimeError("the in-memory HunyuanVideo 1.5 text encoders were released; they cannot be "
                                   "reloaded (build the adapter from a pipeline directory to reload lazily)")
            missing = [n for n in TEXT_COMPONENTS if self._components.get(n) is None]
            if missing:
                raise ValueError(f"HunyuanVideo 1.5 text components missing: {missing}; "
                                 f"expected {list(TEXT_COMPONENTS)}")
            parts = {n: self._components[n] for n in TEXT_COMPONENTS}
        if len(parts["tokenizer"]) <= self.min_tokenizer_size:
            raise RuntimeError(f"{self.path or 'components'}: tokenizer has only {len(parts['tokenizer'])} tokens "
                               f"(placeholder tokenizer?); expected more than {self.min_tokenizer_size}")
        params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        kwargs = {name: parts.get(name) for name in params}
        kwargs["vae"] = _NoVAE()
        pipe = cls(**kwargs)
        for name in ("text_encoder", "text_encoder_2"):
            getattr(pipe, name).to(self.device).eval().requires_grad_(False)
        return pipe


def hunyuan_video15_text(*, path: str | Path | None = None, components: dict[str, Any] | None = None,
                         max_sequence_length: int | None = None, glyph_length: int = GLYPH_LENGTH,
                         device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         encoder_id: str | None = None, min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE,
                         pipeline_class: str = "HunyuanVideo15Pipeline") -> HunyuanVideo15Text:
    """Qwen2.5-VL + ByT5 of a HunyuanVideo 1.5 pipeline (directory ``path`` or ``components`` with ``tokenizer``,
    ``text_encoder``, ``tokenizer_2``, ``text_encoder_2``), encoding through ``encode_prompt``:
    ``(embeds [B, S1 + glyph_length, max(D1, D2)], mask [B, S1 + glyph_length], None)`` (:func:`join_text`).
    ``max_sequence_length``: the Qwen tokens after the template (``None``: the pipeline's 1000)."""
    return HunyuanVideo15Text(pipeline_class, _hunyuan_encode_fn(max_sequence_length, int(glyph_length)), path=path,
                              components=components, device=device, dtype=dtype,
                              settings=f"len={max_sequence_length}|glyph={int(glyph_length)}", encoder_id=encoder_id,
                              min_tokenizer_size=min_tokenizer_size)
