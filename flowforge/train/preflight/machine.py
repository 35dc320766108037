"""Preflight checks of the config against this machine (``run.device``, ``model.path`` on disk, directories, an
explicit ``train.resume``, decoded-media memory, a world model's coupling gates): run by
:func:`flowforge.train.preflight.check.preflight` with ``this_machine=True``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flowforge.config import Config
from flowforge.runtime.errors import one_line
from flowforge.train.preflight.loaded import _gib, media_bytes, memory_limit


def _device_problems(cfg: Config, problems: list[str]) -> None:
    """``run.device`` names a device torch knows and this machine has."""
    name = cfg.run.device
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        problems.append(f"run.device={name!r} is not a device ({one_line(str(exc))}); use cpu, cuda, cuda:N or mps")
        return
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            problems.append(f"run.device={name!r} but this machine has no CUDA device (torch.cuda.is_available() is "
                            f"False for torch {torch.__version__}); use run.device=cpu or run on a GPU machine")
        elif device.index is not None and device.index >= count:
            problems.append(f"run.device={name!r} but this machine has {count} CUDA device(s): cuda:0 .. "
                            f"cuda:{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        problems.append(f"run.device={name!r} but MPS is not available on this machine; use run.device=cpu")


def _model_path_problems(cfg: Config, problems: list[str], warnings: list[str], this_machine: bool) -> None:
    """``model.path``: a known demo name; for a registered family (a ``pkg.module:Class`` adapter decides what its
    path means) and ``this_machine``, a path on disk, or a Hub id -- a warning when it is not in the local cache
    (training downloads it), a problem when it is not and ``HF_HUB_OFFLINE`` forbids the download."""
    from flowforge.demo.paths import is_demo_name, resolve_demo_path
    from flowforge.models import ADAPTERS, cached_hub_snapshot, download_hint, hub_offline, looks_like_hub_id

    path = cfg.model.path
    if is_demo_name(path):
        try:
            resolve_demo_path(path)
        except ValueError as exc:
            problems.append(f"model.path: {exc}")
        return
    if not this_machine or cfg.model.adapter not in ADAPTERS:
        return
    if os.path.exists(path):
        # every registered family loads a transformer config.json, at the top (a bare transformer, a world model)
        # or under transformer/ (a diffusers pipeline)
        if not os.path.isdir(path):
            problems.append(f"model.path={path!r} is a file; give a model directory (diffusers pipeline or "
                            "transformer), a Hub id (org/name) or demo:base")
        elif not any(os.path.isfile(os.path.join(path, *rel)) for rel in (("config.json",),
                                                                          ("transformer", "config.json"))):
            problems.append(f"model.path={path!r} holds neither config.json nor transformer/config.json: not a "
                            "diffusers model directory; give the directory save_pretrained wrote")
        return
    if looks_like_hub_id(path):
        missing = (f"model.path={path!r} is not a directory here and looks like a Hub id that is not in the local "
                   "Hugging Face cache")
        if cached_hub_snapshot(path) is not None:
            return
        if hub_offline():  # training here cannot get it
            problems.append(f"{missing}, and HF_HUB_OFFLINE is set; {download_hint(path)}")
        else:
            warnings.append(f"{missing}; training downloads it")
        return
    why = "cannot be reached (a symlink loop or a broken link)" if os.path.lexists(path) else "does not exist"
    problems.append(f"model.path={path!r} {why} on this machine; give a local diffusers directory, a Hub id "
                    "(org/name) or demo:base")


def _directory_problems(cfg: Config, problems: list[str]) -> None:
    """Directories flowforge will create or write into must not be files."""
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    for key, path in (("run.output_dir", Path(cfg.run.output_dir)), ("run.name", run_dir),
                      ("data.cache_dir", Path(cfg.data.cache_dir))):
        if path.exists() and not path.is_dir():
            problems.append(f"{key}: {path} is a file, not a directory; choose another {key}")


def _resume_problems(cfg: Config, problems: list[str]) -> None:
    """An explicit ``train.resume`` path is a committed checkpoint directory (its files' checksums are verified when
    training resumes: hashing a large checkpoint here would make ``check`` slow)."""
    from flowforge.train.checkpoint import MARKER, is_committed

    resume = cfg.train.resume
    if resume in (None, "auto", "must"):
        return
    path = Path(resume).expanduser()
    fix = "give a committed checkpoint directory (<run>/checkpoints/step_N) or train.resume=auto"
    if not path.exists():
        problems.append(f"train.resume={resume!r}: {path} does not exist; {fix}")
    elif not is_committed(path):
        problems.append(f"train.resume={resume!r}: {path} has no {MARKER} marker (not a checkpoint directory, or an "
                        f"interrupted or superseded write); {fix}")


def _memory_problems(cfg: Config, world: int, counts: dict[str, int], problems: list[str]) -> None:
    """One step's and one evaluation's decoded media (lower bounds, :func:`media_bytes`) against the memory of
    ``run.device`` on this machine: a run that cannot hold them would exhaust memory (or swap for hours)."""
    limit = memory_limit(cfg.run.device)
    if limit is None:
        return
    total, what = limit
    d, m, e = cfg.data, cfg.model, cfg.eval
    per_rank = max(1, d.prompts_per_step * d.group_size // max(world, 1))
    size = f"{m.height}x{m.width}" + (f"x{m.frames} frames" if m.frames else "")
    need = media_bytes(cfg, per_rank)
    if need > total:
        problems.append(f"data.prompts_per_step x data.group_size = {per_rank} samples per rank at {size}: one step's "
                        f"decoded media alone need at least {_gib(need)}, more than the {_gib(total)} {what} of this "
                        "machine; lower data.group_size / data.prompts_per_step or model.height / model.width")
    n_eval = counts.get("data.eval_prompts")
    if n_eval is not None:
        rows = min(n_eval, e.max_prompts or n_eval) * e.samples_per_prompt
        need = media_bytes(cfg, rows)
        if need > total:
            problems.append(f"eval: {rows} samples ({min(n_eval, e.max_prompts or n_eval)} prompts x "
                            f"eval.samples_per_prompt={e.samples_per_prompt}) at {size} need at least {_gib(need)} of "
                            f"decoded media, more than the {_gib(total)} {what}; lower eval.max_prompts or "
                            "eval.samples_per_prompt")


def _leverage_warnings(cfg: Config, warnings: list[str]) -> None:
    """A world model whose trained set sits behind closed coupling gates (B-only or coupling-LoRA on a base whose gates
    stayed ~0 in SFT): :func:`~flowforge.models.world_model.adapter.gate_leverage_warnings` of the gates read from
    its weights file, no network built. Other adapters, and a path with no local weights file, are left to the
    loaded-model check."""
    if cfg.model.adapter != "world_model":
        return
    from flowforge.demo.paths import is_demo_name, resolve_demo_path
    from flowforge.models.world_model.adapter import gate_leverage_warnings, read_coupling_gates

    try:
        path = resolve_demo_path(cfg.model.path) if is_demo_name(cfg.model.path) else cfg.model.path
        gates = read_coupling_gates(path)
    except Exception:  # noqa: BLE001 - an unknown demo name or unreadable weights: named by the model checks / load
        return
    if gates is not None:
        warnings.extend(gate_leverage_warnings(cfg.lora.trainable, cfg.lora.modules, gates))

