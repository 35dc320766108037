"""Loading for ``flowforge sample``: a run directory or an export as a model ready to sample, with the run config it
was trained with (the table of :mod:`flowforge.tools.sample`, "What is loaded")."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowforge.config import Config, load_config
from flowforge.demo.paths import resolve_demo_path
from flowforge.models import build_adapter
from flowforge.models import lora as lora_lib
from flowforge.models.base import FlowModel
from flowforge.runtime.dtypes import resolve_dtype
from flowforge.runtime.errors import UserError, file_error
from flowforge.tools.export.contract import check_contract
from flowforge.tools.export.diffusers import LORA_WEIGHT_NAME
from flowforge.tools.export.out import EXPORT_META
from flowforge.tools.export.portable import resolve_base_ref
from flowforge.tools.export.source import (check_base_identity, layout, load_source, pick_checkpoint,
                                           read_run_config)
from flowforge.tools.export.weights import PEFT_WEIGHT_NAME, apply_trained, overlay, read_trained_modules

log = logging.getLogger("flowforge")


@dataclass
class SampleModel:
    """A loaded model ready to sample, and the run config it was trained with."""

    adapter: FlowModel
    cfg: Config  # the run's config (model, sampler sections are used)
    source: str  # what was loaded, for logs and the sidecar


def _pick_device(cfg: Config, device: str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    wanted = cfg.run.device
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        log.warning("the run used device %s, which is not available here: sampling on cpu", wanted)
        return torch.device("cpu")
    return torch.device(wanted)


def _build(cfg: Config, path: str | Path, device: torch.device) -> FlowModel:
    m = cfg.model
    adapter = build_adapter(m.adapter, resolve_demo_path(str(path)), task=m.task,
                            dtype=resolve_dtype(m.dtype, key="model.dtype"), device=device)
    adapter.transformer.requires_grad_(False).eval()
    return adapter


def _load_run(run_dir: Path, device: str | None, base: str | None) -> SampleModel:
    """The run's base with its newest committed checkpoint's live weights (module table)."""
    cfg = read_run_config(run_dir)
    path = pick_checkpoint(run_dir, None)
    model_path = str(base if base is not None else cfg.model.path)
    base_dir = Path(resolve_demo_path(model_path))
    src = load_source(run_dir, cfg, path, "live", model_path, base_dir if base_dir.exists() else None)
    if src.base is None:
        raise UserError(f"model.path {model_path!r} of {run_dir / 'config.yaml'}", "the base model is not here",
                        "pass the base model directory with --base PATH")
    check_base_identity(src.base, src.checkpoint.trainer_state.get("base_model_sha256"))
    check_contract(src, layout(src.base)[0])
    adapter = _build(cfg, src.base, _pick_device(cfg, device))
    apply_trained(src, adapter.transformer)
    adapter.transformer.requires_grad_(False).eval()
    return SampleModel(adapter, cfg, f"run {run_dir} checkpoint {path.name} (live weights)")


def _export_config(out: Path, meta: dict) -> Config:
    """The config of the run an export came from (module docstring)."""
    own = out / "config.yaml"
    candidates = [own] if own.is_file() else []
    run_dir = meta.get("run_dir")  # relative to the export (absolute in exports before issue 27)
    if isinstance(run_dir, str) and (out / run_dir / "config.yaml").is_file():
        candidates.append(out / run_dir / "config.yaml")
    if not candidates:
        raise UserError(out, f"has no config.yaml and the run it came from ({run_dir}) has none either, so the "
                        "model family and sampler settings are unknown", "copy the run's config.yaml into it")
    return load_config(candidates[0])


def _read_lora(out: Path) -> dict[str, torch.Tensor]:
    """The exported LoRA keyed as :func:`flowforge.models.lora.lora_state_dict` keys it."""
    for name, prefixes in ((LORA_WEIGHT_NAME, ("transformer.",)), (PEFT_WEIGHT_NAME, ("base_model.model.", ""))):
        path = out / name
        if path.is_file():
            try:
                state = load_file(str(path))
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for a damaged header
                raise file_error(path, exc, "export the run again") from exc
            prefix = next((p for p in prefixes if all(k.startswith(p) for k in state)), None)
            if prefix is None:
                raise UserError(path, f"holds keys outside the prefixes {list(prefixes)} (e.g. "
                                f"{next(iter(state), '')!r}): not a flowforge adapter export", "export the run again")
            return {k[len(prefix):]: v for k, v in state.items()}
    raise UserError(out, f"is an adapter export without {LORA_WEIGHT_NAME} or {PEFT_WEIGHT_NAME}",
                    "export the run again with --form adapter")


def _read_meta(out: Path) -> dict:
    try:
        return json.loads((out / EXPORT_META).read_text())
    except (OSError, ValueError) as exc:
        raise file_error(out / EXPORT_META, exc, "export the run again") from exc


def _load_export(out: Path, device: str | None, base: str | None) -> SampleModel:
    meta = _read_meta(out)
    cfg = _export_config(out, meta)
    dev = _pick_device(cfg, device)
    if meta.get("form") == "merged":
        return SampleModel(_build(cfg, out, dev), cfg, f"merged export {out}")
    lora = meta.get("lora") or {}
    if lora.get("trainable") not in ("lora", "module", "module+lora"):
        raise UserError(out / EXPORT_META, f"form {meta.get('form')!r} with LoRA contract {lora} is not an adapter "
                        "export", "export the run again")
    # the export names a local base relative to itself (tools.export.portable): found wherever the two were moved
    base_path = base if base is not None else resolve_base_ref(str(meta.get("base_model") or cfg.model.path), out)
    base_dir = Path(resolve_demo_path(str(base_path)))
    if base_dir.exists():  # a hub id cannot be hashed here; a local base must be the one the run trained from
        check_base_identity(base_dir, meta.get("base_model_sha256"))
    adapter = _build(cfg, base_path, dev)
    if lora["trainable"] in ("module", "module+lora"):  # exactly the trained submodules' tensors
        tensors = read_trained_modules(out)
        try:
            overlay(adapter.transformer, tensors)
        except ValueError as exc:
            raise UserError(out, f"does not fit base {base_path} ({exc})", "pass the trained-from base with --base") \
                from exc
    if lora["trainable"] in ("lora", "module+lora"):
        lora_lib.inject_lora(adapter.transformer, int(lora["rank"]), float(lora["alpha"]), list(lora["targets"]))
        lora_lib.load_lora_state_dict(adapter.transformer, _read_lora(out))
    adapter.transformer.requires_grad_(False).eval()
    return SampleModel(adapter, cfg, f"adapter export {out} on base {base_path}")


def load_for_sampling(source: str | Path, *, device: str | None = None, base: str | None = None) -> SampleModel:
    """Load a run directory or an export directory for sampling (module table).

    Args:
        source: a run directory (``config.yaml`` + committed checkpoints) or an export (``flowforge_export.json``).
        device: where to run (default: the run's ``run.device``; cpu when that is CUDA and none is available).
        base: the base model directory when it moved (a run, or an adapter export).

    Raises:
        UserError (a ``ValueError``; ``ExportError`` included): ``source`` is neither; no committed checkpoint; a
            damaged file (named); a missing base; weights that do not fit the run's LoRA contract.
    """
    source = Path(source)
    if (source / EXPORT_META).is_file():
        return _load_export(source, device, base)
    if (source / "config.yaml").is_file():
        return _load_run(source, device, base)
    raise _neither(source)


def source_config(source: str | Path) -> Config:
    """The run config of run or export directory ``source`` (no model is loaded), as :func:`load_for_sampling`
    reads it.

    Raises:
        UserError: ``source`` is neither; its config is missing or invalid.
    """
    source = Path(source)
    if (source / EXPORT_META).is_file():
        return _export_config(source, _read_meta(source))
    if (source / "config.yaml").is_file():
        return read_run_config(source)
    raise _neither(source)


def _neither(source: Path) -> UserError:
    return UserError(source, "is neither a run directory (config.yaml) nor a flowforge export (flowforge_export.json)",
                     "give the directory `flowforge train` or `flowforge export` wrote")
