"""Small helpers shared by the math modules: compute dtype, per-sample broadcasting, prompt-group indexing.

What
    ``compute_dtype`` picks the dtype every quantity is computed in (fp32, or float64 when an input is float64, for
    golden-vector tests). ``per_sample`` turns a python float, a 0-d tensor or a tensor of the expected shape into a
    tensor of that shape (noise levels, transition stds, ``dt``). ``group_index`` maps prompt-group ids to integer
    codes for scatter / ``index_add`` reductions.

Why
    One definition each, used by ``sde``, ``advantages`` and every loss, so inputs are accepted and rejected the same
    way everywhere.
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, Sequence, Tuple, Union

import torch

__all__ = ["GroupIds", "compute_dtype", "per_sample", "group_index"]

GroupIds = Union[torch.Tensor, Sequence[Hashable]]


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16 / fp16 inputs are computed in fp32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def per_sample(
    value: Union[float, torch.Tensor],
    name: str,
    shape: Tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    shape_label: str = "[B]",
) -> torch.Tensor:
    """A python float, a 0-d tensor or a tensor of exactly ``shape`` -> a tensor of ``shape`` in ``dtype``.

    Args:
        value: the number(s); float or integer dtype.
        name: the argument's name, for errors. shape: the wanted shape, e.g. ``(B,)`` or ``log_prob.shape``.
        dtype, device: of the result. shape_label: how errors name ``shape`` (e.g. ``"[B]"``, ``"of log_prob"``).
    Returns:
        ``value`` converted to ``dtype`` (a 0-d value is expanded, not copied).
    Raises:
        ValueError: a non-numeric dtype (bool, complex), or a shape that is neither 0-d nor ``shape``.
    """
    shape = tuple(shape)
    # A python float is rounded once, to ``dtype``: ``as_tensor`` would round it to float32 first (float64 inputs
    # would then see e.g. 0.8 as 0.800000011920929).
    if isinstance(value, float):
        t = torch.tensor(value, dtype=dtype, device=device)
    else:
        t = torch.as_tensor(value, device=device)
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"{name} must be a float or a float tensor, got dtype {t.dtype}")
    t = t.to(dtype)
    if t.ndim == 0:
        return t.expand(shape)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be a float, a 0-d tensor or shape {shape_label}={list(shape)}, got "
                         f"{list(t.shape)}")
    return t


def group_index(group_ids: GroupIds, batch: int, device: torch.device) -> Tuple[torch.Tensor, int, Tuple[Any, ...]]:
    """Integer codes of prompt groups.

    Args:
        group_ids: ``[B]`` integer tensor, or a sequence of ``B`` hashables (prompt ids / strings).
        batch: ``B``. device: of the returned codes.
    Returns:
        ``(inverse, G, labels)``: ``inverse`` ``[B]`` int64 in ``0..G-1``, ``G`` the number of groups, ``labels`` the
        original id of each group (integer tensors: ascending id; sequences: order of first appearance).
    Raises:
        ValueError: wrong length / shape, or a float tensor.
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.shape != (batch,):
            raise ValueError(f"group_ids must have shape [B]=[{batch}], got {tuple(group_ids.shape)}")
        if group_ids.is_floating_point():
            raise ValueError(f"group_ids must be an integer tensor (int64), got {group_ids.dtype}")
        uniq, inv = torch.unique(group_ids.to(device), return_inverse=True)
        return inv, int(uniq.numel()), tuple(uniq.tolist())
    ids = list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids must have {batch} entries (one per reward), got {len(ids)}")
    table: Dict[Hashable, int] = {}
    codes = [table.setdefault(g, len(table)) for g in ids]
    return torch.tensor(codes, dtype=torch.int64, device=device), len(table), tuple(table)
