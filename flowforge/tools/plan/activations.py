"""Activation memory of one training forward + backward, measured, not guessed.

The transformer is built on the CPU at its **real width** and **reduced depth** (every block-count key at 1, then
each one at 2), behind its flowforge adapter, with the run's LoRA (rank, targets) or full training, and run forward
(``adapter.velocity``, the run's training guidance) + backward on random inputs of a **tiny** token count under
torch's own :class:`torch.distributed._tools.mem_tracker.MemTracker`. The transient of a micro-batch row is

    T = peak(bytes) - gradients at the peak - bytes held before the forward (weights, inputs)

measured at three token points ``(i, t)``, ``(2i, t)``, ``(i, 2t)`` (image / text tokens) and fitted exactly as
``T = a + b * image_tokens + c * text_tokens`` per depth variant. For depth ``n_k`` of key ``k``:

    T(n) = T(base) + sum_k (n_k - 1) * (T(k at 2) - T(base))

(each extra block adds what one more block added), times the micro-batch rows. Assumptions, stated: attention is
SDPA with O(tokens) memory (flash / memory-efficient kernels on GPUs; the CPU's flash kernel here), so memory is
linear in tokens; blocks of one key cost the same (SD3.5-M's dual-attention blocks 0-12 and its last context-free
block differ slightly from the rest); rows are independent (linear in the micro-batch). The same is measured with
activation checkpointing on (``adapter.enable_gradient_checkpointing``), and for a no-grad forward (the rollout).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

from flowforge.models.registry import FAMILIES
from flowforge.tools.plan.sizes import ModelSpec, build_transformer, text_dim

IMAGE_SIDE = 16  # token cells a side at the first point (x2 along the width at the second); linear from ~256 tokens
TEXT_TOKENS = 32


@dataclass(frozen=True)
class Linear:
    """``a + b * image_tokens + c * text_tokens`` bytes per micro-batch row."""

    a: float
    b: float
    c: float

    def at(self, image_tokens: int, text_tokens: int) -> float:
        return self.a + self.b * image_tokens + self.c * text_tokens

    def __sub__(self, o: "Linear") -> "Linear":
        return Linear(self.a - o.a, self.b - o.b, self.c - o.c)


@dataclass(frozen=True)
class ActivationModel:
    """Measured per-row transients: ``base`` (every depth key at 1) and ``extra[k]`` (one more block of key ``k``),
    for the training forward+backward without / with checkpointing and for a no-grad forward."""

    train: dict[str, Linear]  # "base" and each depth key
    checkpointed: dict[str, Linear]
    rollout: dict[str, Linear]

    @staticmethod
    def _total(parts: dict[str, Linear], depth: dict[str, int], image_tokens: int, text_tokens: int) -> float:
        base = parts["base"].at(image_tokens, text_tokens)
        return max(0.0, base + sum((n - 1) * (parts[k] - parts["base"]).at(image_tokens, text_tokens)
                                   for k, n in depth.items() if k in parts))

    def bytes(self, kind: str, depth: dict[str, int], image_tokens: int, text_tokens: int, rows: int) -> float:
        """Transient bytes of ``rows`` micro-batch rows (``kind``: train | checkpointed | rollout)."""
        return rows * self._total(getattr(self, kind), depth, image_tokens, text_tokens)


def _tokens(latent: tuple[int, ...], patch) -> int:
    """Image tokens of one latent ``[C, (F,) H, W]`` for the transformer's patch size (int or per-axis tuple)."""
    import math

    spatial = latent[1:]
    p = (patch,) * len(spatial) if isinstance(patch, int) else tuple(patch)[-len(spatial):]
    return math.prod(s // q for s, q in zip(spatial, p))


def image_tokens(spec: ModelSpec, latent: tuple[int, ...]) -> int:
    """Image tokens of one sample of ``latent`` shape (packed families' latents are already in token cells)."""
    patch = spec.config.get("patch_size") or (spec.config.get("all_patch_size") or [1])[0]  # Z-Image: a list
    if spec.adapter in PACKED:  # latents are packed 2x2 before the transformer
        patch = 2
    return _tokens(latent, patch)


@contextlib.contextmanager
def _no_random_init():
    """``torch.nn.init``'s random fills as no-ops (the tensors keep ``torch.empty``'s memory)."""
    import torch

    names = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "orthogonal_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def build_adapter(spec: ModelSpec, dtype):
    """The family adapter around a CPU transformer of ``spec`` (no VAE, no text encoder), random init."""
    import torch

    from flowforge.models import adapter_class

    # built with torch.nn.init's random fills turned off, then zero-filled: memory is what is measured, not values,
    # and a random init of a real-width model costs tens of seconds on two cores (the meta device + to_empty would
    # lose tensors some models keep as plain attributes, e.g. Qwen-Image's rotary tables)
    with _no_random_init():
        transformer = build_transformer(spec, "cpu", dtype)
    with torch.no_grad():
        for t in itertools.chain(transformer.parameters(), transformer.buffers()):
            if t.is_floating_point():
                t.zero_()
    return adapter_class(spec.adapter)(transformer)


def _conditioning(spec: ModelSpec, rows: int, tokens: int, dtype, negative: bool):
    import torch

    from flowforge.models.base import Conditioning

    dim = text_dim(spec)
    pooled_dim = spec.config.get("pooled_projection_dim")

    def one():
        return Conditioning(prompt_embeds=torch.randn(rows, tokens, dim, dtype=dtype),
                            pooled=None if pooled_dim is None else torch.randn(rows, pooled_dim, dtype=dtype),
                            mask=torch.ones(rows, tokens, dtype=torch.int64))
    cond = one()
    if negative:
        cond = Conditioning(prompt_embeds=cond.prompt_embeds, pooled=cond.pooled, mask=cond.mask, negative=one())
    return cond


class _NoHook:
    def remove(self) -> None:
        pass


def frozen_safe_tracker(*modules):
    """A :class:`~torch.distributed._tools.mem_tracker.MemTracker` tracking ``modules`` (and optimizers) that also
    works when some parameters are frozen: the tracker registers a gradient hook on every parameter of a module it
    enters, which torch refuses for a tensor without ``requires_grad`` (LoRA's frozen base weights); those
    parameters get a no-op handle in its hook table first (they never receive a gradient, so nothing is missed)."""
    from torch import nn
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    for m in modules:
        if isinstance(m, nn.Module):
            for p in m.parameters():
                if not p.requires_grad:
                    tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    tracker.track_external(*modules)
    return tracker


@contextlib.contextmanager
def tracking(tracker, root):
    """Enter ``tracker`` while ``root`` (the transformer) may be called many times: MemTracker refuses a second
    forward of a root module in one session ("multiple iterative calls"), so its per-module table is cleared before
    each forward of ``root`` (a global pre-forward hook registered before the tracker's own). Only the per-module
    table is cleared: the session's peak and every tracked tensor stay."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    def reset(module, _inputs):
        if module is root and not tracker._mod_tracker.is_bw:
            tracker.reset_mod_stats()

    handle = register_module_forward_pre_hook(reset)
    try:
        with tracker:
            yield tracker
    finally:
        handle.remove()


def _measure(adapter, spec: ModelSpec, latent, text_tokens: int, dtype, guidance: float, grad: bool) -> int:
    """Transient bytes of one row: peak - gradients at the peak - bytes before the forward."""
    import torch

    negative = adapter.guidance_use(guidance) == "cfg"
    x = torch.randn(1, *latent)
    sigma = torch.full((1,), 0.7)
    cond = _conditioning(spec, 1, text_tokens, dtype, negative)
    tracker = frozen_safe_tracker(adapter.transformer)
    with tracking(tracker, adapter.transformer):
        before = tracker.get_tracker_snapshot("current")
        if grad:
            v = adapter.velocity(x, sigma, cond, guidance)
            v.float().square().mean().backward()
        else:
            with torch.no_grad():
                adapter.velocity(x, sigma, cond, guidance)
        peak = tracker.get_tracker_snapshot("peak")
    dev = torch.device("cpu")
    grads = peak[dev].get("Gradient", 0)
    for p in adapter.transformer.parameters():
        p.grad = None
    return peak[dev]["Total"] - grads - before.get(dev, {}).get("Total", 0)


PACKED = tuple(name for name, family in FAMILIES.items() if family.packed_latents)
"""Families whose latents are packed 2x2 into the channel axis (their spec's ``packed_latents``)."""


def latent_for(spec: ModelSpec, height: int, width: int, frames: int | None) -> tuple[int, ...]:
    """One sample's latent ``[C, H/s, W/s]`` (video ``[C, (F - 1) / t + 1, H/s, W/s]``) for the VAE's
    ``spec.latent_scale = (s, t)`` (8x / 4x for most families; Wan2.2 TI2V-5B 16x / 4x); packed families'
    ``in_channels`` counts 2x2 cells."""
    c = spec.config["in_channels"] // (4 if spec.adapter in PACKED else 1)
    s, t = spec.latent_scale
    spatial = (height // s, width // s)
    return (c, (frames - 1) // t + 1, *spatial) if frames else (c, *spatial)


def measure(spec: ModelSpec, *, dtype, lora: tuple[int, tuple[str, ...]] | None, guidance: float,
            video: bool) -> ActivationModel:
    """Measure the :class:`ActivationModel` of ``spec`` (real width; depth keys at 1 and 2) on the CPU.

    ``lora``: ``(rank, targets)`` to train LoRA, ``None`` to train every weight (fp32, as flowforge's full mode).
    ``guidance``: the training forwards' guidance scale (CFG doubles the rows when the family runs it).
    """
    import torch

    from flowforge.models.lora import inject_lora

    frames = 1 if video else None
    results: dict[str, dict[str, Linear]] = {"train": {}, "checkpointed": {}, "rollout": {}}
    variants = [("base", {k: 1 for k in spec.depth_keys})]
    variants += [(k, {**{j: 1 for j in spec.depth_keys}, k: 2}) for k in spec.depth_keys]
    for name, depth in variants:
        sub = spec.with_config(**depth_overrides(spec, depth))
        adapter = build_adapter(sub, torch.float32 if lora is None else dtype)
        if lora is None:
            adapter.transformer.requires_grad_(True)
        else:
            inject_lora(adapter.transformer, lora[0], float(lora[0]), lora[1])
        points = [(IMAGE_SIDE, IMAGE_SIDE, TEXT_TOKENS), (IMAGE_SIDE, 2 * IMAGE_SIDE, TEXT_TOKENS),
                  (IMAGE_SIDE, IMAGE_SIDE, 2 * TEXT_TOKENS)]
        kinds = (("train", False, True), ("checkpointed", True, True))
        if name == "base":  # a no-grad forward frees each block's activations: its peak does not grow with depth
            kinds = (("rollout", False, False),) + kinds
        for kind, ckpt, grad in kinds:
            if ckpt:
                adapter.enable_gradient_checkpointing()
            adapter.transformer.train(grad)
            ys = []
            for h, w, t in points:
                latent = latent_for(sub, 2 * sub.latent_scale[0] * h, 2 * sub.latent_scale[0] * w, frames)
                ys.append((image_tokens(sub, latent), t,
                           _measure(adapter, sub, latent, t, adapter.transformer.dtype, guidance, grad)))
            results[kind][name] = _fit(ys)
        del adapter
    return ActivationModel(**results)


def depth_overrides(spec: ModelSpec, depth: dict[str, int]) -> dict:
    """Config overrides for a reduced depth; per-layer lists (SD3.5's ``dual_attention_layers``) are cut to it."""
    out = dict(depth)
    if "dual_attention_layers" in spec.config and "num_layers" in depth:
        out["dual_attention_layers"] = [i for i in spec.config["dual_attention_layers"] if i < depth["num_layers"]]
    return out


def _fit(points: list[tuple[int, int, int]]) -> Linear:
    """The exact ``a + b i + c t`` through three points ``(i, t, y)`` (the second differs in ``i``, the third in
    ``t``)."""
    (i0, t0, y0), (i1, _, y1), (_, t2, y2) = points
    b = (y1 - y0) / (i1 - i0)
    c = (y2 - y0) / (t2 - t0)
    return Linear(y0 - b * i0 - c * t0, b, c)


__all__ = ["ActivationModel", "Linear", "build_adapter", "image_tokens", "measure"]
