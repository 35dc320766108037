"""Model sizes for the memory planner: the transformer's config (a local model directory's ``config.json``, else the
published table ``families.yaml``), its parameter count by building the diffusers class on the ``meta`` device
(exact, no memory), and the LoRA parameter count by applying peft to that meta model with the run's targets and rank.

Nothing here loads weights. A text encoder / VAE directory next to the transformer is counted the same way (meta
instantiation from its ``config.json``) when present; offline and absent they are reported as not counted.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

FAMILIES_FILE = "families.yaml"


@dataclass(frozen=True)
class ModelSpec:
    """What the planner knows of a run's model before anything is built.

    ``config`` is the transformer's config (diffusers keys), ``class_name`` its diffusers class, ``depth_keys`` the
    config keys that count blocks, ``transformers`` how many such transformers the pipeline holds (Wan 2.2 A14B: 2),
    ``text_tokens`` the text-embedding length the adapter feeds, ``source`` where the config came from (a path or
    ``families.yaml:<name> (<hub id>)``), ``components`` the other components' config paths (text encoders, VAE),
    ``latent_scale`` the VAE's ``(spatial, temporal)`` downsampling (8x / 4x unless the entry's ``latent`` says
    otherwise: Wan2.2 TI2V-5B's VAE is 16x in space)."""

    adapter: str
    class_name: str
    config: dict[str, Any]
    depth_keys: tuple[str, ...]
    text_tokens: int
    transformers: int = 1
    source: str = ""
    components: dict[str, Path] = field(default_factory=dict)
    latent_scale: tuple[int, int] = (8, 4)

    def with_config(self, **overrides: Any) -> "ModelSpec":
        """The same spec with some config values replaced (e.g. ``num_layers=2`` for a reduced-depth check)."""
        return ModelSpec(self.adapter, self.class_name, {**self.config, **overrides}, self.depth_keys,
                         self.text_tokens, self.transformers, self.source, dict(self.components), self.latent_scale)


def published() -> dict[str, dict[str, Any]]:
    """The published-config table (``families.yaml``): name -> entry."""
    text = resources.files("flowforge.tools.plan").joinpath(FAMILIES_FILE).read_text()
    return yaml.safe_load(text)


def _hub_tail(path: str) -> str:
    return path.rstrip("/").split("/")[-1].lower()


def spec_for(adapter: str, path: str, frames: int | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of ``model.adapter`` / ``model.path``: the directory's ``transformer/config.json`` when
    it exists, else the published entry whose Hub id ends like ``path`` (``/models/Wan2.1-T2V-1.3B-Diffusers`` ->
    ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``).

    Raises:
        ValueError: no local config and no published entry of that family matches ``path`` (the names it knows are
            listed).
    """
    table = published()
    same_family = {k: v for k, v in table.items() if v["adapter"] == adapter}
    root = Path(path)
    local = root / "transformer" / "config.json"
    if local.is_file():
        cfg = json.loads(local.read_text())
        class_name = cfg.pop("_class_name")
        cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
        base = next(iter(same_family.values()), None)
        depth_keys = tuple(base["depth_keys"]) if base else tuple(k for k in cfg if k.startswith("num_") and
                                                                   k.endswith("layers"))
        n = 1 + sum((root / f"transformer_{i}" / "config.json").is_file() for i in range(2, 9))
        comps = {name: root / name / "config.json" for name in ("text_encoder", "text_encoder_2", "text_encoder_3",
                                                                  "vae") if (root / name / "config.json").is_file()}
        named = next((v for v in same_family.values() if _hub_tail(v["hub_id"]) == _hub_tail(path)), base)
        return ModelSpec(adapter, class_name, cfg, depth_keys, int(base["text_tokens"]) if base else 512, n,
                         str(local), comps, tuple(named.get("latent", (8, 4))) if named else (8, 4))
    tail = _hub_tail(path)
    for name, entry in same_family.items():
        if _hub_tail(entry["hub_id"]) == tail:
            return ModelSpec(adapter, entry["class"], copy.deepcopy(entry["config"]), tuple(entry["depth_keys"]),
                             int(entry["text_tokens"]), int(entry.get("transformers", 1)),
                             f"{FAMILIES_FILE}:{name} ({entry['hub_id']})", {},
                             tuple(entry.get("latent", (8, 4))))
    known = sorted(f"{v['hub_id']} ({v['adapter']})" for v in table.values())
    raise ValueError(f"model.path={path!r}: no transformer/config.json there and no published config of the "
                     f"{adapter!r} family for it; the planner knows offline: {known}")


TEXT_DIM_KEYS = ("joint_attention_dim", "text_dim", "cap_feat_dim")  # the text-embedding width, by class


def text_dim(spec: ModelSpec) -> int | None:
    """The width ``D`` of the text embeddings ``[B, S, D]`` the transformer reads (its config key differs by class:
    ``joint_attention_dim`` for MMDiTs, ``text_dim`` for Wan, ``cap_feat_dim`` for Z-Image)."""
    return next((spec.config[k] for k in TEXT_DIM_KEYS if spec.config.get(k)), None)


def build_transformer(spec: ModelSpec, device: str = "meta", dtype=None):
    """The diffusers transformer of ``spec`` on ``device`` (``meta``: shapes only, no memory), in ``dtype``."""
    import diffusers
    import torch

    cls = getattr(diffusers, spec.class_name)
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.config.items()}
    old = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(**cfg)
    finally:
        torch.set_default_dtype(old)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one transformer (multiply by ``ModelSpec.transformers`` for the pipeline)."""

    total: int  # every parameter of the transformer
    lora: int  # LoRA A/B parameters at the run's rank and targets (0 when not LoRA)
    largest_block: int  # parameters of the largest block (FSDP all-gathers one unit at a time)


def lora_targets(adapter: str, targets: tuple[str, ...] | None) -> tuple[str, ...]:
    """``lora.targets`` when set, else the adapter class's default targets (read from the class, no weights)."""
    if targets:
        return tuple(targets)
    from flowforge.models import adapter_class

    return tuple(adapter_class(adapter).lora_targets)


def count_params(spec: ModelSpec, lora_rank: int | None, targets: tuple[str, ...]) -> ParamCounts:
    """Count ``spec``'s parameters on the meta device; with ``lora_rank`` also peft's LoRA parameters on ``targets``
    (flowforge's own :func:`flowforge.models.lora.add_adapter`, so the count is what training injects)."""
    from torch import nn

    model = build_transformer(spec, "meta")
    total = sum(p.numel() for p in model.parameters())
    blocks = [m for child in model.children() if isinstance(child, nn.ModuleList) for m in child]
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=total)
    lora = 0
    if lora_rank:
        from flowforge.models.lora import add_adapter

        params = add_adapter(model, "default", lora_rank, float(lora_rank), targets, trainable=True)
        lora = sum(p.numel() for p in params)
    return ParamCounts(total, lora, largest)


def component_params(path: Path) -> tuple[str, int]:
    """``(class name, parameters)`` of a text encoder / VAE from its ``config.json`` (transformers or diffusers
    class built on the meta device)."""
    import torch

    cfg = json.loads(path.read_text())
    if "_class_name" in cfg:  # a diffusers component (the VAE)
        import diffusers

        cls = getattr(diffusers, cfg["_class_name"])
        with torch.device("meta"):
            model = cls.from_config(cfg)
        return cfg["_class_name"], sum(p.numel() for p in model.parameters())
    import transformers

    name = cfg["architectures"][0]
    config = transformers.AutoConfig.from_pretrained(str(path.parent))
    with torch.device("meta"):
        model = getattr(transformers, name)(config)
    return name, sum(p.numel() for p in model.parameters())
