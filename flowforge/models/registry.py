"""The registry of model adapters behind the :class:`~flowforge.models.base.FlowModel` protocol (re-exported by
:mod:`flowforge.models`).

``build_adapter(name, path, **kw)`` loads a registered family (``ADAPTERS``) or a bring-your-own class named as
``"pkg.module:Class"`` (called as ``Class.from_pretrained(path, **kw)`` when it has that classmethod, else
``Class(path, **kw)``). The trainer passes ``task`` (``model.task``), ``dtype`` and ``device``; ``path`` is a
local path or a Hugging Face Hub id (``demo:`` names are resolved above this package, by
:func:`flowforge.demo.paths.resolve_demo_path`).

**Hub ids.** For a registered family, a ``path`` that is not on disk and looks like a Hub id (``org/name``,
:func:`looks_like_hub_id`) is resolved to a local snapshot by :func:`resolve_model_path`
(``huggingface_hub.snapshot_download``: the local cache first; a download only when ``HF_HUB_OFFLINE`` is unset).
Offline and not cached is a :class:`~flowforge.runtime.errors.UserError` saying how to download it.

``ADAPTER_CLASSES`` names each registered family's adapter class (``"module:Class"``) so that a config can be checked
against the class — e.g. which tasks it runs (:func:`adapter_tasks`) — by importing it, without loading weights.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any, Callable

from flowforge.models.base import (HOOK_MEMBERS, REQUIRED_MEMBERS, FlowModel, check_condition_slot,
                                   missing_members)
from flowforge.models.family import Family
from flowforge.models.hub import resolve_model_path
from flowforge.models.load import own_aligned_storage
from flowforge.runtime.errors import UserError
from flowforge.runtime.imports import import_object


FAMILY_PACKAGES: tuple[str, ...] = (
    "sd3",
    "flux",
    "qwen_image",
    "wan",
    "world_model",
    "z_image",
    "flux2",
    "ltx2",
    "hunyuan_video15",
)
"""The registered families, one line each: the package ``flowforge.models.<name>`` exports ``FAMILY``, its
:class:`~flowforge.models.family.Family` (adding a family is its folder and one line here)."""

FAMILIES: dict[str, Family] = {spec.name: spec for spec in (importlib.import_module(f"flowforge.models.{name}").FAMILY
                                                            for name in FAMILY_PACKAGES)}
"""Registered family name (``model.adapter``) -> its spec."""

# views of the specs, under the names the rest of flowforge imported before there were specs
ADAPTERS: dict[str, Callable[..., FlowModel]] = {name: spec.load for name, spec in FAMILIES.items()}
"""Registered model families: name -> loader ``(path, *, task, dtype, device, ...) -> FlowModel`` (the task checked
by :meth:`~flowforge.models.family.Family.check_task`)."""

ADAPTER_CLASSES: dict[str, str] = {name: spec.adapter for name, spec in FAMILIES.items()}
"""Registered family -> its adapter class as ``"module:Class"`` (imported on demand by :func:`adapter_class`)."""

OWN_FORMAT_FAMILIES: tuple[str, ...] = tuple(name for name, spec in FAMILIES.items() if spec.own_format)
"""Registered families saved in a file format of their own rather than as a diffusers transformer (what ``flowforge
export`` writes for them: :mod:`flowforge.tools.export.world`)."""

FAMILY_TASKS: dict[str, tuple[str, ...]] = {name: spec.tasks for name, spec in FAMILIES.items()}
"""Registered family -> the tasks it runs (``WanAdapter.tasks`` is a per-checkpoint property; the family runs the
union)."""

TRANSFORMER_CLASSES: dict[str, str] = {name: spec.transformer for name, spec in FAMILIES.items() if spec.transformer}
"""Registered family -> the diffusers class of its transformer (the world model's is flowforge's own)."""

CONTEXT_PARALLEL_FAMILIES: tuple[str, ...] = tuple(sorted(name for name, spec in FAMILIES.items()
                                                          if spec.context_parallel))
"""Families whose sequence diffusers' context parallelism splits (the transformer declares a ``_cp_plan``) and whose
split velocity and LoRA gradients were measured equal to one rank's under Ulysses and ring (Wan 2.2's two experts
included; LTX-2 under ring only, with flowforge's plan: flowforge.runtime.cp_plans; tests/test_context_parallel.py)."""


def context_parallel_problem(name: str) -> str | None:
    """Why ``model.adapter=name`` cannot run context parallelism (one line listing the families that can), or None
    for a family of :data:`CONTEXT_PARALLEL_FAMILIES` and for a ``"pkg.module:Class"`` (judged on its transformer
    once loaded)."""
    why = FAMILIES[name].context_parallel_problem() if name in FAMILIES else None
    if why is None:
        return None
    return (f"distributed.context_parallel needs a model whose sequence diffusers can split; model.adapter={name!r} "
            f"cannot ({why}); families that support it: {list(CONTEXT_PARALLEL_FAMILIES)}")


def _import_object(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"adapter {spec!r}: expected 'pkg.module:Class'")
    obj = import_object(spec, f"adapter {spec!r}")  # the working directory and the config's folder importable
    if not (isinstance(obj, type) or inspect.isfunction(obj)):  # os:getcwd: called with the adapter's arguments
        raise ValueError(f"adapter {spec!r}: {attr!r} is a {type(obj).__name__}, not an adapter class or factory "
                         "function; name one as 'pkg.module:Class'")
    return obj


def adapter_class(name: str) -> type:
    """The adapter class of ``name`` (a key of ``ADAPTER_CLASSES`` or ``"pkg.module:Class"``), imported without
    loading any weights.

    Raises:
        ValueError: unknown name (the allowed names are listed) or an import string that does not resolve.
    """
    if name in ADAPTER_CLASSES:
        return _import_object(ADAPTER_CLASSES[name])
    if ":" in name:
        return _import_object(name)
    raise ValueError(f"unknown model adapter {name!r}; allowed: {sorted(ADAPTER_CLASSES)} or 'pkg.module:Class'")


def adapter_tasks(name: str) -> tuple[str, ...] | None:
    """Tasks (``"t2i"``, ``"t2v"``, ``"i2v"``, ...) adapter ``name`` can run: a registered family's spec
    (:attr:`~flowforge.models.family.Family.tasks`), else the ``"pkg.module:Class"``'s ``tasks`` tuple; ``None``
    when such a class declares none (or only per instance).

    Raises:
        ValueError: as :func:`adapter_class`.
    """
    if name in FAMILIES:
        return FAMILIES[name].tasks
    tasks = inspect.getattr_static(adapter_class(name), "tasks", None)
    if isinstance(tasks, (tuple, list, frozenset, set)) and all(isinstance(t, str) for t in tasks):
        return tuple(tasks)
    return None


ADAPTER_METHODS: tuple[str, ...] = tuple(m for m in REQUIRED_MEMBERS if m != "transformer")
"""The required :class:`FlowModel` members an adapter class defines as methods (``transformer`` is set per
instance, so a class is judged on these)."""


class NotAnAdapter(UserError, TypeError):
    """``model.adapter`` names something that is not a :class:`FlowModel` adapter. A :class:`UserError` (the command
    line prints it in one line, exit 2) and a ``TypeError`` (what :func:`build_adapter` raised before)."""


def what_an_adapter_is() -> str:
    """The fix part of an adapter error: the registered names, or what a class must implement."""
    return (f"use a registered adapter {sorted(ADAPTER_CLASSES)} or a 'pkg.module:Class' implementing the FlowModel "
            f"protocol of flowforge/models/base.py (a transformer attribute and the methods {list(ADAPTER_METHODS)}; "
            "inherit flowforge.models.base.AdapterMixin for the optional hooks)")


def adapter_class_problem(name: str) -> str | None:
    """Why the bring-your-own class ``name`` (``"pkg.module:Class"``) cannot be an adapter, judged from the class
    without building it: the :data:`ADAPTER_METHODS` it lacks. ``None`` for a registered family, a factory function
    (what it returns is checked by :func:`build_adapter`) and a class that has them all.

    Raises:
        ValueError: as :func:`adapter_class`.
    """
    obj = adapter_class(name)
    if name in ADAPTER_CLASSES or not isinstance(obj, type):
        return None
    missing = [m for m in ADAPTER_METHODS if not callable(getattr(obj, m, None))]
    if not missing:
        return None
    return f"{name!r} is not a FlowModel adapter class: {obj.__name__} has no {missing}"


def option_problems(name: str, options: Mapping[str, Any]) -> list[str]:
    """One line per key of ``options`` (``sampler`` keys that are set) that adapter ``name``'s class does not list in
    its ``sampler_options`` (imported, no weights loaded); ``[]`` when ``name`` does not resolve (reported
    elsewhere)."""
    try:
        declared = tuple(getattr(adapter_class(name), "sampler_options", ()))
    except ValueError:
        return []
    return [f"sampler.{key}={value!r} is not read by model.adapter={name!r} (it reads "
            f"{[f'sampler.{k}' for k in declared] or 'none of these keys'}); remove it"
            for key, value in options.items() if key not in declared]


def set_sampler_options(adapter: FlowModel, options: Mapping[str, Any]) -> None:
    """Put the ``sampler`` keys that are set (``SamplerConfig.model_options``) on a built adapter as attributes of
    the same name, before :meth:`FlowModel.latent_shape` and any encoding (``frame_rate`` sets LTX-2's audio length).

    Raises:
        ValueError: a key the adapter does not list in ``sampler_options``.
    """
    declared = tuple(getattr(adapter, "sampler_options", ()))
    for key, value in options.items():
        if key not in declared:
            raise ValueError(f"sampler.{key}: {type(adapter).__name__} does not read it (sampler_options: "
                             f"{list(declared)})")
        setattr(adapter, key, value)


def configure_sampling(adapter: FlowModel, sampler: Any) -> None:
    """What the ``sampler`` section sets on a built adapter before any prompt is encoded: ``negative_prompt`` (part
    of the encodings and their cache key) when given, then the family's keys (:func:`set_sampler_options`; before
    :meth:`FlowModel.latent_shape`: LTX-2's frame rate sets its audio length). The trainer and ``sample`` call it.

    Raises:
        ValueError: as :func:`set_sampler_options`.
    """
    if sampler.negative_prompt is not None:
        adapter.negative_prompt = sampler.negative_prompt
    set_sampler_options(adapter, sampler.model_options)


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes keyword ``name`` (by name or through ``**kwargs``)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def build_adapter(name: str, path: str, **kw: Any) -> FlowModel:
    """Load model ``path`` with adapter ``name`` (a key of ``ADAPTERS`` or ``"pkg.module:Class"``).

    Raises:
        ValueError: unknown name (the allowed names are listed) or an import string that does not resolve.
        UserError: a registered family's ``path`` is a Hub id that cannot be resolved (:func:`resolve_model_path`).
        NotAnAdapter: (a ``UserError`` and a ``TypeError``) the built object does not implement ``FlowModel``
            (required members and hooks: the missing ones are listed).
        TypeError: the adapter declares a condition slot without ``generated_index``.
    """
    if name in ADAPTERS:
        adapter = ADAPTERS[name](resolve_model_path(path), **kw)
    elif ":" in name:
        obj = _import_object(name)
        factory = getattr(obj, "from_pretrained", None)
        factory = factory if callable(factory) else obj
        if "task" in kw and not _accepts(factory, "task"):  # adapters written before loaders received the task
            kw = {k: v for k, v in kw.items() if k != "task"}
        adapter = factory(path, **kw)
    else:
        raise ValueError(f"unknown model adapter {name!r}; allowed: {sorted(ADAPTERS)} or 'pkg.module:Class'")
    if not isinstance(adapter, FlowModel):
        raise NotAnAdapter("model.adapter", f"{name!r} built a {type(adapter).__name__}, which does not implement "
                           f"FlowModel: missing {missing_members(adapter)} (AdapterMixin gives the defaults of the "
                           f"optional hooks {list(HOOK_MEMBERS)})", what_an_adapter_is())
    check_condition_slot(adapter)
    own_aligned_storage(adapter)  # a model loaded from disk computes what the same weights in memory compute
    return adapter
