"""The one map from dtype names in configs to torch dtypes.

Config keys (``model.dtype``, ``distributed.param_dtype`` / ``reduce_dtype``) take the canonical names of
:data:`DTYPES`; model-loading options of scorers also accept the short :data:`ALIASES` (``bf16``, ...).
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Canonical name → torch dtype; the allowed values of every dtype config key."""

DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)

ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Short names accepted by :func:`resolve_dtype` beside the canonical ones."""


def resolve_dtype(value: str | torch.dtype, *, key: str = "dtype") -> torch.dtype:
    """The torch dtype of a canonical name (``"bfloat16"``), an alias (``"bf16"``) or a torch dtype of
    :data:`DTYPES` (returned as is).

    Args:
        value: the name or dtype.
        key: the config key named in the error.

    Raises:
        ValueError: any other value, listing the allowed names.
    """
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str):
        name = ALIASES.get(value, value)
        if name in DTYPES:
            return DTYPES[name]
    raise ValueError(f"{key} must be one of {sorted([*DTYPES, *ALIASES])} (or the torch dtype), got {value!r}")
