"""Ring attention on CPU: a diffusers attention backend whose forward returns the log-sum-exp without CUDA.

diffusers' ring attention (``TemplatedRingAttention`` in ``diffusers/models/attention_dispatch.py``) calls the
backend's forward op with ``return_lse=True`` for every key / value chunk and merges the partial outputs with their
log-sum-exps. Every backend that answers it runs a CUDA (or NPU) kernel: ``_native_flash`` calls
``aten::_scaled_dot_product_flash_attention`` (no CPU kernel), ``_native_cudnn`` cuDNN, ``flash`` / ``sage`` their
CUDA packages, and ``native`` -- the CPU one -- raises ``"Native attention does not support return_lse=True"``
(``_native_attention_forward_op``). PyTorch's CPU flash kernel, ``aten::_scaled_dot_product_flash_attention_for_cpu``
(and its ``_backward``), does return the log-sum-exp: :func:`register` wraps it in diffusers' forward / backward op
pair and installs it as the context-parallel path of diffusers' ``_native_math`` backend (:data:`BACKEND`); without
a parallel config that backend runs diffusers' own function unchanged.
"""

from __future__ import annotations

import torch

BACKEND = "_native_math"
"""The diffusers backend name that carries CPU ring attention once :func:`register` ran."""


def _forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """diffusers' forward-op contract: ``query`` / ``key`` / ``value`` ``[B, S, H, D]`` (model layout) -> ``out``
    ``[B, S, H, D]`` and, with ``return_lse``, ``lse`` ``[B, S, H]`` fp32 (the kernel's layout is ``[B, H, S, D]``)."""
    if enable_gqa:
        raise ValueError("enable_gqa is not supported by the CPU ring attention backend")
    if _save_ctx:  # Ulysses' backward uses these; ring's passes its own key / value / out / lse
        ctx.cpu_attention = (dropout_p, is_causal, attn_mask, scale)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=_visited_mask(ctx, attn_mask, key, "forward", _save_ctx), scale=scale)
    out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    if _save_ctx:
        ctx.save_for_backward(query, key, value, out, lse)
    return (out, lse) if return_lse else out


def _backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None, **kwargs):
    """diffusers' backward-op contract: gradients of ``query`` / ``key`` / ``value`` (``[B, S, H, D]``) from
    ``grad_out``; the tensors given override the saved ones (ring attention passes each chunk's key / value with the
    merged ``out`` / ``lse``, which make the chunk's softmax the globally normalised one)."""
    saved = dict(zip(("query", "key", "value", "out", "lse"), ctx.saved_tensors))
    given = {"query": query, "key": key, "value": value, "out": out, "lse": lse}
    q, k, v, o, m = (saved[n] if given[n] is None else given[n] for n in saved)
    dropout_p, is_causal, attn_mask, scale = ctx.cpu_attention
    mask = _visited_mask(ctx, attn_mask, k, "backward", getattr(ctx, "ring_backward_step", None) is None)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o.transpose(1, 2),
        m.transpose(1, 2).contiguous(), dropout_p, is_causal, attn_mask=mask, scale=scale)
    return tuple(g.transpose(1, 2) for g in grads)


def _prepare_mask(attn_mask, key, config):
    """An additive mask (the CPU kernel takes the query's dtype, not bool; ``finfo.min / 2`` rather than ``-inf``
    so that a chunk whose keys are all masked merges with weight 0 instead of NaN). Under ring attention a mask over
    this rank's keys only (``[..., S_local]``, e.g. Qwen-Image's text padding split by its ``_cp_plan``) is
    all-gathered over the ring to ``[..., S_local * R]``: diffusers hands the same mask to every visited key / value
    chunk, and :func:`_visited_mask` cuts out the visited chunk's part (Ulysses gathers a local mask itself).

    Raises:
        ValueError: a mask under Ulysses and ring together (its chunk layout is not handled here).
    """
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=key.dtype, device=key.device).masked_fill(
            ~attn_mask, torch.finfo(key.dtype).min / 2)
    if config.ring_degree > 1 and attn_mask.shape[-1] == key.shape[1]:
        if config.ulysses_degree > 1:
            raise ValueError("an attention mask under ulysses x ring together is not supported on CPU: "
                             "set distributed.context_parallel.ring=1 or ulysses=1")
        import torch.distributed as dist

        parts = [torch.empty_like(attn_mask) for _ in range(config.ring_degree)]
        dist.all_gather(parts, attn_mask.contiguous(), group=config._ring_mesh.get_group())
        attn_mask = torch.cat(parts, dim=-1)
    return attn_mask


def _visited_mask(ctx, attn_mask, key, direction: str, first: bool):
    """The part of a ring-gathered mask (:func:`_prepare_mask`) for the key / value chunk being visited: diffusers'
    ring loop (``TemplatedRingAttention`` forward and backward alike) visits at its step ``i`` the chunk of ring rank
    ``(rank + i) % R``, starting with its own; ``first`` marks step 0. Any other mask is returned as it is."""
    if attn_mask is None or attn_mask.shape[-1] == key.shape[1]:
        return attn_mask
    config = ctx._parallel_config.context_parallel_config
    attr = f"ring_{direction}_step"
    step = 0 if first else getattr(ctx, attr) + 1
    setattr(ctx, attr, step)
    chunk = (config._ring_local_rank + step) % config.ring_degree
    return attn_mask.chunk(config.ring_degree, dim=-1)[chunk]


def register() -> str:
    """Make diffusers' ``_native_math`` backend context-parallel (Ulysses and ring) on CPU; idempotent. Returns
    the backend name to pass to ``set_attention_backend``. Outside context parallelism the backend is diffusers'
    own function, unchanged."""
    from diffusers.models import attention_dispatch as ad

    name = ad.AttentionBackendName(BACKEND)
    registry = ad._AttentionBackendRegistry
    if BACKEND in registry._supports_context_parallel:
        return BACKEND
    plain = registry._backends[name]

    def native_math_context_parallel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False, return_lse=False, _parallel_config=None):
        if _parallel_config is None:
            return plain(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa, return_lse=return_lse)
        return ad._templated_context_parallel_attention(
            query, key, value, _prepare_mask(attn_mask, key, _parallel_config.context_parallel_config), dropout_p,
            is_causal, scale, enable_gqa, return_lse,
            forward_op=_forward_op, backward_op=_backward_op, _parallel_config=_parallel_config)

    registry.register(name, constraints=registry._constraints[name], supports_context_parallel=True)(
        native_math_context_parallel)
    return BACKEND
