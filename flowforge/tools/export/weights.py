"""The family-independent weight files of an ``adapter`` export: a peft LoRA, or exactly the trained submodules.

======================================  ===========================================================================
file                                    content
======================================  ===========================================================================
``adapter_model.safetensors``           a LoRA run (``lora.trainable: lora``): peft's own layout, keys
(+ ``adapter_config.json``)             ``base_model.model.<module>.lora_A.weight`` (fp32) and the peft
                                        ``LoraConfig`` (``r``, ``lora_alpha``, ``target_modules``,
                                        ``base_model_name_or_path``): ``PeftModel.from_pretrained(model, OUT)``
``trained_modules.safetensors``         a module run (``lora.trainable: module``): every tensor the checkpoint
                                        holds for the trained submodules, under its full state-dict name in the
                                        base model (``latent_state_rollout.transition.delta.weight``), in the
                                        checkpoint's dtype; nothing else
``trained_modules.json``                what that file holds: ``format`` (``flowforge-trained-modules``),
                                        ``version`` 1, ``modules`` (exact submodule paths), ``base_model`` and its
                                        ``base_model_sha256``, ``tensors`` (name -> ``shape``, ``dtype``) and
                                        ``load`` (how to apply it)
======================================  ===========================================================================

A ``module+lora`` run (submodules in full and LoRA together) writes both: ``trained_modules.*`` for its submodules'
tensors and ``adapter_model.safetensors`` + ``adapter_config.json`` for its LoRA (:func:`split_module_lora` splits
the checkpoint's tensors by key: those under a trained submodule's path, and the LoRA weights).

A module export is applied to the base it was trained from with ``model.load_state_dict(tensors, strict=False)``:
``strict=False`` because the file holds the trained submodules only, and :func:`overlay` checks that every name it
holds is one of the model's (so nothing is silently ignored). :func:`write_module_adapter` writes it and, with
``verify``, compares a fresh base + the written file with the base + the checkpoint's tensors.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from flowforge.runtime.errors import UserError, file_error
from flowforge.tools.export.out import ExportError
from flowforge.tools.export.source import Source
from flowforge.tools.export.verify import VerifyReport, verify_report

PEFT_WEIGHT_NAME = "adapter_model.safetensors"  # peft's own adapter file (PeftModel.save_pretrained)
PEFT_PREFIX = "base_model.model."
MODULES_WEIGHT_NAME = "trained_modules.safetensors"
MODULES_META_NAME = "trained_modules.json"
MODULES_FORMAT = "flowforge-trained-modules"


def peft_config(lora: Mapping, base_name: str | None = None):
    """The peft ``LoraConfig`` of LoRA contract ``lora`` (rank, alpha, targets; dropout 0, no bias)."""
    from peft import LoraConfig

    cfg = LoraConfig(r=int(lora["rank"]), lora_alpha=float(lora["alpha"]), target_modules=list(lora["targets"]),
                     lora_dropout=0.0, bias="none", init_lora_weights=True)
    if base_name is not None:
        cfg.base_model_name_or_path = base_name
    return cfg


def split_module_lora(src: Source) -> tuple[Source, Source]:
    """A ``module+lora`` run as ``(its module part, its LoRA part)``: ``src`` with the weights under a trained
    submodule's path (``lora = {"trainable": "module", "modules", "dropout"}``) and with the rest, the LoRA weights
    (``lora = {"trainable": "lora", "rank", "alpha", "targets", "dropout"}``). The parts are disjoint (a trained
    submodule holds no LoRA layer: :func:`flowforge.models.trained_parts.check_disjoint`).

    Raises:
        ValueError: ``src`` is not a ``module+lora`` run.
    """
    lora = src.lora
    if lora["trainable"] != "module+lora":
        raise ValueError(f"lora.trainable={lora['trainable']!r} is not a module+lora run")
    prefixes = tuple(m + "." for m in lora["modules"])
    modules = {k: v for k, v in src.weights.items() if k.startswith(prefixes)}
    rest = {k: v for k, v in src.weights.items() if k not in modules}
    common = {"dropout": lora.get("dropout", 0.0)}
    return (dataclasses.replace(src, weights=modules, lora={**common, "trainable": "module",
                                                            "modules": list(lora["modules"])}),
            dataclasses.replace(src, weights=rest, lora={**common, "trainable": "lora", "rank": lora["rank"],
                                                         "alpha": lora["alpha"], "targets": list(lora["targets"])}))


def lora_layers(src: Source) -> dict[str, torch.Tensor]:
    """The checkpoint's LoRA weights, fp32, sorted; keys without the adapter name (peft's
    ``get_peft_model_state_dict`` keys)."""
    return {k: v.detach().float().contiguous() for k, v in sorted(src.weights.items())}


def write_peft_adapter(src: Source, work: Path, base_name: str) -> None:
    """``work/adapter_model.safetensors`` + ``work/adapter_config.json`` of LoRA run ``src`` (module table)."""
    from safetensors.torch import save_file

    save_file({PEFT_PREFIX + k: v for k, v in lora_layers(src).items()}, str(work / PEFT_WEIGHT_NAME),
              metadata={"format": "pt"})
    peft_config(src.lora, base_name).save_pretrained(str(work))


def write_trained_modules(src: Source, work: Path, base_name: str) -> None:
    """``work/trained_modules.safetensors`` + ``work/trained_modules.json`` of module run ``src`` (module table)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(src.weights.items())}
    modules = sorted(src.lora["modules"])
    save_file(tensors, str(work / MODULES_WEIGHT_NAME), metadata={"format": "pt", "flowforge_modules":
                                                                   json.dumps(modules)})
    meta = {"format": MODULES_FORMAT, "version": 1, "modules": modules, "base_model": base_name,
            "base_model_sha256": src.checkpoint.trainer_state.get("base_model_sha256"),
            "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                        for k, v in tensors.items()},
            "load": f"model.load_state_dict(safetensors.torch.load_file('{MODULES_WEIGHT_NAME}'), strict=False) on "
                    "the base model: replaces exactly these tensors"}
    (work / MODULES_META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_trained_modules(out: Path) -> dict[str, torch.Tensor]:
    """The tensors of a module export ``out`` (:data:`MODULES_WEIGHT_NAME`), checked against its
    :data:`MODULES_META_NAME`.

    Raises:
        UserError: either file is missing, unreadable, or they disagree (names or shapes).
    """
    from safetensors.torch import load_file

    meta_file, weights_file = out / MODULES_META_NAME, out / MODULES_WEIGHT_NAME
    try:
        meta = json.loads(meta_file.read_text())
        listed = {k: tuple(v["shape"]) for k, v in meta["tensors"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise file_error(meta_file, exc, "export the run again with --form adapter") from exc
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for a damaged header
        raise file_error(weights_file, exc, "export the run again with --form adapter") from exc
    if {k: tuple(v.shape) for k, v in tensors.items()} != listed:
        raise UserError(weights_file, f"does not hold the tensors {MODULES_META_NAME} lists", "export the run again")
    return tensors


@torch.no_grad()
def apply_trained(src: Source, model: nn.Module) -> None:
    """The checkpoint's trained weights into ``model`` (its base, built from the run's base) in place, by contract:
    ``lora``: peft LoRA layers injected on ``targets`` and loaded; ``module`` / ``full``: the tensors loaded by name
    (``strict=False``: a module run holds its submodules only, a sharded FSDP checkpoint parameters only, the rest
    stays the base's); ``module+lora``: both (:func:`split_module_lora`; a trained submodule holds no LoRA layer, so
    the order does not matter). The weights are assumed to fit
    (:func:`~flowforge.tools.export.contract.check_contract`).
    """
    from flowforge.models import lora as lora_lib

    if src.lora["trainable"] == "module+lora":
        for part in split_module_lora(src):
            apply_trained(part, model)
    elif src.lora["trainable"] == "lora":
        lora_lib.inject_lora(model, int(src.lora["rank"]), float(src.lora["alpha"]), list(src.lora["targets"]))
        lora_lib.load_lora_state_dict(model, src.weights)
    else:
        model.load_state_dict(dict(src.weights), strict=False)


def overlay(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (full state-dict names) into ``model`` in place; every other weight stays as it was.

    Raises:
        ValueError: a name that is not in ``model``'s state dict, or a shape that differs (the first one named).
    """
    state = model.state_dict()
    for key in sorted(tensors):
        if key not in state:
            raise ValueError(f"tensor {key!r} is not a weight of {type(model).__name__}")
        if tuple(tensors[key].shape) != tuple(state[key].shape):
            raise ValueError(f"tensor {key!r} has shape {tuple(tensors[key].shape)}, the model's is "
                             f"{tuple(state[key].shape)}")
    model.load_state_dict(dict(tensors), strict=False)


def write_module_adapter(src: Source, work: Path, verify: bool, *, base_name: str,
                         load_base: Callable[[], nn.Module] | None,
                         velocity: Callable[[nn.Module], torch.Tensor] | None) -> VerifyReport | None:
    """The adapter form of module run ``src`` into ``work``; with ``verify``, the velocity of a fresh base
    (``load_base()``, fp32) with the written file applied against the base with the checkpoint's tensors
    (``velocity(model)``: the family's, on fixed inputs), tolerance ``full``; ``base_diff`` = what training changed.

    Raises:
        ExportError: ``src`` is not a module run; ``verify`` without ``load_base`` / ``velocity``.
    """
    if src.lora["trainable"] != "module":
        raise ExportError("--form adapter", f"lora.trainable={src.lora['trainable']!r} is not a module run",
                          "export it with --form merged")
    write_trained_modules(src, work, base_name)
    if not verify:
        return None
    if load_base is None or velocity is None:
        raise ExportError("--verify", f"model.adapter={src.adapter!r} has no verifiable family",
                          "drop --verify to export unverified")
    model = load_base()
    v_base = velocity(model)
    overlay(model, src.weights)
    v_trained = velocity(model)
    del model
    fresh = load_base()
    overlay(fresh, read_trained_modules(work))
    return verify_report(velocity(fresh), v_trained, float((v_trained - v_base).abs().max()), "full")
