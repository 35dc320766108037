"""Bring-your-own scorers: a reward component named by import path, ``pkg.module:Factory``, instead of a built-in.

``reward.weights: {"mypkg.rewards:Sharpness": 1.0}`` with ``reward.options: {"mypkg.rewards:Sharpness": {...}}``
imports ``mypkg.rewards``, looks up ``Sharpness`` (a dotted attribute path is allowed: ``Outer.Factory``) and calls
it with the options as keyword arguments. The result must follow the same protocol as the built-ins
(:class:`flowforge.rewards.base.RewardScorer`): a ``name`` string, a ``needs_group`` bool and a
``__call__(media, prompts, metadata) -> [B] float32``. The component's metrics are keyed by the import path
(``reward/mypkg.rewards:Sharpness_mean``).

:func:`check_import_spec` is what preflight runs: it imports the module and checks the factory without loading
models where it can (a class that declares ``name`` and ``needs_group`` is checked statically and its options are
bound to its signature); a plain function is called once, since only its result can be checked.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from flowforge.rewards.base import RewardScorer

_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_import_spec(name: str) -> bool:
    """True when ``name`` is written as an import path (contains ``:``); it is then resolved here, never looked up
    among the built-ins."""
    return isinstance(name, str) and ":" in name


def load_factory(spec: str) -> Callable[..., RewardScorer]:
    """Import the factory named by ``spec`` (``pkg.module:Attr[.Attr]``).

    Raises:
        ValueError: a malformed spec, a module that fails to import (the cause is in the message), a missing
            attribute, or an attribute that is not callable.
    """
    if not _SPEC.match(spec):
        raise ValueError(f"reward component {spec!r}: an import path is 'pkg.module:Factory' (identifiers only)")
    module_name, _, attr_path = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import-time failure of user code is reported, not raised raw
        raise ValueError(f"reward component {spec!r}: cannot import {module_name!r}: "
                         f"{type(exc).__name__}: {exc}") from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward component {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) or inspect.isfunction(obj) or inspect.ismethod(obj)):
        # a builtin (os:getcwd), a module or an instance: not a scorer class or factory function of the right kind
        raise ValueError(f"reward component {spec!r}: {attr_path!r} is a {type(obj).__name__}, not a factory (a "
                         "scorer class or factory function)")
    return obj


def protocol_problems(spec: str, scorer: Any) -> list[str]:
    """What ``scorer`` (an instance, or a class declaring its attributes) lacks of the scorer protocol."""
    problems = []
    if not isinstance(getattr(scorer, "name", None), str):
        problems.append(f"reward component {spec!r}: the scorer has no string attribute 'name'")
    if not isinstance(getattr(scorer, "needs_group", None), bool):
        problems.append(f"reward component {spec!r}: the scorer has no bool attribute 'needs_group'")
    if not callable(scorer if not isinstance(scorer, type) else getattr(scorer, "__call__", None)):
        problems.append(f"reward component {spec!r}: the scorer is not callable as scorer(media, prompts, metadata)")
    return problems


def build_imported(spec: str, options: Mapping[str, Any]) -> RewardScorer:
    """Import and call the factory ``spec`` with ``options``; check the result.

    Raises:
        ValueError: :func:`load_factory` errors, or the result does not follow the scorer protocol.
    """
    factory = load_factory(spec)
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as exc:
        raise ValueError(f"reward component {spec!r}: options {sorted(options)} do not fit it: {exc}") from None
    except ValueError:
        pass  # no introspectable signature: the call reports
    scorer = factory(**options)
    problems = protocol_problems(spec, scorer)
    if problems:
        raise ValueError("; ".join(problems))
    return scorer


def check_import_spec(spec: str, options: Mapping[str, Any]) -> list[str]:
    """Problems with the import-path component ``spec`` and its ``options`` ([] when it will build).

    A class declaring ``name`` and ``needs_group`` is not instantiated: its options are bound to its signature.
    Anything else is called once with ``options`` and its result checked."""
    try:
        factory = load_factory(spec)
    except ValueError as exc:
        return [str(exc)]
    declared = isinstance(factory, type) and "name" in dir(factory) and "needs_group" in dir(factory)
    if declared:
        try:
            inspect.signature(factory).bind(**options)
        except TypeError as exc:
            return [f"reward component {spec!r}: options {sorted(options)} do not fit {factory.__name__}: {exc}"]
        except ValueError:
            pass  # no introspectable signature (a C extension): the options are checked when it is built
        return protocol_problems(spec, factory)
    try:
        scorer = factory(**options)
    except Exception as exc:  # noqa: BLE001 - preflight lists the failure instead of raising
        return [f"reward component {spec!r}: the factory failed: {type(exc).__name__}: {exc}"]
    return protocol_problems(spec, scorer)
