"""Model adapters behind the :class:`~flowforge.models.base.FlowModel` protocol, and their registry.

``build_adapter(name, path, **kw)`` loads a registered family (``ADAPTERS``) or a bring-your-own class named as
``"pkg.module:Class"`` (called as ``Class.from_pretrained(path, **kw)`` when it has that classmethod, else
``Class(path, **kw)``).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from flowforge.models.base import Conditioning, FlowModel


def _load_sd3(path: str, **kw: Any):
    from flowforge.models.sd3 import load_sd3

    return load_sd3(path, **kw)


def _load_flux(path: str, **kw: Any):
    from flowforge.models.flux import load_flux

    return load_flux(path, **kw)


def _load_qwen_image(path: str, **kw: Any):
    from flowforge.models.qwen_image import load_qwen_image

    return load_qwen_image(path, **kw)


def _load_wan(path: str, **kw: Any):
    from flowforge.models.wan import load_wan

    return load_wan(path, **kw)


ADAPTERS: dict[str, Callable[..., FlowModel]] = {
    "sd3": _load_sd3,
    "flux": _load_flux,
    "qwen_image": _load_qwen_image,
    "wan": _load_wan,
}
"""Registered model families: name → loader ``(path, *, dtype, device, ...) -> FlowModel``."""


def _import_object(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"adapter {spec!r}: expected 'pkg.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"adapter {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"adapter {spec!r}: module {module_name!r} has no attribute {attr!r}") from None


def build_adapter(name: str, path: str, **kw: Any) -> FlowModel:
    """Load model ``path`` with adapter ``name`` (a key of ``ADAPTERS`` or ``"pkg.module:Class"``).

    Raises:
        ValueError: unknown name (the allowed names are listed) or an import string that does not resolve.
        TypeError: the built object does not implement ``FlowModel``.
    """
    if name in ADAPTERS:
        adapter = ADAPTERS[name](path, **kw)
    elif ":" in name:
        obj = _import_object(name)
        factory = getattr(obj, "from_pretrained", None)
        adapter = factory(path, **kw) if callable(factory) else obj(path, **kw)
    else:
        raise ValueError(f"unknown model adapter {name!r}; allowed: {sorted(ADAPTERS)} or 'pkg.module:Class'")
    if not isinstance(adapter, FlowModel):
        raise TypeError(f"adapter {name!r} built a {type(adapter).__name__}, which does not implement FlowModel "
                        "(transformer, blocks, encode, latent_shape, velocity, decode)")
    return adapter


__all__ = ["ADAPTERS", "Conditioning", "FlowModel", "build_adapter"]
