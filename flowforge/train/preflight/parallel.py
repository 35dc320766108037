"""Preflight rules of context parallelism (``distributed.context_parallel``): before the model loads, the family,
the degrees against the world size and the attention backend; once it loads, the transformer's plan, its heads and
the token counts it would split at the configured size."""

from __future__ import annotations

from flowforge.config import Config
from flowforge.runtime import context_parallel as cp, cp_plans


RING_MASK_FAMILIES = ("qwen_image", "ltx2")
ULYSSES_REFUSED_FAMILIES = ("ltx2",)  # its transformer is in runtime.cp_plans.ULYSSES_REFUSED
"""Families whose attention takes a key mask (padded text): ring attention off CPU gives wrong results with diffusers
0.42 (docs/guides/context-parallel.md, "What is not done"), so preflight refuses it there."""


def cp_families() -> tuple[str, ...]:
    from flowforge.models import CONTEXT_PARALLEL_FAMILIES

    return tuple(CONTEXT_PARALLEL_FAMILIES)


def data_world(cfg: Config, world: int) -> int:
    """Ranks with samples of their own: ``world`` divided by the context-parallel degree (``world`` when that does
    not divide it: reported by :func:`context_parallel_problems`)."""
    degree = cfg.distributed.context_parallel.degree
    return world // degree if world % degree == 0 else world


def context_parallel_problems(cfg: Config, world: int) -> list[str]:
    """One line per problem of ``cfg.distributed.context_parallel`` on ``world`` ranks (``[]`` when it is off)."""
    from flowforge.models import context_parallel_problem

    c = cfg.distributed.context_parallel
    if c.degree == 1:
        return []
    where = "distributed.context_parallel"
    problems = []
    family = context_parallel_problem(cfg.model.adapter)
    if family:
        problems.append(family)
    if world < c.degree:
        problems.append(f"{where}: ulysses x ring = {c.ulysses} x {c.ring} = {c.degree} ranks per sample, but "
                        f"{world} rank(s) run; launch with torchrun --nproc_per_node={c.degree} (or a multiple)")
    else:
        problems += cp.degree_problems(c.ulysses, c.ring, world)
    on_cpu = cfg.run.device == "cpu" and c.attention_backend in (None, "native", cp.cpu_ring_attention.BACKEND)
    if c.ring > 1 and c.attention_backend not in cp.LSE_BACKENDS and not on_cpu:
        problems.append(f"{where}.ring={c.ring} on run.device={cfg.run.device!r} needs {where}.attention_backend set "
                        f"to one of {list(cp.LSE_BACKENDS)} (ring attention merges partial results by their "
                        f"log-sum-exp, which the native SDPA backend does not return; on CPU leave it unset); got "
                        f"{c.attention_backend!r}; or use {where}.ulysses instead")
    if c.ring > 1 and not on_cpu and cfg.model.adapter in RING_MASK_FAMILIES:
        # what is left: Ulysses, unless the family refuses it too (LTX-2: runtime.cp_plans.ULYSSES_REFUSED)
        instead = (f"no context parallelism is left for it off CPU with diffusers 0.42 (Ulysses is refused too); "
                   f"set {where}.ring=1" if cfg.model.adapter in ULYSSES_REFUSED_FAMILIES
                   else f"use {where}.ulysses instead")
        problems.append(f"{where}.ring={c.ring} on run.device={cfg.run.device!r} is refused for "
                        f"model.adapter={cfg.model.adapter!r}: its text attention carries a key mask, which "
                        "diffusers' ring loop hands unsplit to every visited chunk (flowforge corrects that on CPU "
                        f"only); {instead} (ring is allowed off CPU for "
                        f"{sorted(set(cp_families()) - set(RING_MASK_FAMILIES))})")
    if cfg.rollout.engine != "local":  # worker processes would roll out unsplit, outside the context group
        problems.append(f"{where} needs rollout.engine=local (got {cfg.rollout.engine!r})")
    return problems


def loaded_context_parallel_problems(cfg: Config, adapter) -> list[str]:
    """What the loaded ``adapter`` tells about ``distributed.context_parallel`` (``[]`` when it is off): its
    transformer declares a ``_cp_plan``, ``ulysses`` divides its attention heads, and every sequence the plan splits
    at ``model.height`` / ``width`` / ``frames`` (one velocity of one sample on zero latents and an empty prompt,
    measured with :func:`flowforge.runtime.context_parallel.split_sizes`) is a multiple of ``ulysses x ring``."""
    import torch

    c = cfg.distributed.context_parallel
    if c.degree == 1:
        return []
    t = adapter.transformer
    if not cp.planned_modules(t):
        return [f"distributed.context_parallel: {type(t).__name__} declares no _cp_plan, so diffusers cannot split "
                "its sequence; set distributed.context_parallel.ulysses=1 and ring=1"]
    refused = [p for p in (cp_plans.ulysses_problem(m, c.ulysses) for m in cp.planned_modules(t)) if p]
    if refused:
        return refused[:1]
    heads = getattr(getattr(t, "config", None), "num_attention_heads", None)
    if isinstance(heads, int) and heads % c.ulysses:
        return [f"distributed.context_parallel.ulysses={c.ulysses} does not divide the {heads} attention heads of "
                f"{type(t).__name__} (Ulysses gives each rank whole heads); use a divisor of {heads}"]
    m = cfg.model
    latent = adapter.latent_shape(m.height, m.width, m.frames)
    x = torch.zeros(1, *latent, device=cfg.run.device)
    cond = adapter.encode([""])
    sizes = cp.split_sizes(t, lambda: adapter.velocity(x, torch.full((1,), 0.5, device=x.device), cond, 1.0))
    at = f" at model.height={m.height}, width={m.width}" + (f", frames={m.frames}" if m.frames else "")
    return cp.divisibility_problems(sizes, c.degree, at)
