"""Options given to a factory (a scorer's ``reward.options.<name>``) checked against the annotations of its
signature, before it is called: one general rule for every scorer, built-in or imported.

``option_type_problems(VLMJudge, {"retry_backoff_s": "1.0e9"}, "reward.options.vlm_judge")`` gives::

    ["reward.options.vlm_judge.retry_backoff_s: expected float, got a string '1.0e9' (YAML 1.1 reads a number in
      this form as a string); write 1.0e+9 or 1000000000.0"]

What is checked: ``bool``, ``int`` (not a bool), ``float`` (an int is accepted), ``str``, ``pathlib.Path`` /
``os.PathLike`` (a string is accepted), ``X | None`` and other unions, ``list[X]`` / ``tuple[X, ...]`` /
``Sequence[X]`` (each item), ``dict[K, V]`` / ``Mapping[K, V]`` (each value), ``Literal[...]``, and any other class
by ``isinstance``. An annotation that cannot be resolved, ``Any``, and an option the signature does not annotate are
not checked (binding the names is the caller's job).
"""

from __future__ import annotations

import collections.abc as cabc
import inspect
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["option_type_problems"]

_SEQUENCES = (list, tuple, cabc.Sequence, cabc.Iterable, cabc.Collection)
_MAPPINGS = (dict, cabc.Mapping, cabc.MutableMapping)
_FLOAT_TEXT = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+))[eE]([-+]?)(\d+)")


def _hints(factory: Callable[..., Any]) -> dict[str, Any]:
    """The resolved annotations of ``factory``'s parameters (of ``__init__`` for a class); ``{}`` when they cannot
    be resolved (a name only imported under ``TYPE_CHECKING``)."""
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        return typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - NameError, TypeError of odd annotations: nothing is checked then
        return {}


def _fits(value: Any, tp: Any) -> bool:
    """Whether ``value`` (as YAML gives it) is a ``tp``; unknown kinds of annotation fit anything."""
    if tp is Any or tp is None and value is None:
        return True
    if tp is type(None):
        return value is None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type) and issubclass(tp, os.PathLike) or tp is os.PathLike:
        return isinstance(value, (str, os.PathLike))
    if origin in _MAPPINGS:
        return isinstance(value, Mapping) and (len(args) != 2 or all(_fits(v, args[1]) for v in value.values()))
    if origin in _SEQUENCES:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
        return not args or all(_fits(v, args[0]) for v in value)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # a TypeVar, a Protocol alias, ...: not checked


def _name(tp: Any) -> str:
    """``tp`` as a reader writes it: ``float``, ``str | None``, ``list[str]``."""
    if tp is type(None):
        return "None"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else getattr(origin, "__name__", "")
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _accepts(tp: Any, kind: type) -> bool:
    """Whether ``tp`` (or an arm of its union) is ``kind``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_accepts(a, kind) for a in typing.get_args(tp))
    return tp is kind


def _number_hint(value: str, tp: Any) -> str:
    """For a string that reads as a number where ``tp`` wants one: why YAML gave a string and what to write."""
    try:
        number = float(value)
    except ValueError:
        return ""
    match = _FLOAT_TEXT.fullmatch(value.strip())
    # YAML 1.1 (PyYAML) reads 1.0e9 and 1e-4 as strings: its float needs a dot and a signed exponent
    why = " (YAML 1.1 reads a number in this form as a string)" if match else " (quoted)"
    if _accepts(tp, float):
        mantissa = match[1] if match and "." in match[1] else f"{match[1] if match else ''}.0"
        signed = f"{mantissa}e{match[2] or '+'}{match[3]} or " if match else ""
        return f"{why}; write {signed}{number!r}"
    if _accepts(tp, int) and number.is_integer():
        return f"{why}; write {int(number)}"
    return ""


def _got(value: Any) -> str:
    if isinstance(value, str):
        return f"a string {value!r}"
    return f"{type(value).__name__} {value!r}"


def option_type_problems(factory: Callable[..., Any], options: Mapping[str, Any], where: str) -> list[str]:
    """One problem per option of ``options`` whose value does not fit the annotation of ``factory``'s parameter of
    that name (module docstring), each ``"<where>.<option>: expected <type>, got <value>"`` plus, for a number
    written so that YAML 1.1 reads it as a string, what to write instead. ``[]`` when all fit."""
    hints = _hints(factory)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return []
    problems = []
    for key, value in options.items():
        tp = hints.get(key)
        if key not in params or tp is None or _fits(value, tp):
            continue
        hint = _number_hint(value, tp) if isinstance(value, str) else ""
        problems.append(f"{where}.{key}: expected {_name(tp)}, got {_got(value)}{hint}")
    return problems
