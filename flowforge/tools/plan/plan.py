"""The plan of one config: the model measured (cached on disk), its setting, the budget evaluated per rank and
phase, and the change that would make it fit (:func:`plan_config`)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
from dataclasses import replace
from pathlib import Path

from flowforge.tools.plan.activations import ActivationModel, Linear, image_tokens, latent_for, measure
from flowforge.tools.plan.budget import (DTYPE_BYTES, GPUS, Plan, Setting, check_gpu, items_for, render,
                                         suggest)
from flowforge.tools.plan.sizes import (ModelSpec, component_params, count_params, lora_targets, published,
                                        spec_for, text_dim)

__all__ = ["GPUS", "Plan", "ModelSpec", "check_gpu", "plan_config", "render", "published", "spec_for"]

OFFLOAD_ORDER = ("none", "optimizer", "params")  # distributed.offload, from the least to the most moved to the host
MEASURE_VERSION = 1  # bump when the measurement changes: cached models of older versions are not read
_ACTIVATIONS: dict[str, ActivationModel] = {}  # measured models, keyed by what they depend on (one process)
_COUNTS: dict[str, object] = {}


def cache_dir() -> Path:
    """Where measured activation models are kept between runs: ``$FLOWFORGE_PLAN_CACHE``, else
    ``$XDG_CACHE_HOME/flowforge/plan`` (``~/.cache/flowforge/plan``)."""
    if os.environ.get("FLOWFORGE_PLAN_CACHE"):
        return Path(os.environ["FLOWFORGE_PLAN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flowforge" / "plan"


def _activation_model(spec: ModelSpec, dtype, lora, guidance: float, video: bool) -> ActivationModel:
    """The measured :class:`ActivationModel`, from this process's memo, else the on-disk cache (keyed by everything
    the measurement depends on, torch and diffusers versions included), else measured now and cached."""
    import diffusers
    import torch

    from flowforge.runtime.durable import write_bytes

    key = json.dumps([spec.class_name, spec.config, str(dtype), lora, guidance, video, torch.__version__,
                      diffusers.__version__, MEASURE_VERSION], sort_keys=True, default=str)
    if key in _ACTIVATIONS:
        return _ACTIVATIONS[key]
    path = cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    try:
        data = json.loads(path.read_text())
        model = ActivationModel(**{k: {n: Linear(**v) for n, v in parts.items()} for k, parts in data.items()})
    except (OSError, ValueError, TypeError):  # absent or unreadable: measure again
        model = measure(spec, dtype=dtype, lora=lora, guidance=guidance, video=video)
        with contextlib.suppress(OSError):  # a read-only home only costs the next run a measurement
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(path, json.dumps({k: {n: dataclasses.asdict(v) for n, v in getattr(model, k).items()}
                                          for k in ("train", "checkpointed", "rollout")}).encode())
    _ACTIVATIONS[key] = model
    return model


def _counts(spec: ModelSpec, rank, targets):
    key = json.dumps([spec.class_name, spec.config, rank, targets], sort_keys=True, default=str)
    if key not in _COUNTS:
        _COUNTS[key] = count_params(spec, rank, targets)
    return _COUNTS[key]


def _buffers(spec: ModelSpec, dtype) -> int:
    """Bytes of the transformer's buffers (SD3's positional table is ~0.9 GB in fp32) as the model builds them."""
    from flowforge.tools.plan.sizes import build_transformer

    model = build_transformer(spec, "meta", dtype)
    return sum(b.numel() * b.element_size() for b in model.buffers())


def setting_of(cfg, gpus: int, spec: ModelSpec) -> tuple[Setting, dict]:
    """The :class:`Setting` of ``cfg`` on ``gpus`` ranks, and the facts it was read from."""
    from flowforge.objectives.anchors import anchor_policy_bank
    from flowforge.objectives.registry import OBJECTIVES
    from flowforge.objectives.replay import ReplayObjective, trained_steps_for

    cls = OBJECTIVES[cfg.train.algorithm]
    bank = anchor_policy_bank(cfg.anchor, cls.policy_bank(cls.context(cfg)))
    lora = cfg.lora.trainable == "lora"
    copies = int(bool(bank.get("keep_old"))) + int(bank.get("ema_decay", 0.0) > 0)
    copies += int(bool(bank.get("keep_ref")) and not lora)  # LoRA's ref is the base: adapters off, no copy
    replay = issubclass(cls, ReplayObjective)
    trained = len(trained_steps_for(cfg.sampler, cfg.run.seed, 0)) if replay else 0
    stored = trained * (2 + int(getattr(cls, "store_means", False)))
    rows = math.ceil(cfg.data.prompts_per_step * cfg.data.group_size / gpus)
    g = cfg.sampler.guidance_scale
    cfg_used = g > 1 and not spec.config.get("guidance_embeds", False)
    s = Setting(gpus=gpus, fsdp=cfg.distributed.strategy == "fsdp" and gpus > 1,
                dtype_bytes=DTYPE_BYTES[cfg.model.dtype], param_dtype_bytes=DTYPE_BYTES[cfg.distributed.param_dtype],
                lora=lora, copies=copies, rows_per_rank=rows, micro=min(cfg.train.micro_batch_size, rows),
                rollout_rows=min(cfg.sampler.batch_size or cfg.train.micro_batch_size, rows),
                checkpointing=cfg.distributed.activation_checkpointing, stored_steps=stored,
                text_tokens=spec.text_tokens,
                text_dim=text_dim(spec),
                pooled_dim=spec.config.get("pooled_projection_dim") or 0, cfg_negative=cfg_used,
                offload=cfg.distributed.offload)
    facts = {"objective": cls.__name__, "policy_bank": bank, "replay": replay, "trained_steps": trained,
             "train_guidance": g if replay else 1.0, "rollout_cfg": cfg_used}
    return s, facts


def plan_config(cfg, gpus: int = 1, gpu: str = "h100-80gb", spec: ModelSpec | None = None,
                alternatives: bool = True) -> Plan:
    """The per-rank memory plan of ``cfg`` on ``gpus`` x ``gpu``.

    ``spec``: the model (default: :func:`spec_for` of ``model.adapter`` / ``model.path``).

    Raises:
        ValueError: unknown ``gpu`` (allowed names listed), ``gpus < 1``, a model the planner has no config for, or
            a trainable mode it does not plan (``module`` modes).
    """
    import torch

    gpu_gb = check_gpu(gpu)
    if gpus < 1:
        raise ValueError(f"--gpus={gpus} must be >= 1")
    if cfg.lora.trainable not in ("lora", "full"):
        raise ValueError(f"lora.trainable={cfg.lora.trainable!r}: the planner plans 'lora' and 'full'")
    spec = spec or spec_for(cfg.model.adapter, cfg.model.path, cfg.model.frames)
    dtype = getattr(torch, cfg.model.dtype)
    lora = cfg.lora.trainable == "lora"
    rank = (cfg.lora.rank or 8) if lora else None
    targets = lora_targets(spec.adapter, cfg.lora.targets) if lora else ()
    counts = _counts(spec, rank, targets)
    s, facts = setting_of(cfg, gpus, spec)
    video = cfg.model.frames is not None
    act = _activation_model(spec, dtype, (rank, list(targets)) if lora else None, facts["train_guidance"], video)
    latent = latent_for(spec, cfg.model.height, cfg.model.width, cfg.model.frames)
    tokens = image_tokens(spec, latent)
    buffers = _buffers(spec, dtype)
    n = spec.transformers
    # text encoders / VAE of a local model directory: resident with the transformer while it loads and encodes
    components = {name: component_params(path) for name, path in spec.components.items()}
    facts["components"] = {k: {"class": c, "params": p} for k, (c, p) in components.items()} or \
        "text encoders / VAE not counted: no local model directory"
    other = sum(p for _, p in components.values())
    plan = _evaluate(cfg, s, spec, counts, act, latent, tokens, buffers, gpu, gpu_gb, facts, other)
    plan.facts.update({"source": spec.source, "params": counts.total * n, "lora_params": counts.lora * n,
                       "latent": list(latent), "image_tokens": tokens, "text_tokens": spec.text_tokens,
                       "depth": {k: spec.config[k] for k in spec.depth_keys}, "transformers": n})
    if alternatives and not plan.fits:
        alts = {}
        if not s.checkpointing:
            alts["turn on gradient checkpointing (distributed.activation_checkpointing=true)"] = replace(
                s, checkpointing=True)
        if s.fsdp and s.gpus > 1:  # host memory before more GPUs: cheaper; optimizer states first (smaller cost)
            for mode, what in (("optimizer", "the AdamW states"), ("params", "weights, gradients and AdamW states")):
                if OFFLOAD_ORDER.index(mode) > OFFLOAD_ORDER.index(s.offload):
                    alts[f"offload {what} to host memory (distributed.offload={mode})"] = replace(s, offload=mode)
        for more in (2, 4, 8, 16, 32):
            if more > gpus:
                alts[f"FSDP on {more} GPUs (--gpus {more}, distributed.strategy=fsdp)"] = replace(
                    s, gpus=more, fsdp=True, rows_per_rank=math.ceil(s.rows_per_rank * gpus / more))
        if s.micro > 1:
            alts[f"a smaller micro-batch (train.micro_batch_size={max(1, s.micro // 2)})"] = replace(
                s, micro=max(1, s.micro // 2), rollout_rows=max(1, s.rollout_rows // 2))
        plan.fix = suggest(plan, {k: _evaluate(cfg, v, spec, counts, act, latent, tokens, buffers, gpu, gpu_gb,
                                               facts, other) for k, v in alts.items()})
    return plan


def _evaluate(cfg, s: Setting, spec, counts, act, latent, tokens, buffers, gpu, gpu_gb, facts, other=0) -> Plan:
    n = spec.transformers
    depth = {k: spec.config[k] for k in spec.depth_keys}
    rollout_rows = s.rollout_rows * (2 if facts["rollout_cfg"] and facts["train_guidance"] == 1.0 else 1)
    activations = {"train": act.bytes("train", depth, tokens, spec.text_tokens, s.micro),
                   "checkpointed": act.bytes("checkpointed", depth, tokens, spec.text_tokens, s.micro),
                   "rollout": act.bytes("rollout", depth, tokens, spec.text_tokens, rollout_rows)}
    trained = counts.lora * n if s.lora else counts.total * n
    items, phases = items_for(s, params=counts.total * n, buffer_bytes=buffers * n, trained=trained,
                              largest_block=counts.largest_block, latent_numel=math.prod(latent),
                              activations=activations, other_components=other)
    return Plan(model=spec.source, algorithm=cfg.train.algorithm, trainable=cfg.lora.trainable, gpus=s.gpus,
                gpu=gpu, gpu_gb=gpu_gb, strategy=("fsdp" if s.fsdp else ("ddp" if s.gpus > 1 else "single")),
                items=items, phases=phases, facts=dict(facts, checkpointing=s.checkpointing, micro=s.micro,
                                                      rows_per_rank=s.rows_per_rank))
