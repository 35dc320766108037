"""One generic component loader for diffusers pipeline directories: a component is loaded with the class its
``model_index.json`` names, resolved the way diffusers' own pipeline loading resolves it
(``diffusers.pipelines.pipeline_loading_utils.load_sub_model``): an entry ``[library, class_name]`` whose library is a
module of ``diffusers.pipelines`` (e.g. ``["ltx2", "LTX2Vocoder"]``) is looked up there, any other library
(``"diffusers"``, ``"transformers"``) is imported by name.

Every family loader reads its transformer and frozen model components (VAEs, vocoder) through :func:`load_component`
instead of naming their classes; text encoders and processors go through the pipelines' own ``encode_prompt``
(:class:`flowforge.models.common.PipelineText`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from flowforge.models.common import has_component, read_json


def component_class(library: str, class_name: str) -> type:
    """The class of a ``model_index.json`` entry ``[library, class_name]``, as diffusers resolves it.

    Raises:
        ValueError: the library has no such class (the entry is named).
    """
    pipelines = importlib.import_module("diffusers.pipelines")
    module = getattr(pipelines, library) if hasattr(pipelines, library) else importlib.import_module(library)
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"model_index.json entry [{library!r}, {class_name!r}]: {module.__name__} has no class "
                         f"{class_name!r}")
    return cls


def load_component(root: Path, name: str, *, dtype: torch.dtype, device: torch.device | str) -> Any:
    """Component ``name`` of pipeline directory ``root`` (``root / name``), loaded from local files only with the
    class ``model_index.json`` names, in ``dtype`` on ``device``; ``None`` when the directory does not list it (or
    lists it as null) or lacks its folder.

    Raises:
        ValueError: the class named cannot be resolved (:func:`component_class`).
        OSError: diffusers / transformers cannot read the component's files.
    """
    if not has_component(root, name):
        return None
    library, class_name = read_json(root / "model_index.json")[name]
    cls = component_class(library, class_name)
    return cls.from_pretrained(str(root / name), torch_dtype=dtype, local_files_only=True).to(device)


ALIGNMENT = 64
"""Bytes to which the CPU allocator aligns a fresh tensor's memory (c10's CPU allocator)."""


def own_aligned_storage(owner: Any) -> int:
    """Copy every CPU parameter and buffer of the ``torch.nn.Module`` attributes of ``owner`` (an adapter) whose
    memory does not start on an :data:`ALIGNMENT`-byte boundary into a fresh tensor of its own; returns how many.

    Why: weights loaded from a safetensors file can stay where the file's layout put them (8-byte offsets), and CPU
    kernels take other code paths on unaligned memory, so a model loaded from disk computed velocities up to 1e-6
    away from the same weights held in freshly allocated memory (diffusers 0.42 / transformers 5 on CPU, a tiny Wan
    expert: ``tests/models/test_wan_experts.py``). A copy makes the numbers depend on the weights only."""
    moved, seen = 0, set()
    with torch.no_grad():
        for value in vars(owner).values():
            if not isinstance(value, torch.nn.Module) or id(value) in seen:
                continue
            seen.add(id(value))
            for module in value.modules():
                for store in (module._parameters, module._buffers):
                    for tensor in store.values():
                        if tensor is not None and tensor.device.type == "cpu" and tensor.data_ptr() % ALIGNMENT:
                            tensor.data = tensor.data.clone()
                            moved += 1
    return moved
