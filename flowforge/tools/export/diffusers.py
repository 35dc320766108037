"""The diffusers writer of :func:`flowforge.tools.export.export_run`: a merged diffusers transformer / pipeline, a
diffusers + peft LoRA, or a module run's trained tensors, for every diffusers family (the registered ``sd3``,
``flux``, ``qwen_image``, ``wan`` and any ``pkg.module:Class`` adapter over a diffusers transformer).

The forms, layouts, loading and verification are described in :mod:`flowforge.tools.export` (this module is its
diffusers half; the world model's is :mod:`flowforge.tools.export.world`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from flowforge.models.base import Conditioning
from flowforge.models.common import FLOWFORGE_META
from flowforge.runtime.errors import one_line
from flowforge.tools.export.card import (CARRIED_BASE, OUT_LINE, PIPELINE_FILE, is_demo_base, loading_snippet,
                                         write_demo_pipeline)
from flowforge.tools.export.out import ExportError
from flowforge.tools.export.portable import drop_name_or_path
from flowforge.tools.export.source import (SUPPORTED_ADAPTERS, Source, base_name, check_base_identity, layout,
                                           read_run_config, require_base, transformer_class)
from flowforge.tools.export.verify import VerifyReport, trained_velocity, verify_report
from flowforge.tools.export.weights import (MODULES_WEIGHT_NAME, apply_trained, lora_layers, peft_config,
                                            write_module_adapter, write_peft_adapter)

LORA_PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline", "qwen_image": "QwenImagePipeline",
                  "wan": "WanPipeline", "ltx2": "LTX2Pipeline"}
"""Registered family -> the diffusers pipeline whose ``save_lora_weights`` writes its adapter export (default when the
base directory names no pipeline class of its own); its keys are ``SUPPORTED_ADAPTERS``."""
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


# ------------------------------------------------------------------------------------------------ base
def _load_transformer(transformer_dir: Path) -> nn.Module:
    """The diffusers transformer in ``transformer_dir`` in fp32; a damaged weight file is named (diffusers' own
    message for a garbage safetensors header is "Cannot copy out of meta tensor")."""
    from safetensors import SafetensorError, safe_open

    cls = transformer_class(transformer_dir)
    for f in sorted(transformer_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as handle:
                handle.keys()
        except (OSError, SafetensorError) as exc:
            raise ExportError(f, f"cannot be read ({type(exc).__name__}: {one_line(str(exc))})",
                              "restore the base model's weights") from exc
    try:
        return cls.from_pretrained(str(transformer_dir), torch_dtype=torch.float32, local_files_only=True).eval()
    except (OSError, ValueError, RuntimeError, NotImplementedError) as exc:
        raise ExportError(transformer_dir, f"cannot be loaded as {cls.__name__} ({type(exc).__name__}: "
                          f"{one_line(str(exc))[:300]})", "restore the base model's files") from exc


def _trained_policy(src: Source, transformer_dir: Path) -> nn.Module:
    """The trained policy in fp32: base + injected LoRA + checkpoint weights (or the full fine-tuned weights).
    The weights fit (checked by :func:`~flowforge.tools.export.contract.check_contract` before)."""
    transformer = _load_transformer(transformer_dir)
    apply_trained(src, transformer)
    return transformer.requires_grad_(False).eval()


# ------------------------------------------------------------------------------------------------ verification
def _probe_inputs(adapter: str, config) -> tuple[str, torch.Tensor, torch.Tensor, Conditioning]:
    """Fixed fp32 inputs from the transformer config of family ``adapter``: ``(adapter, x [2, *latent], sigma [2],
    seeded conditioning)``.

    Raises:
        ExportError: ``adapter`` is not a registered family (nothing says how to call its transformer).
    """
    if adapter not in SUPPORTED_ADAPTERS:
        raise ExportError("--verify", f"needs a registered model family, and model.adapter={adapter!r} is not one",
                          f"drop --verify to export unverified; verifiable: {list(SUPPORTED_ADAPTERS)}")
    gen = torch.Generator().manual_seed(20240601)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    if adapter == "sd3":
        patch = int(config.patch_size)
        cells = min(int(config.pos_embed_max_size or 16), int(config.sample_size) // patch, 16)
        side = max(cells, 1) * patch
        x = randn(2, int(config.in_channels), side, side)
        cond = Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                            pooled=randn(2, int(config.pooled_projection_dim)))
    elif adapter == "flux":  # unpacked latents: in_channels = 4 C (2x2 packing)
        x = randn(2, int(config.in_channels) // 4, 4, 4)
        cond = Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                            pooled=randn(2, int(config.pooled_projection_dim)))
    elif adapter == "qwen_image":
        x = randn(2, int(config.in_channels) // 4, 4, 4)
        cond = Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                            mask=torch.ones(2, 8, dtype=torch.long))
    elif adapter == "ltx2":  # the joint latent of a 9-frame 32x32 clip: 2 video tokens + 9 audio tokens (24 fps)
        x = randn(2, 2 + 9, int(config.in_channels))
        if config.use_prompt_embeddings:  # LTX-2.0: both streams read caption_channels-wide connector features
            width = 2 * int(config.caption_channels)
        else:
            width = (int(config.num_attention_heads) * int(config.attention_head_dim)
                     + int(config.audio_num_attention_heads) * int(config.audio_attention_head_dim))
        cond = Conditioning(prompt_embeds=randn(2, 8, width), mask=torch.ones(2, 8, dtype=torch.long))
    else:  # wan: [B, C, F, H, W], H / W multiples of the spatial patch
        _, ph, pw = config.patch_size
        x = randn(2, int(config.in_channels), 2, 2 * ph, 2 * pw)
        image_dim = config.image_dim
        # With CLIP image tokens diffusers' Wan attention takes the last 512 context tokens as text (the length
        # the Wan pipelines pad to), so an image-conditioned transformer gets 512 text tokens here.
        text_len = 8 if image_dim is None else 512
        cond = Conditioning(prompt_embeds=randn(2, text_len, int(config.text_dim)),
                            pooled=None if image_dim is None else randn(2, 4 * int(image_dim)))
    return adapter, x, torch.tensor([0.3, 0.8]), cond


def _family_adapter(adapter: str, transformer: nn.Module):
    """The family's adapter around a bare ``transformer`` (no text encoder, no VAE)."""
    if adapter == "sd3":
        from flowforge.models.sd3 import SD3Adapter

        return SD3Adapter(transformer)
    if adapter == "flux":
        from flowforge.models.flux import FluxAdapter

        return FluxAdapter(transformer)
    if adapter == "qwen_image":
        from flowforge.models.qwen_image import QwenImageAdapter

        return QwenImageAdapter(transformer)
    if adapter == "ltx2":
        from flowforge.models.ltx2 import LTX2Adapter

        # the probe compares the conditional velocity: no CFG (the pipeline default guides the audio at 7), no rescale
        ltx2 = LTX2Adapter(transformer, audio_guidance_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)
        ltx2.latent_shape(32, 32, 9)  # the probe's geometry (no VAE: LTX-2's compression 32 / 8, 16 kHz audio)
        return ltx2
    from flowforge.models.wan import WanAdapter

    cfg = transformer.config
    return WanAdapter(transformer, task="i2v" if cfg.in_channels != cfg.out_channels else "t2v")


@torch.no_grad()
def _velocity(transformer: nn.Module, inputs) -> torch.Tensor:
    adapter, x, sigma, cond = inputs
    return _family_adapter(adapter, transformer).velocity(x, sigma, cond, 1.0)


# ------------------------------------------------------------------------------------------------ writers
def _copy_components(base: Path, out: Path) -> None:
    for entry in sorted(base.iterdir()):
        if entry.name == "transformer" or entry.name.startswith("."):
            continue
        if entry.is_dir():
            shutil.copytree(entry, out / entry.name)
        else:
            shutil.copy2(entry, out / entry.name)


def _refuse_module_lora(src: Source, form: str) -> None:
    """A ``module+lora`` run of a diffusers family is not exported (neither form is implemented for them)."""
    if src.lora["trainable"] == "module+lora":
        raise ExportError(f"--form {form}", f"lora.trainable='module+lora' runs of model.adapter={src.adapter!r} "
                          "cannot be exported yet (only the world model's can)",
                          "train this family with lora.trainable='lora' or 'module' to export it")


def write_merged(src: Source, work: Path, verify: bool) -> VerifyReport | None:
    _refuse_module_lora(src, "merged")
    base = require_base(src, "a merged export" if src.lora["trainable"] == "lora" else "exporting a full or "
                        "module fine-tune (for its config.json and pipeline components)")
    transformer_dir, is_pipeline = layout(base)
    policy = _trained_policy(src, transformer_dir)
    inputs = _probe_inputs(src.adapter, policy.config) if verify else None
    is_lora = src.lora["trainable"] == "lora"
    v_trained, base_diff = (trained_velocity(policy, lambda p: _velocity(p, inputs), is_lora) if verify
                            else (None, None))
    if is_lora:
        policy.fuse_lora(lora_scale=1.0, safe_fusing=True, adapter_names=["default"])
        policy.unload_lora()
    demo = not is_pipeline and is_demo_base(transformer_dir, src.adapter)  # becomes a custom diffusers pipeline
    out_transformer = work / "transformer" if is_pipeline or demo else work
    out_transformer.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(str(out_transformer), safe_serialization=True)
    drop_name_or_path(out_transformer / "config.json")  # the base's directory on this machine otherwise
    if (transformer_dir / FLOWFORGE_META).is_file():  # the text encoder flowforge loads the model with
        shutil.copy2(transformer_dir / FLOWFORGE_META, out_transformer / FLOWFORGE_META)
    if is_pipeline:
        _copy_components(base, work)
    elif demo:
        write_demo_pipeline(work, transformer_dir, read_run_config(src.run_dir))
    del policy
    if not verify:
        return None
    reloaded = _load_transformer(out_transformer)
    kind = "merged" if src.lora["trainable"] == "lora" else "full"
    return verify_report(_velocity(reloaded, inputs), v_trained, base_diff, kind)


def _lora_pipeline(src: Source):
    """The diffusers pipeline class whose ``save_lora_weights`` writes this run's adapter: the base directory's own
    (``model_index.json`` ``_class_name``) when it has one, else the family's (:data:`LORA_PIPELINES`)."""
    import diffusers

    name = None
    if src.base is not None and (src.base / "model_index.json").is_file():
        index = src.base / "model_index.json"
        try:
            name = json.loads(index.read_text()).get("_class_name")
        except (OSError, ValueError, AttributeError) as exc:
            raise ExportError(index, f"cannot be read as a diffusers model index ({type(exc).__name__})",
                              "restore the base model's model_index.json") from exc
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if cls is not None and hasattr(cls, "save_lora_weights"):
        return cls
    if src.adapter in LORA_PIPELINES:
        return getattr(diffusers, LORA_PIPELINES[src.adapter])
    raise ExportError(f"model.adapter={src.adapter!r}", "no diffusers pipeline with save_lora_weights is known for "
                      f"it (base model_index.json names {name!r})", "export it with --form merged")


def _write_module_adapter(src: Source, work: Path, verify: bool) -> VerifyReport | None:
    """A module run's trained tensors (:func:`flowforge.tools.export.weights.write_module_adapter`), verified through
    the family's adapter on a fresh base transformer."""
    if not verify:
        return write_module_adapter(src, work, False, base_name=base_name(src), load_base=None, velocity=None)
    transformer_dir, _ = layout(require_base(src, "verifying an adapter export"))
    inputs: list = []

    def velocity(transformer: nn.Module) -> torch.Tensor:
        if not inputs:
            inputs.append(_probe_inputs(src.adapter, transformer.config))
        return _velocity(transformer, inputs[0])

    return write_module_adapter(src, work, True, base_name=base_name(src), velocity=velocity,
                                load_base=lambda: _load_transformer(transformer_dir).requires_grad_(False))


def write_adapter(src: Source, work: Path, verify: bool) -> VerifyReport | None:
    _refuse_module_lora(src, "adapter")
    if src.lora["trainable"] == "module":
        return _write_module_adapter(src, work, verify)
    if src.lora["trainable"] != "lora":
        raise ExportError("--form adapter", "this run fine-tuned the full transformer (lora.trainable='full'), so "
                          "it has no adapter", "export it with --form merged")
    # flowforge's checkpoint keys drop the adapter name exactly as peft's get_peft_model_state_dict does
    _lora_pipeline(src).save_lora_weights(str(work), transformer_lora_layers=lora_layers(src),
                                          transformer_lora_adapter_metadata=peft_config(src.lora).to_dict(),
                                          weight_name=LORA_WEIGHT_NAME, safe_serialization=True)
    # peft's own layout, so PeftModel.from_pretrained(transformer, OUT) loads it without diffusers' loader
    write_peft_adapter(src, work, base_name(src))
    carry_demo_base(src, work)
    if not verify:
        return None
    transformer_dir, _ = layout(require_base(src, "verifying an adapter export"))
    policy = _trained_policy(src, transformer_dir)
    inputs = _probe_inputs(src.adapter, policy.config)
    v_trained, base_diff = trained_velocity(policy, lambda p: _velocity(p, inputs), lora=True)
    del policy
    fresh = _load_transformer(transformer_dir)
    fresh.load_lora_adapter(str(work), prefix="transformer", weight_name=LORA_WEIGHT_NAME, adapter_name="export")
    return verify_report(_velocity(fresh.eval(), inputs), v_trained, base_diff, "adapter")


def carry_demo_base(src: Source, work: Path) -> None:
    """A demo-style base (a bare MiniLM-conditioned SD3 transformer, :func:`~flowforge.tools.export.card.is_demo_base`:
    ``demo:base`` and what was trained from it) has no diffusers pipeline anywhere, so an adapter export carries it as
    one in ``work/base/`` (the untrained transformer in ``base/transformer/``, MiniLM, scheduler, ``pipeline.py``):
    the card's loading code then needs nothing outside the export. Nothing is carried when the base is not here."""
    if src.base is None:
        return
    transformer_dir, is_pipeline = layout(src.base)
    if is_pipeline or not is_demo_base(transformer_dir, src.adapter):
        return
    check_base_identity(src.base, src.checkpoint.trainer_state.get("base_model_sha256"))
    carried = work / CARRIED_BASE
    (carried / "transformer").mkdir(parents=True)
    for name in ("config.json", FLOWFORGE_META, *sorted(p.name for p in transformer_dir.glob("*.safetensors"))):
        if (transformer_dir / name).is_file():
            shutil.copy2(transformer_dir / name, carried / "transformer" / name)
    drop_name_or_path(carried / "transformer" / "config.json")
    write_demo_pipeline(carried, transformer_dir, read_run_config(src.run_dir))


def card_snippet(src: Source, form: str, out: Path, work: Path) -> str:
    """The diffusers / peft loading code of the model card (:func:`flowforge.tools.export.card.loading_snippet`):
    every path relative to the export (``out`` is not written into it)."""
    if form == "adapter" and src.lora["trainable"] == "module":
        return ("import os\n\n" + OUT_LINE + "from safetensors.torch import load_file\n\n"
                f"transformer = ...  # the base transformer {base_name(src)!r}, e.g. <Class>.from_pretrained\n"
                "# exactly the trained submodules (every key must match: check the returned missing / unexpected)\n"
                f"transformer.load_state_dict(load_file(os.path.join(out, {MODULES_WEIGHT_NAME!r})), "
                "strict=False)\n")
    cls_name, base_layout = "SD3Transformer2DModel", "pipeline"
    if (work / CARRIED_BASE / "model_index.json").is_file():
        base_layout = "carried"
    elif src.base is not None:
        try:
            transformer_dir, is_pipeline = layout(src.base)
            cls_name, base_layout = transformer_class(transformer_dir).__name__, \
                "pipeline" if is_pipeline else "transformer"
        except ExportError:
            pass
    pipeline = None
    if form == "adapter":
        try:
            pipeline = _lora_pipeline(src).__name__
        except ExportError:
            pipeline = None
    elif (work / "model_index.json").is_file():
        name = json.loads((work / "model_index.json").read_text()).get("_class_name")
        pipeline = name if isinstance(name, str) else None
    kind = ("demo" if (work / PIPELINE_FILE).is_file() else "pipeline" if (work / "model_index.json").is_file()
            else "transformer")
    return loading_snippet(form, transformer_class=cls_name, base=base_name(src), pipeline=pipeline,
                           layout_kind=kind, base_layout=base_layout)
