"""The diffusers writer of :func:`flowforge.tools.export.export_run`: a merged diffusers transformer / pipeline, a
diffusers + peft LoRA, or a module run's trained tensors, for every diffusers family (the registered ones,
:data:`flowforge.tools.export.probes.PROBES`, and any ``pkg.module:Class`` adapter over a diffusers transformer).

The forms, layouts, loading and verification are described in :mod:`flowforge.tools.export` (this module is its
diffusers half; the world model's is :mod:`flowforge.tools.export.world`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from flowforge.models.registry import FAMILIES
from flowforge.models.base import Conditioning
from flowforge.models.common import FLOWFORGE_META
from flowforge.runtime.errors import one_line
from flowforge.tools.export.card import (CARRIED_BASE, OUT_LINE, PIPELINE_FILE, is_demo_base, loading_snippet,
                                         write_demo_pipeline)
from flowforge.tools.export.out import ExportError
from flowforge.tools.export.portable import drop_name_or_path
from flowforge.tools.export.probes import PROBES, family_adapter, probe_inputs
from flowforge.tools.export.source import (Source, base_name, check_base_identity, layout,
                                           read_run_config, require_base, transformer_class)
from flowforge.tools.export.verify import VerifyReport, trained_velocity, verify_report
from flowforge.tools.export.weights import (MODULES_WEIGHT_NAME, apply_trained, lora_layers, peft_config,
                                            write_module_adapter, write_peft_adapter)

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
    seeded conditioning)`` (:mod:`flowforge.tools.export.probes`).

    Raises:
        ExportError: ``adapter`` is not a registered family (nothing says how to call its transformer).
    """
    if adapter not in PROBES:
        raise ExportError("--verify", f"needs a registered model family, and model.adapter={adapter!r} is not one",
                          f"drop --verify to export unverified; verifiable: {list(PROBES)}")
    return probe_inputs(adapter, config)


@torch.no_grad()
def _velocity(transformer: nn.Module, inputs) -> torch.Tensor:
    adapter, x, sigma, cond = inputs
    return family_adapter(adapter, transformer).velocity(x, sigma, cond, 1.0)


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
    (``model_index.json`` ``_class_name``) when it has one, else the family's (its adapter class's
    spec's :attr:`~flowforge.models.family.Family.export_pipeline`); ``None`` when the family declares that none of
    its pipelines has a LoRA loader."""
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
    if src.adapter in PROBES:
        family_pipeline = FAMILIES[src.adapter].export_pipeline
        return None if family_pipeline is None else getattr(diffusers, family_pipeline)
    raise ExportError(f"model.adapter={src.adapter!r}", "no diffusers pipeline with save_lora_weights is known for "
                      f"it (base model_index.json names {name!r})", "export it with --form merged")


def _save_lora_weights(src: Source, work: Path) -> None:
    """``work/pytorch_lora_weights.safetensors`` in diffusers' LoRA format: written by the pipeline's
    ``save_lora_weights`` (:func:`_lora_pipeline`), or, for a family none of whose pipelines has a LoRA loader, by
    the two steps every pipeline's ``save_lora_weights`` takes (``LoraBaseMixin.pack_weights`` under the
    ``transformer`` prefix, then ``write_lora_layers`` with the ``LoraConfig`` as metadata): the same file, which
    ``<Transformer>.load_lora_adapter`` loads."""
    from diffusers.loaders.lora_base import LoraBaseMixin

    # flowforge's checkpoint keys drop the adapter name exactly as peft's get_peft_model_state_dict does
    layers, metadata = lora_layers(src), peft_config(src.lora).to_dict()
    pipeline = _lora_pipeline(src)
    if pipeline is not None:
        pipeline.save_lora_weights(str(work), transformer_lora_layers=layers,
                                   transformer_lora_adapter_metadata=metadata, weight_name=LORA_WEIGHT_NAME,
                                   safe_serialization=True)
        return
    LoraBaseMixin.write_lora_layers(state_dict=LoraBaseMixin.pack_weights(layers, "transformer"),
                                    save_directory=str(work), is_main_process=True, weight_name=LORA_WEIGHT_NAME,
                                    save_function=None, safe_serialization=True,
                                    lora_adapter_metadata=LoraBaseMixin.pack_weights(metadata, "transformer"))


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
    _save_lora_weights(src, work)
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
            found = _lora_pipeline(src)
        except ExportError:
            found = None
        pipeline = None if found is None else found.__name__
    elif (work / "model_index.json").is_file():
        name = json.loads((work / "model_index.json").read_text()).get("_class_name")
        pipeline = name if isinstance(name, str) else None
    kind = ("demo" if (work / PIPELINE_FILE).is_file() else "pipeline" if (work / "model_index.json").is_file()
            else "transformer")
    return loading_snippet(form, transformer_class=cls_name, base=base_name(src), pipeline=pipeline,
                           layout_kind=kind, base_layout=base_layout)
