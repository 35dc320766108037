"""What an export reads: the run's config, one committed checkpoint, its weights, and the check that those weights
are the ones the run's contract says they are.

A damaged checkpoint file gives an :class:`~flowforge.tools.export_out.ExportError` naming that file instead of the
reader's own message (a garbage ``trainer_state.json`` -> ``not valid JSON (... at line 1 column 1)``; a zeroed
``optimizer.pt`` -> ``not a torch.save archive``; a changed file -> its sha256 against the manifest's); the reading
is :func:`flowforge.train.checkpoint.load_checkpoint`'s, shared with resume.

The contract (``trainer_state.json`` ``"lora"``) fixes which tensors a checkpoint holds:

=============  =========================================================================================
trainable      tensors (keys as :func:`flowforge.models.lora.lora_state_dict` writes them)
=============  =========================================================================================
``lora``       ``<module>.lora_A.weight`` ``[rank, in]`` and ``<module>.lora_B.weight`` ``[out, rank]`` for
               every module of the base transformer matching a target (peft's rule: the name equals the
               target or ends with ``.<target>``)
``full``       the base transformer's state-dict keys and shapes (every parameter; buffers optional)
=============  =========================================================================================

:func:`check_contract` compares them with the base transformer built on the ``meta`` device from its
``config.json`` (no weights are read), or, without a local base, checks the LoRA keys' form, targets, ranks and
A / B pairs. The first key that does not fit is named.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from flowforge.config import ConfigError, load_config
from flowforge.runtime.errors import UserError, file_error, one_line
from flowforge.tools.export_out import ExportError
from flowforge.train import checkpoint as ckpt

SUPPORTED_ADAPTERS = ("sd3", "flux", "qwen_image", "wan")
_LORA_KEY = re.compile(r"(.+)\.(lora_A|lora_B)\.weight")


@dataclass(frozen=True)
class Source:
    """The run being exported: its checkpoint and the weights chosen from it."""

    run_dir: Path
    checkpoint: ckpt.Checkpoint
    weights: dict[str, torch.Tensor]  # name -> tensor (LoRA keys without the adapter name, or full state dict)
    weights_file: Path  # where ``weights`` were read from (a safetensors file or the sharded dcp/ directory)
    lora: dict  # trainer_state["lora"]: trainable, rank, alpha, targets, dropout
    model_path: str  # model.path of the run's config, or --base
    base: Path | None  # local base directory (None: not found locally)
    adapter: str  # model.adapter of the run's config (a registered family or "pkg.module:Class")


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
    if cfg.model.adapter not in SUPPORTED_ADAPTERS and ":" not in cfg.model.adapter:
        raise ExportError(f"model.adapter={cfg.model.adapter!r} in {cfg_file}", "export cannot handle this family",
                          f"allowed: {list(SUPPORTED_ADAPTERS)} or a 'pkg.module:Class' adapter over a diffusers "
                          "transformer")
    return cfg


def committed_steps(run_dir: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in ckpt.committed_checkpoints(run_dir)]


def pick_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint directory of ``step`` (``None``: the newest committed one)."""
    committed = ckpt.committed_checkpoints(run_dir)
    if step is None:
        if not committed:
            raise ExportError(run_dir / ckpt.CHECKPOINTS_DIR, "holds no committed checkpoint",
                              "train with checkpoint.every > 0")
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


def load_source(run_dir: Path, cfg, path: Path, weights: str, model_path: str, base: Path | None) -> Source:
    """The checkpoint ``path`` of run ``run_dir`` with its ``weights`` group (``live`` / ``ema`` / ``old``)."""
    state = read_checkpoint(run_dir, path)
    lora = state.trainer_state.get("lora")
    if not isinstance(lora, dict) or lora.get("trainable") not in ("lora", "full"):
        raise ExportError(path / ckpt.TRAINER_STATE_FILE, "has no LoRA contract ('lora': {trainable, ...})",
                          "export a checkpoint written by `flowforge train`")
    absent = [k for k in ("rank", "alpha", "targets") if lora["trainable"] == "lora" and k not in lora]
    if absent:
        raise ExportError(path / ckpt.TRAINER_STATE_FILE, f"its LoRA contract lacks {absent}",
                          "export a checkpoint written by `flowforge train`")
    if weights in state.tensors:
        tensors, weights_file = state.tensors[weights], path / ckpt.WEIGHTS_DIR / f"{weights}.safetensors"
    elif weights == "live" and (path / ckpt.SHARDED_DIR).is_dir():
        weights_file = path / ckpt.SHARDED_DIR
        tensors = sharded_live_weights(weights_file, lora["trainable"] == "lora")
    else:
        raise ExportError(path, f"holds no {weights!r} weights", f"it holds {sorted(state.tensors)}; pass one "
                          "of them with --weights")
    return Source(run_dir=run_dir, checkpoint=state, weights=tensors, weights_file=weights_file, lora=lora,
                  model_path=model_path, base=base, adapter=cfg.model.adapter)


def sharded_live_weights(directory: Path, lora: bool) -> dict[str, torch.Tensor]:
    """The live weights of an FSDP run, read from its ``torch.distributed.checkpoint`` directory in one process.

    The trainer saves ``{"model": get_model_state_dict(live, ignore_frozen_params=True), "optim": ...}``: under LoRA
    the keys name the ``default`` adapter (``<module>.lora_A.default.weight``) and are returned without it, as
    :func:`flowforge.models.lora.lora_state_dict` keys them; under full fine-tuning they are the transformer's
    parameter names. Only the ``model`` entries are read.
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
    if not lora:
        return state["model"]
    out = {}
    for key, value in state["model"].items():
        for kind in ("lora_A", "lora_B"):
            if f".{kind}.default." in key:
                out[key.replace(f".{kind}.default.", f".{kind}.")] = value
    if not out:
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


# ------------------------------------------------------------------------------------------------ contract
def _expected_tensors(transformer_dir: Path, lora: dict) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """``(key -> shape the contract allows, keys it requires)`` from the base transformer built on ``meta``."""
    from flowforge.models import lora as lora_lib

    cls = transformer_class(transformer_dir)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = cls.from_config(cls.load_config(str(transformer_dir)))
    if lora["trainable"] == "full":
        return ({k: tuple(v.shape) for k, v in model.state_dict().items()},
                {name for name, _ in model.named_parameters()})
    try:
        lora_lib.inject_lora(model, int(lora["rank"]), float(lora["alpha"]), list(lora["targets"]))
    except ValueError as exc:
        raise ExportError(transformer_dir, f"does not fit the run's LoRA contract ({one_line(str(exc))})",
                          "pass the base the run was trained from with --base PATH") from exc
    params = lora_lib.lora_parameters(model, "default")
    return {k: tuple(p.shape) for k, p in params.items()}, set(params)


def _lora_form_problem(key: str, value: torch.Tensor, lora: dict) -> str | None:
    match = _LORA_KEY.fullmatch(key)
    if match is None:
        return "is not a LoRA weight (<module>.lora_A.weight / <module>.lora_B.weight)"
    module, kind = match.groups()
    if not any(module == t or module.endswith("." + t) for t in lora["targets"]):
        return f"is on module {module!r}, which matches none of the targets {list(lora['targets'])}"
    rank = int(lora["rank"])
    if value.dim() != 2 or value.shape[0 if kind == "lora_A" else 1] != rank:
        return f"has shape {tuple(value.shape)}, not a rank-{rank} {kind}"
    return None


def check_contract(src: Source, transformer_dir: Path | None) -> None:
    """Check that ``src.weights`` are exactly the tensors of the run's contract (module table).

    Args:
        src: the loaded checkpoint and its weights.
        transformer_dir: the base transformer directory to build the expected keys from; ``None`` (no local base)
            checks the LoRA keys' form, targets, rank and A / B pairs only.

    Raises:
        ExportError: naming the weights file and the first key that is unexpected, missing or of the wrong shape.
    """
    def bad(key: str, problem: str) -> ExportError:
        base = f" of base {transformer_dir}" if transformer_dir is not None else ""
        return ExportError(src.weights_file, f"tensor {key!r} {problem}",
                           f"the checkpoint does not match the run's contract ({contract}{base}): it was edited or "
                           f"belongs to another run or base; export another step with --step N or pass the "
                           f"trained-from base with --base PATH")

    lora = src.lora
    contract = ("full fine-tune" if lora["trainable"] == "full" else
                f"LoRA rank {lora.get('rank')} on {list(lora.get('targets') or [])}")
    if lora["trainable"] == "lora":
        pairs: dict[str, set[str]] = {}
        for key in sorted(src.weights):
            problem = _lora_form_problem(key, src.weights[key], lora)
            if problem is not None:
                raise bad(key, problem)
            module, kind = _LORA_KEY.fullmatch(key).groups()
            pairs.setdefault(module, set()).add(kind)
        for module, kinds in sorted(pairs.items()):
            if len(kinds) != 2:
                (present,) = kinds
                missing = "lora_B" if present == "lora_A" else "lora_A"
                raise bad(f"{module}.{missing}.weight", f"is missing (its {present} is present)")
    if transformer_dir is None:
        return
    shapes, required = _expected_tensors(transformer_dir, lora)
    for key in sorted(src.weights):
        if key not in shapes:
            raise bad(key, "is not in the contract")
        if tuple(src.weights[key].shape) != shapes[key]:
            raise bad(key, f"has shape {tuple(src.weights[key].shape)}, the contract's is {shapes[key]}")
    missing = sorted(required - set(src.weights))
    if missing:
        raise bad(missing[0], f"is missing ({len(missing)} contract tensors are)")
