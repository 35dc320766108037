"""Preflight rules of the trained submodules (``lora.trainable: module`` / ``module+lora``), before and after the
model loads (called by :func:`flowforge.train.preflight.preflight` and
:func:`flowforge.train.preflight.loaded.check_loaded_model`).

=============  ===========================================================================================
when           what is named
=============  ===========================================================================================
before load    ``lora.modules`` that are not exact submodules of the model built on the meta device (unknown,
               repeated, nested); under ``module+lora`` a path at, inside or around a LoRA layer when the targets
               are known without the weights (:func:`module_path_problems`)
after load     under ``module+lora`` the same rule on the loaded model with its resolved targets
               (:func:`loaded_module_problems`): a model whose tree or targets only the loaded model gives
=============  ===========================================================================================

A LoRA layer inside a trained submodule would train its weight twice (in full and through LoRA):
:func:`flowforge.models.trained_parts.check_disjoint` words the error.
"""

from __future__ import annotations

import os

import torch

from flowforge.config import Config
from flowforge.settings import MODULE_MODES


def module_path_problems(cfg: Config, problems: list[str]) -> None:
    """``lora.modules`` (``module`` / ``module+lora``) against the model's module tree, built from its config on the
    meta device (:func:`flowforge.models.skeleton.module_skeleton`): an unknown, repeated or nested path is named now,
    not when the model loads; under ``module+lora`` so is a path at, inside or around a LoRA layer, when the targets
    are known without the model (``lora.targets``, a class-level ``lora_targets`` tuple, or the adapter class's
    ``lora_targets_of(transformer)``). A model whose tree cannot be built from its config alone is checked after
    loading (:func:`loaded_module_problems`)."""
    from flowforge.demo.paths import is_demo_name, resolve_demo_path
    from flowforge.models.skeleton import module_skeleton
    from flowforge.models.submodules import check_submodules
    from flowforge.models.trained_parts import check_disjoint

    if cfg.lora.trainable not in MODULE_MODES or not cfg.lora.modules:
        return
    try:
        path = resolve_demo_path(cfg.model.path) if is_demo_name(cfg.model.path) else cfg.model.path
    except ValueError:
        return  # named by _model_path_problems
    if not os.path.isdir(path):
        return
    skeleton = module_skeleton(path)
    if skeleton is None:
        return
    try:
        check_submodules(skeleton, cfg.lora.modules)
    except ValueError as exc:
        problems.append(f"lora.modules: {exc}")
        return
    if cfg.lora.trainable != "module+lora":
        return
    targets = cfg.lora.targets or class_lora_targets(cfg.model.adapter, skeleton)
    if targets:
        try:
            check_disjoint(skeleton, cfg.lora.modules, targets)
        except ValueError as exc:
            problems.append(str(exc))


def class_lora_targets(adapter: str, transformer: torch.nn.Module) -> tuple[str, ...] | None:
    """The default LoRA targets of adapter class ``adapter`` without loading it: its class-level ``lora_targets``
    tuple, or its ``lora_targets_of(transformer)`` (the world model's depend on the number of blocks); None when
    neither is there (checked after loading)."""
    import inspect

    from flowforge.models import adapter_class

    try:
        cls = adapter_class(adapter)
    except ValueError:
        return None  # named elsewhere
    of = getattr(cls, "lora_targets_of", None)
    if callable(of):
        try:
            return tuple(of(transformer))
        except Exception:  # noqa: BLE001 - a tree the class does not understand (another family's): check after load
            return None
    static = inspect.getattr_static(cls, "lora_targets", None)
    return tuple(static) if isinstance(static, (tuple, list)) else None


def loaded_module_problems(cfg: Config, adapter, problems: list[str]) -> None:
    """Under ``module+lora``: no LoRA layer of ``lora.targets`` (or ``adapter.lora_targets``) at, inside or around a
    ``lora.modules`` path of the loaded ``adapter.transformer``; appends the one-line problem."""
    from flowforge.models.trained_parts import check_disjoint

    if cfg.lora.trainable != "module+lora":
        return
    try:
        check_disjoint(adapter.transformer, cfg.lora.modules or (), cfg.lora.targets or adapter.lora_targets)
    except ValueError as exc:
        problems.append(str(exc))
