"""What an export reads: the run's config, one committed checkpoint, its weights and its base model.

A damaged checkpoint file gives an :class:`~flowforge.tools.export.out.ExportError` naming that file instead of the
reader's own message (a garbage ``trainer_state.json`` -> ``not valid JSON (... at line 1 column 1)``; a zeroed
``optimizer.pt`` -> ``not a torch.save archive``; a changed file -> its sha256 against the manifest's); the reading
is :func:`flowforge.train.checkpoint.load_checkpoint`'s, shared with resume. Whether the weights are the ones the
run's contract names is :func:`flowforge.tools.export.contract.check_contract`'s.

Exportable families: the diffusers ones (:data:`SUPPORTED_ADAPTERS`, or a ``pkg.module:Class`` adapter over a
diffusers transformer) and those with a format of their own (:data:`flowforge.models.OWN_FORMAT_FAMILIES`: the world
model). The trained weights of every contract (``lora``, ``module``, ``full``, ``module+lora``) are read the same way.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from flowforge.config import ConfigError, load_config
from flowforge.models import OWN_FORMAT_FAMILIES
from flowforge.runtime.errors import UserError, file_error, one_line
from flowforge.runtime.run_dir import sha256_of_path
from flowforge.tools.export.out import ExportError
from flowforge.tools.export.probes import PROBES
from flowforge.train import checkpoint as ckpt

SUPPORTED_ADAPTERS = tuple(PROBES)
"""Registered diffusers families: export writes diffusers files for them and can verify them (each has a
verification probe, :data:`flowforge.tools.export.probes.PROBES`)."""
TRAINABLE = ("lora", "module", "full", "module+lora")


@dataclass(frozen=True)
class Source:
    """The run being exported: its checkpoint and the weights chosen from it."""

    run_dir: Path
    checkpoint: ckpt.Checkpoint
    weights: dict[str, torch.Tensor]  # name -> tensor (LoRA keys without the adapter name, the trained submodules'
    # entries under full names, or the full state dict)
    weights_file: Path  # where ``weights`` were read from (a safetensors file or the sharded dcp/ directory)
    lora: dict  # trainer_state["lora"]: trainable, dropout; rank, alpha, targets (lora); modules (module); all
    # of them (module+lora)
    model_path: str  # model.path of the run's config, or --base
    base: Path | None  # local base directory (None: not found locally)
    adapter: str  # model.adapter of the run's config (a registered family or "pkg.module:Class")
    base_ref: str | None = None  # how an export's files name the base (tools.export.portable.base_ref)
    weights_group: str = "live"  # which weights ``weights`` are: live / ema / old


def _as_export_error(path: Path, exc: BaseException, fix: str) -> ExportError:
    err = file_error(path, exc, fix)
    return ExportError(err.what, err.why, err.fix)


def read_run_config(run_dir: Path):
    """The run's resolved config (``run_dir/config.yaml``); raises ExportError naming the file when it is absent,
    unreadable or invalid, or names a model family export cannot handle."""
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise ExportError(run_dir, "has no config.yaml, so it is not a flowforge run directory",
                          "give the directory `flowforge train` wrote (runs/<name>)")
    try:
        cfg = load_config(cfg_file)
    except ConfigError as exc:
        raise ExportError(cfg_file, f"is not a valid flowforge config ({one_line(str(exc))})",
                          "restore the run's config.yaml") from exc
    known = (*SUPPORTED_ADAPTERS, *OWN_FORMAT_FAMILIES)
    if cfg.model.adapter not in known and ":" not in cfg.model.adapter:
        raise ExportError(f"model.adapter={cfg.model.adapter!r} in {cfg_file}", "export cannot handle this family",
                          f"allowed: {list(known)} or a 'pkg.module:Class' adapter over a diffusers transformer")
    return cfg


def committed_steps(run_dir: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in ckpt.committed_checkpoints(run_dir)]


def pick_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint directory of ``step`` (``None``: the newest committed one)."""
    committed = ckpt.committed_checkpoints(run_dir)
    if step is None:
        if not committed:
            lost = ckpt.lost_progress(run_dir)
            if lost:
                raise ExportError(run_dir, lost, ckpt.no_checkpoint_fix(run_dir))
            raise ExportError(run_dir / ckpt.CHECKPOINTS_DIR, "holds no committed checkpoint",
                              "train with checkpoint.every > 0 (a run that ends saves one at its last step)")
        return committed[-1]
    path = run_dir / ckpt.CHECKPOINTS_DIR / ckpt.step_dir_name(step)
    if not ckpt.is_committed(path):
        raise ExportError(f"--step {step}", f"{path} is not a committed checkpoint",
                          f"committed steps: {committed_steps(run_dir)}")
    return path


def read_checkpoint(run_dir: Path, path: Path) -> ckpt.Checkpoint:
    """Load checkpoint ``path``; a missing, resized, changed (sha256) or unreadable file raises ExportError naming
    that file (:func:`flowforge.train.checkpoint.load_checkpoint` names it)."""
    fix = f"restore it, or export another committed step with --step N (committed: {committed_steps(run_dir)})"
    try:
        return ckpt.load_checkpoint(path, fix=fix)
    except UserError as exc:
        raise ExportError(exc.what, exc.why, exc.fix) from exc
    except (OSError, ValueError, RuntimeError) as exc:  # not committed (a race with a concurrent save)
        raise ExportError(path, f"cannot be loaded ({one_line(str(exc))})", fix) from exc


def load_source(run_dir: Path, cfg, path: Path, weights: str | None, model_path: str, base: Path | None) -> Source:
    """The checkpoint ``path`` of run ``run_dir`` with its ``weights`` group (``live`` / ``ema`` / ``old``);
    ``None``: the weights the run's held-out evals measured -- ``ema`` when the checkpoint holds an EMA (the run
    kept one: ``nft.ema_decay`` / ``grpo.ema_decay`` > 0, evaluated as flow_grpo and DiffusionNFT do), else ``live``."""
    state = read_checkpoint(run_dir, path)
    if weights is None:
        weights = "ema" if "ema" in state.tensors else "live"
    lora = state.trainer_state.get("lora")
    if not isinstance(lora, dict) or lora.get("trainable") not in TRAINABLE:
        raise ExportError(path / ckpt.TRAINER_STATE_FILE, "has no LoRA contract ('lora': {trainable, ...})",
                          "export a checkpoint written by `flowforge train`")
    needed = {"lora": ("rank", "alpha", "targets"), "module": ("modules",),
              "module+lora": ("rank", "alpha", "targets", "modules")}.get(lora["trainable"], ())
    absent = [k for k in needed if k not in lora]
    if absent:
        raise ExportError(path / ckpt.TRAINER_STATE_FILE, f"its LoRA contract lacks {absent}",
                          "export a checkpoint written by `flowforge train`")
    if weights in state.tensors:
        tensors, weights_file = state.tensors[weights], path / ckpt.WEIGHTS_DIR / f"{weights}.safetensors"
    elif weights == "live" and (path / ckpt.SHARDED_DIR).is_dir():
        weights_file = path / ckpt.SHARDED_DIR
        tensors = sharded_live_weights(weights_file, lora["trainable"])
    else:
        held = sorted(g for g in state.tensors if not g.startswith("objective."))  # not policies: not exportable
        raise ExportError(path, f"holds no {weights!r} weights", f"it holds {held}; pass one of them with --weights")
    return Source(run_dir=run_dir, checkpoint=state, weights=tensors, weights_file=weights_file, lora=lora,
                  model_path=model_path, base=base, adapter=cfg.model.adapter, weights_group=weights)


def sharded_live_weights(directory: Path, trainable: str) -> dict[str, torch.Tensor]:
    """The live weights of an FSDP run trained under ``lora.trainable`` = ``trainable``, read from its
    ``torch.distributed.checkpoint`` directory in one process.

    The trainer saves ``{"model": get_model_state_dict(live, ignore_frozen_params=True), "optim": ...}``: under LoRA
    the keys name the ``default`` adapter (``<module>.lora_A.default.weight``) and are returned without it, as
    :func:`flowforge.models.lora.lora_state_dict` keys them; under full (and module) fine-tuning they are the
    transformer's parameter names; under ``module+lora`` both (the submodules' names as they are, the LoRA keys
    without the adapter name). Only the ``model`` entries are read.
    """
    import torch.distributed.checkpoint as dcp

    fix = "restore the checkpoint or export another step with --step N"
    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    except (OSError, ValueError, RuntimeError, EOFError) as exc:
        raise ExportError(directory / ".metadata", f"cannot be read ({type(exc).__name__})", fix) from exc
    model = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size") and hasattr(m, "properties")}
    if not model:
        raise ExportError(directory, "holds no 'model' tensors in the sharded checkpoint", fix)
    state = {"model": model}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=str(directory), no_dist=True)
        except (OSError, ValueError, RuntimeError) as exc:
            raise ExportError(directory, f"cannot be read ({one_line(str(exc))[:200]})", fix) from exc
    if trainable not in ("lora", "module+lora"):
        return state["model"]
    out = {}
    for key, value in state["model"].items():
        for kind in ("lora_A", "lora_B"):
            if f".{kind}.default." in key:
                out[key.replace(f".{kind}.default.", f".{kind}.")] = value
                break
        else:
            if trainable == "module+lora":  # a trained submodule's parameter
                out[key] = value
    if not any(".lora_A." in k for k in out):
        raise ExportError(directory, "holds no LoRA weights of the 'default' (live) adapter", fix)
    return out


# ------------------------------------------------------------------------------------------------ base model
def layout(base: Path) -> tuple[Path, bool]:
    """``(transformer directory, is a pipeline directory)`` of a base model directory."""
    if (base / "transformer" / "config.json").is_file():
        return base / "transformer", True
    if (base / "config.json").is_file():
        return base, False
    raise ExportError(base, "is neither a diffusers pipeline directory (transformer/config.json) nor a transformer "
                      "directory (config.json)", "pass the base model directory with --base PATH")


def transformer_class(transformer_dir: Path):
    """The diffusers model class named by ``transformer_dir/config.json`` (``_class_name``)."""
    import diffusers

    config_file = transformer_dir / "config.json"
    try:
        name = json.loads(config_file.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError) as exc:
        raise _as_export_error(config_file, exc, "restore the base model's config.json") from exc
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ExportError(config_file, f"_class_name={name!r} is not a diffusers model class",
                          "give a diffusers transformer directory with --base PATH")
    return cls


def resolve_base(path: str | Path) -> Path:
    """The local directory of base model ``path`` (a ``demo:`` name resolved; it may not exist).

    Raises:
        ExportError: an unknown ``demo:`` name (the known ones listed).
    """
    from flowforge.demo.paths import resolve_demo_path

    try:
        return Path(resolve_demo_path(str(path))).expanduser()
    except ValueError as exc:
        raise ExportError(f"base model {str(path)!r}", one_line(str(exc)), "pass --base PATH") from exc


def base_name(src: Source) -> str:
    """The base as the export's files name it: ``src.base_ref`` (set by the export: a ``demo:`` name, a hub id, or a
    path relative to the export), else its local directory (a ``demo:`` name resolved), else ``model.path``."""
    if src.base_ref is not None:
        return src.base_ref
    return str(src.base.resolve()) if src.base is not None else src.model_path


def require_base(src: Source, why: str) -> Path:
    """``src.base``, after checking it is the model the run was trained from (the checkpoint's
    ``base_model_sha256``).

    Raises:
        ExportError: no local base (``why`` says what needs it), or its sha256 differs.
    """
    if src.base is None:
        raise ExportError(
            f"base model {src.model_path!r} (model.path in {src.run_dir / 'config.yaml'}, or --base)",
            f"{why} needs the base model, but it does not exist here",
            "pass the base model directory with --base PATH (Python: export_run(..., base=PATH)); it must be the "
            "model the run was trained from (its sha256 is checked)")
    check_base_identity(src.base, src.checkpoint.trainer_state.get("base_model_sha256"))
    return src.base


def check_base_identity(base: Path, expected: str | None) -> None:
    """Refuse a local base whose sha256 (:func:`flowforge.runtime.run_dir.sha256_of_path`) is not ``expected``, the
    ``base_model_sha256`` the run recorded (nothing to check when it recorded none).

    Raises:
        ExportError: naming the base and both digests.
    """
    if expected is None:
        return
    actual = sha256_of_path(base)
    if actual != expected:
        raise ExportError(f"base model {base}", f"sha256 {actual[:12]}… says it is not the model the run was trained "
                          f"from (sha256 {expected[:12]}…)", "pass the original base with --base")
