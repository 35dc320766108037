"""The export writer of a two-expert Wan 2.2 A14B run (:mod:`flowforge.models.wan.experts`): both experts, always.

A base pipeline directory with ``transformer_2/`` (and ``model_index.json`` ``boundary_ratio``) trains a
``WanExperts`` module whose checkpoint keys start ``transformer.`` (high-noise expert) or ``transformer_2.``
(low-noise). :func:`flowforge.tools.export.export_run` sends such a run here (:func:`is_two_expert_base`).

==========  ===========================================================================================================
form        what is written
==========  ===========================================================================================================
merged      ``OUT/transformer/`` and ``OUT/transformer_2/`` (each expert with its LoRA folded in, ``W + (alpha / rank)
            B A``, or its fine-tuned weights; ``save_pretrained``, fp32) plus copies of every other component, the
            ``model_index.json`` with its ``boundary_ratio`` included: ``WanPipeline.from_pretrained(OUT)``.
adapter     per trained expert, a diffusers LoRA file written by ``WanPipeline.save_lora_weights`` (keys
            ``transformer.<module>...``, the peft config as metadata): ``pytorch_lora_weights.safetensors`` (high
            noise) and ``pytorch_lora_weights_transformer_2.safetensors`` (low noise), loaded with
            ``pipe.load_lora_weights(OUT, weight_name=...)`` and, for the second,
            ``load_into_transformer_2=True`` (diffusers' Wan LoRA loader). An expert without LoRA gets no file.
==========  ===========================================================================================================

Verification (``--verify``) probes both experts: ``sigma = [boundary_ratio / 2, (1 + boundary_ratio) / 2]`` (one
row per expert), otherwise the diffusers writer's probe and tolerances (:mod:`flowforge.tools.export`). Module runs
(``lora.trainable: module`` / ``module+lora``) of a two-expert base are refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from flowforge.models import lora as lora_lib
from flowforge.models.wan.experts import EXPERTS, WanExperts, load_wan_experts
from flowforge.tools.export.card import OUT_LINE, base_expr
from flowforge.tools.export.out import ExportError
from flowforge.tools.export.portable import drop_name_or_path
from flowforge.tools.export.source import Source, base_name, require_base
from flowforge.tools.export.verify import VerifyReport, trained_velocity, verify_report
from flowforge.tools.export.weights import apply_trained, lora_layers, peft_config

LORA_FILES = {"transformer": "pytorch_lora_weights.safetensors",
              "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}
"""Expert -> the adapter export's diffusers LoRA file."""


def is_two_expert_base(base: Path | None) -> bool:
    """Whether ``base`` is a two-expert Wan pipeline directory (``transformer_2/config.json``)."""
    return base is not None and (Path(base) / "transformer_2" / "config.json").is_file()


def _index(base: Path) -> dict:
    return json.loads((base / "model_index.json").read_text())


def meta_experts(base: Path) -> WanExperts:
    """Both experts of ``base`` built from their configs on the ``meta`` device (the contract check's model)."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        experts = [WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(str(base / name)))
                   for name in EXPERTS]
    return WanExperts(*experts, boundary_ratio=float(_index(base).get("boundary_ratio") or 0.5))


def _load(base: Path) -> WanExperts:
    try:
        return load_wan_experts(base, _index(base), dtype=torch.float32, device="cpu").requires_grad_(False).eval()
    except (OSError, ValueError, RuntimeError) as exc:
        raise ExportError(base, f"cannot be loaded as a two-expert Wan pipeline ({type(exc).__name__}: {exc})",
                          "restore the base model's files") from exc


def _probe(experts: WanExperts):
    from flowforge.tools.export.diffusers import _probe_inputs

    adapter, x, _, cond = _probe_inputs("wan", experts.config)
    r = experts.boundary_ratio
    return adapter, x, torch.tensor([r / 2.0, (1.0 + r) / 2.0]), cond


@torch.no_grad()
def _velocity(experts: WanExperts, inputs) -> torch.Tensor:
    from flowforge.models.wan.adapter import WanAdapter

    _, x, sigma, cond = inputs
    cfg = experts.config
    adapter = WanAdapter(experts, task="i2v" if cfg.in_channels != cfg.out_channels else "t2v")
    return adapter.velocity(x, sigma, cond, 1.0)


def _refuse_modules(src: Source) -> None:
    if src.lora["trainable"] not in ("lora", "full"):
        raise ExportError("model.path", f"lora.trainable={src.lora['trainable']!r} runs of a two-expert Wan base "
                          "cannot be exported", "train it with lora.trainable='lora' or 'full' to export it")


def write_merged(src: Source, work: Path, verify: bool) -> VerifyReport | None:
    _refuse_modules(src)
    base = require_base(src, "a merged export of a two-expert Wan run")
    policy = _load(base)
    apply_trained(src, policy)
    inputs = _probe(policy) if verify else None
    is_lora = src.lora["trainable"] == "lora"
    v_trained, base_diff = (trained_velocity(policy, lambda p: _velocity(p, inputs), is_lora) if verify
                            else (None, None))
    if is_lora:
        lora_lib.merge_lora(policy)
    for name in EXPERTS:
        getattr(policy, name).save_pretrained(str(work / name), safe_serialization=True)
        drop_name_or_path(work / name / "config.json")  # the base's directory on this machine otherwise
    for entry in sorted(base.iterdir()):
        if entry.name in EXPERTS or entry.name.startswith("."):
            continue
        (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, work / entry.name)
    del policy
    if not verify:
        return None
    kind = "merged" if src.lora["trainable"] == "lora" else "full"
    return verify_report(_velocity(_load(work), inputs), v_trained, base_diff, kind)


def _expert_targets(targets: list[str], name: str) -> list[str]:
    """``lora.targets`` as seen from inside expert ``name``: its prefixed full names without the prefix, plain
    suffixes as they are, the other expert's names dropped."""
    other = [e for e in EXPERTS if e != name]
    out = []
    for t in targets:
        if t.startswith(name + "."):
            out.append(t[len(name) + 1:])
        elif not any(t.startswith(o + ".") for o in other):
            out.append(t)
    return out


def write_adapter(src: Source, work: Path, verify: bool) -> VerifyReport | None:
    from diffusers import WanPipeline

    if src.lora["trainable"] != "lora":
        raise ExportError("--form adapter", f"this two-expert run has lora.trainable={src.lora['trainable']!r}, so "
                          "it has no LoRA adapter", "export it with --form merged")
    layers = lora_layers(src)
    for name in EXPERTS:
        part = {k[len(name) + 1:]: v for k, v in layers.items() if k.startswith(name + ".")}
        if not part:
            continue
        config = peft_config({**src.lora, "targets": _expert_targets(list(src.lora["targets"]), name)})
        WanPipeline.save_lora_weights(str(work), transformer_lora_layers=part,
                                      transformer_lora_adapter_metadata=config.to_dict(),
                                      weight_name=LORA_FILES[name], safe_serialization=True)
    if not verify:
        return None
    base = require_base(src, "verifying an adapter export")
    policy = _load(base)
    apply_trained(src, policy)
    inputs = _probe(policy)
    v_trained, base_diff = trained_velocity(policy, lambda p: _velocity(p, inputs), lora=True)
    fresh = _load(base)
    for name in EXPERTS:
        if (work / LORA_FILES[name]).is_file():
            getattr(fresh, name).load_lora_adapter(str(work), prefix="transformer", weight_name=LORA_FILES[name],
                                                   adapter_name="export")
    return verify_report(_velocity(fresh.eval(), inputs), v_trained, base_diff, "adapter")


def loading_snippet(src: Source, form: str, out: Path, work: Path) -> str:
    """The model card's loading code: every path relative to the export (``out`` is not written into it), the base
    as the export names it (:func:`~flowforge.tools.export.card.base_expr`)."""
    head = "import os\n\n" + OUT_LINE + "from diffusers import WanPipeline\n\n"
    if form == "merged":
        return head + "pipe = WanPipeline.from_pretrained(out)\n"
    lines = [head + f"base = {base_expr(base_name(src))}", "pipe = WanPipeline.from_pretrained(base)"]
    for name in EXPERTS:
        if (work / LORA_FILES[name]).is_file():
            extra = ", load_into_transformer_2=True" if name == "transformer_2" else ""
            lines.append(f"pipe.load_lora_weights(out, weight_name={LORA_FILES[name]!r}{extra})")
    return "\n".join(lines) + "\n"
