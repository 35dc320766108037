"""Model adapters behind the :class:`~flowforge.models.base.FlowModel` protocol, and their registry.

The registry (``ADAPTERS``, ``ADAPTER_CLASSES``, :func:`build_adapter`, the checks of an adapter class without its
weights) is :mod:`.registry`; Hugging Face Hub ids as ``model.path`` are :mod:`.hub`. This module re-exports both
with the protocol's types (``from flowforge.models import build_adapter``).
"""

from __future__ import annotations

from flowforge.models.base import AdapterMixin, Conditioning, FlowModel, ImageConditioned
from flowforge.models.hub import cached_hub_snapshot, download_hint, hub_offline, looks_like_hub_id, resolve_model_path
from flowforge.models.registry import (ADAPTER_CLASSES, ADAPTER_METHODS, ADAPTERS, CONTEXT_PARALLEL_FAMILIES,
                                       FAMILY_TASKS, OWN_FORMAT_FAMILIES, TRANSFORMER_CLASSES, context_parallel_problem,
                                       NotAnAdapter, adapter_class, adapter_class_problem, adapter_tasks, build_adapter,
                                       configure_sampling, option_problems, set_sampler_options, what_an_adapter_is)

__all__ = ["ADAPTERS", "ADAPTER_CLASSES", "ADAPTER_METHODS", "AdapterMixin", "CONTEXT_PARALLEL_FAMILIES",
           "Conditioning", "FAMILY_TASKS", "TRANSFORMER_CLASSES", "context_parallel_problem",
           "FlowModel", "ImageConditioned", "NotAnAdapter", "OWN_FORMAT_FAMILIES", "adapter_class",
           "adapter_class_problem", "adapter_tasks", "build_adapter", "cached_hub_snapshot", "configure_sampling",
           "download_hint", "hub_offline", "looks_like_hub_id", "option_problems", "resolve_model_path",
           "set_sampler_options", "what_an_adapter_is"]
