"""Loading for ``flowforge sample``: a run directory or an export as a model ready to sample, with the run config it
was trained with (the table of :mod:`flowforge.tools.sample`, "What is loaded")."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowforge.config import Config, load_config, replace
from flowforge.demo.paths import DEMO_BASE, DEMO_WORLD, is_demo_name, resolve_demo_path
from flowforge.models import build_adapter, configure_sampling, looks_like_hub_id
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
    configure_sampling(adapter, cfg.sampler)  # before any encoding, as the trainer
    adapter.transformer.requires_grad_(False).eval()
    return adapter


DEMO_BASES: dict[str, dict[str, dict]] = {
    DEMO_BASE: {"data": {"eval_prompts": "demo:eval"}},
    DEMO_WORLD: {"model": {"adapter": "world_model", "task": "i2v", "frames": 8},
                 "data": {"prompts": "demo:world-train", "eval_prompts": "demo:world-eval"}},
}
"""The settings a shipped base samples with (over the config defaults: ``sd3`` at 32x32, 10 steps, shift 3,
guidance 1), as its examples train it (``examples/digits/``, ``examples/worldmodel/``)."""


def _base_config(source: str, config: str | Path | None) -> Config:
    """The settings of base model ``source``: ``config``'s (a training config; ``model.path`` replaced by
    ``source``), else a shipped base's (:data:`DEMO_BASES`).

    Raises:
        UserError: another base without ``config``; a ``config`` that does not load.
    """
    if config is not None:
        return replace(load_config(config), model={"path": str(source)})
    if source in DEMO_BASES:
        sections = {name: dict(keys) for name, keys in DEMO_BASES[source].items()}
        sections.setdefault("model", {})["path"] = source
        return replace(load_config(None), **sections)
    raise UserError(source, "is a base model, whose family, resolution and sampler settings it does not record",
                    "pass --config FILE, a training config for it (its model and sampler sections are used, "
                    "model.path replaced by this base)")


def _is_base(source: str | Path) -> bool:
    """A demo model name, a Hub id, or a directory holding a model (not a run or an export)."""
    text = str(source)
    if is_demo_name(text):
        return text in (DEMO_BASE, DEMO_WORLD)
    path = Path(source)
    if path.is_dir():
        return any((path / f).is_file() for f in ("model_index.json", "config.json"))
    return looks_like_hub_id(text)


def _load_run(run_dir: Path, device: str | None, base: str | None, cfg: Config) -> SampleModel:
    """The run's base with its newest committed checkpoint's weights (module table: the EMA when the run kept one,
    else live); ``cfg``: the run's config (:func:`source_config`)."""
    path = pick_checkpoint(run_dir, None)
    model_path = str(base if base is not None else cfg.model.path)
    base_dir = Path(resolve_demo_path(model_path))
    # the weights the run's evals measured (EMA when it kept one), as export picks them
    src = load_source(run_dir, cfg, path, None, model_path, base_dir if base_dir.exists() else None)
    if src.base is None:
        raise UserError(f"model.path {model_path!r} of {run_dir / 'config.yaml'}", "the base model is not here",
                        "pass the base model directory with --base PATH")
    check_base_identity(src.base, src.checkpoint.trainer_state.get("base_model_sha256"))
    check_contract(src, layout(src.base)[0])
    adapter = _build(cfg, src.base, _pick_device(cfg, device))
    apply_trained(src, adapter.transformer)
    adapter.transformer.requires_grad_(False).eval()
    return SampleModel(adapter, cfg, f"run {run_dir} checkpoint {path.name} ({src.weights_group} weights)")


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


def _load_export(out: Path, device: str | None, base: str | None, cfg: Config) -> SampleModel:
    meta = _read_meta(out)
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


def load_for_sampling(source: str | Path, *, device: str | None = None, base: str | None = None,
                      config: str | Path | None = None, negative_prompt: str | None = None) -> SampleModel:
    """Load a run directory, an export directory or a base model for sampling (module table).

    Args:
        source: a run directory (``config.yaml`` + committed checkpoints), an export (``flowforge_export.json``),
            or a base model: ``demo:base`` / ``demo:world``, or a model directory or Hub id with ``config``.
        device: where to run (default: the run's ``run.device``; cpu when that is CUDA and none is available).
        base: the base model directory when it moved (a run, or an adapter export).
        config: a training config giving a base model's settings (model and sampler sections).
        negative_prompt: CFG's unconditional prompt, over the config's ``sampler.negative_prompt``.

    Raises:
        UserError (a ``ValueError``; ``ExportError`` included): ``source`` is none of these; no committed
            checkpoint; a damaged file (named); a missing base; weights that do not fit the run's LoRA contract;
            ``config`` / ``base`` given where they do not apply.
    """
    cfg = source_config(source, config=config, base=base)
    if negative_prompt is not None:
        cfg = replace(cfg, sampler={"negative_prompt": negative_prompt})
    path = Path(source)
    if (path / EXPORT_META).is_file():
        return _load_export(path, device, base, cfg)
    if (path / "config.yaml").is_file():
        return _load_run(path, device, base, cfg)
    return SampleModel(_build(cfg, cfg.model.path, _pick_device(cfg, device)), cfg, f"base model {source}")


def source_config(source: str | Path, *, config: str | Path | None = None, base: str | None = None) -> Config:
    """The config :func:`load_for_sampling` samples ``source`` with (no model is loaded): a run's or an export's
    run config, or a base model's settings (``config``'s, or a shipped base's).

    Raises:
        UserError: ``source`` is none of these; its config is missing or invalid; ``config`` for a run or an
            export (they have theirs), ``base`` for a base model (it is the source).
    """
    path = Path(source)
    trained = (path / EXPORT_META).is_file() or (path / "config.yaml").is_file()
    if trained and config is not None:
        raise UserError("--config", f"{source} is a run or an export, which samples with its own run config",
                        "drop --config (use --guidance / --steps / --negative-prompt to change the sampler)")
    if (path / EXPORT_META).is_file():
        return _export_config(path, _read_meta(path))
    if (path / "config.yaml").is_file():
        return read_run_config(path)
    if _is_base(source):
        if base is not None:
            raise UserError("--base", f"applies to a run or an export, and {source} is a base model",
                            "drop --base: the base is the source")
        return _base_config(str(source), config)
    raise _neither(path)


def _neither(source: Path) -> UserError:
    return UserError(source, "is neither a run directory (config.yaml), a flowforge export (flowforge_export.json) "
                     "nor a base model (demo:base, demo:world, a model directory or Hub id with --config)",
                     "give the directory `flowforge train` or `flowforge export` wrote, or a base model")
