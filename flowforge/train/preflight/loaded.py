"""Preflight's checks that need the loaded model (:func:`check_loaded_model`; the reward scorers against it are in
:mod:`flowforge.train.scorer_checks`), and the memory arithmetic both the config-only checks
(:func:`flowforge.train.preflight.preflight`) and these use: the latent shape, LoRA targets against the real module
tree, LoRA layers inside trained submodules (``module+lora``), and the memory one step needs against what
``run.device`` has now.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from flowforge.config import Config
from flowforge.data.prompts import check_condition_images
from flowforge.runtime.errors import UserError, one_line
from flowforge.settings import LORA_MODES
from flowforge.train.preflight.modules import loaded_module_problems
from flowforge.train.preflight.parallel import loaded_context_parallel_problems


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB" if nbytes < 2**50 else f"{nbytes / 2**50:.3g} PiB"


def memory_limit(device: str, available: bool = False) -> tuple[int, str] | None:
    """``(bytes, what)``: the memory of ``device`` -- a CUDA device's total (or free) memory, else this machine's
    RAM (its cgroup limit when lower; ``MemAvailable`` with ``available``). None when it cannot be told."""
    if device.split(":")[0] == "cuda" and torch.cuda.is_available():
        index = int(device.split(":")[1]) if device[5:].isdigit() else 0
        if available:
            return torch.cuda.mem_get_info(index)[0], f"free memory on {device}"
        return torch.cuda.get_device_properties(index).total_memory, f"memory on {device}"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    try:  # a container's limit (cgroup v2) is what the process may really use
        total = min(total, int(Path("/sys/fs/cgroup/memory.max").read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        pass
    if available:
        try:
            meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            return min(total, int(meminfo["MemAvailable"].split()[0]) * 1024), "available RAM"
        except (OSError, ValueError, KeyError):
            return total, "RAM"
    return total, "RAM"


def media_bytes(cfg: Config, rows: int) -> int:
    """A lower bound of the decoded media of ``rows`` samples: float32, one channel, ``height x width x frames``
    (media are ``[B, 3, H, W]`` float32, grey ``[B, 1, H, W]`` for pixel-space digits)."""
    m = cfg.model
    return rows * m.height * m.width * (m.frames or 1) * 4


_ADAPTABLE = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)


def _target_problems(cfg: Config, adapter, problems: list[str]) -> list[torch.nn.Module]:
    """Each ``lora.targets`` entry (peft's rule: a module whose name is the entry or ends with ``.entry``) must
    match a layer peft can adapt. Returns the matched layers."""
    modules = dict(adapter.transformer.named_modules())
    targets = cfg.lora.targets or (adapter.lora_targets if cfg.lora.trainable in LORA_MODES else ())
    kind = type(adapter.transformer).__name__
    hint = f"the adapter's default targets are {list(adapter.lora_targets)}"
    layers = []
    for target in targets:
        hits = [mod for name, mod in modules.items() if name == target or name.endswith("." + target)]
        usable = [mod for mod in hits if isinstance(mod, _ADAPTABLE) or type(mod).__name__ == "Conv1D"]
        layers += usable
        if cfg.lora.targets is None:
            continue  # the adapter's own defaults: not the user's to fix
        if not hits:
            problems.append(f"lora.targets entry {target!r} matches no module of {kind}; {hint}")
        elif not usable:
            problems.append(f"lora.targets entry {target!r} matches only {sorted({type(h).__name__ for h in hits})} "
                            f"modules of {kind}, which LoRA cannot adapt (it needs Linear / Conv / Embedding "
                            f"layers); {hint}")
    return layers


def loaded_memory_bytes(cfg: Config, latent_shape, lora_layers, world: int) -> int:
    """A lower bound of what training holds beyond the model, in bytes: one step's trajectories (the final latent,
    plus input / output latents and means of every trained step for a replay objective) and decoded media, one
    evaluation's noise, latents and media, and the LoRA weights with their gradients and two Adam moments."""
    from flowforge.objectives import OBJECTIVES, ReplayObjective, trained_steps_for

    d, e = cfg.data, cfg.eval
    numel = math.prod(int(x) for x in latent_shape)
    rows = max(1, d.prompts_per_step * d.group_size // max(world, 1))
    objective = OBJECTIVES.get(cfg.train.algorithm)
    per_row = 1
    if objective is not None and issubclass(objective, ReplayObjective):
        stored = len(trained_steps_for(cfg.sampler, cfg.run.seed, 0))
        per_row += stored * (3 if objective.store_means else 2)
    step = rows * numel * 4 * per_row + media_bytes(cfg, rows)
    eval_rows = (e.max_prompts or 0) * e.samples_per_prompt
    evaluation = eval_rows * numel * 4 * 2 + media_bytes(cfg, eval_rows)
    rank = cfg.lora.resolved_rank if cfg.lora.trainable in LORA_MODES else 0
    lora = sum(rank * (getattr(m, "in_features", 0) + getattr(m, "out_features", 0)) for m in lora_layers) * 4 * 4
    return step + evaluation + lora


def guidance_warnings(cfg: Config, adapter) -> list[str]:
    """One line when ``sampler.guidance_scale`` (not 1) is a value the family's pipeline never guides with: its rule
    (the adapter's ``guidance_use`` / ``cfg_rule``, :class:`flowforge.models.base.AdapterMixin`) turns CFG off there,
    so the run samples exactly as at 1 (e.g. 0.5 for Wan, SD3, Qwen-Image, Z-Image; any value for a step-distilled
    FLUX.2 Klein). Guidance-embedding models use every value: no warning. Adapters without ``guidance_use``: none."""
    g = cfg.sampler.guidance_scale
    use = getattr(adapter, "guidance_use", None)
    if use is None or g == 1.0 or use(g) != "off":
        return []
    return [f"sampler.guidance_scale={g} means no CFG for model.adapter={cfg.model.adapter!r}: its pipeline guides "
            f"only when {getattr(adapter, 'cfg_rule', 'guidance_scale > 1')}, so this samples exactly as "
            "guidance_scale=1 (the conditional velocity alone)"]


def check_loaded_model(cfg: Config, adapter, *, world_size: int = 1, already: tuple[str, ...] = (),
                       prompts: dict[str, list] | None = None) -> list[str]:
    """What only the loaded model can tell, checked right after it loads and before the run directory is written:
    ``model.height`` / ``width`` / ``frames`` fit the model (:meth:`FlowModel.latent_shape`: VAE factor x patch
    size), every record of ``prompts`` (``{config key: records}``) lists at most the adapter's
    ``max_condition_images`` condition images, every ``lora.targets`` entry matches a layer LoRA can adapt, under
    ``module+lora`` no LoRA layer is at,
    inside or around a trained submodule (:func:`flowforge.models.trained_parts.check_disjoint`), and the memory a
    step needs (:func:`loaded_memory_bytes`) fits what is available now on ``run.device``. Returns (and logs) a
    guidance value the family never guides with (:func:`guidance_warnings`) and the warnings of an adapter's
    ``leverage_warnings`` hook: a trained set that can barely change the output (a world
    model's B or coupling LoRA behind closed coupling gates); one already in ``already`` (what :func:`preflight`
    warned, from the weights file) is returned but not logged again.

    Raises:
        UserError: naming every such problem at once (``"after loading model.path=...: <problems>"``).
    """
    problems: list[str] = []
    m = cfg.model
    try:
        latent = adapter.latent_shape(m.height, m.width, m.frames)
    except ValueError as exc:
        sizes = f"model.height={m.height} / model.width={m.width}" + (f" / model.frames={m.frames}" if m.frames else "")
        problems.append(f"{sizes} do not fit this model: {one_line(str(exc))}")
        latent = None
    for name, records in (prompts or {}).items():
        try:
            check_condition_images(records, getattr(adapter, "max_condition_images", 1), name)
        except ValueError as exc:
            problems.append(str(exc))
    layers = _target_problems(cfg, adapter, problems)
    loaded_module_problems(cfg, adapter, problems)
    problems += loaded_context_parallel_problems(cfg, adapter) if latent is not None else []
    limit = memory_limit(cfg.run.device, available=True)
    if latent is not None and limit is not None:
        need = loaded_memory_bytes(cfg, latent, layers, world_size)
        if need > limit[0]:
            problems.append(f"one step needs at least {_gib(need)} beyond the model (trajectories of "
                            f"{cfg.data.prompts_per_step * cfg.data.group_size // max(world_size, 1)} samples per rank "
                            f"with latents {list(latent)}, media, evaluation, LoRA), more than the {_gib(limit[0])} "
                            f"{limit[1]}; lower data.group_size / data.prompts_per_step, the resolution or "
                            "eval.max_prompts")
    if problems:
        raise UserError(f"after loading model.path={m.path!r}", "; ".join(problems),
                        "fix these keys and run again")
    hook = getattr(adapter, "leverage_warnings", None)
    warnings = guidance_warnings(cfg, adapter)
    warnings += hook(cfg.lora.trainable, cfg.lora.modules) if hook is not None else []
    for warning in warnings:
        if warning not in already:
            logging.getLogger("flowforge").warning(warning)
    return warnings

