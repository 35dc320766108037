"""A model directory's module tree without its weights: the transformer built from its ``config.json`` on the meta
device (no memory, no weight files read), so preflight can check exact module paths (``lora.modules``) before any
model loads.

``config.json`` is read at the directory's top (a bare transformer, a world model) or under ``transformer/`` (a
diffusers pipeline). Its ``_class_name`` picks the class: the world model's
(:data:`flowforge.models.world_model.adapter.CLASS_NAME`) or a diffusers model class (``SD3Transformer2DModel``,
``FluxTransformer2DModel``, ...; ``ModelMixin.from_config``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


def module_skeleton(path: str | Path) -> nn.Module | None:
    """The transformer of model directory ``path`` on the meta device, or None when it cannot be built from the
    config alone (no ``config.json``, an unknown ``_class_name``, a config the class refuses): the check then waits
    for the loaded model. Never raises for a bad directory."""
    root = Path(path)
    config_path = next((p for p in (root / "config.json", root / "transformer" / "config.json") if p.is_file()), None)
    if config_path is None:
        return None
    try:
        raw = json.loads(config_path.read_text())
        name = raw.get("_class_name")
        with torch.device("meta"):
            return _build(name, raw)
    except Exception:  # noqa: BLE001 - any failure here means "check after loading", not a preflight error
        return None


def _build(name: str | None, raw: dict) -> nn.Module | None:
    from flowforge.models.world_model.adapter import CLASS_NAME
    from flowforge.models.world_model.config import WorldModelConfig
    from flowforge.models.world_model.network import WorldModel

    if name == CLASS_NAME:
        return WorldModel(WorldModelConfig.from_dict(raw))
    import diffusers

    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
        return None
    return cls.from_config(raw)
