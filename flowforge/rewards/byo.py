"""Bring-your-own scorers: a reward component named by import path, ``pkg.module:name``, instead of a built-in.

``reward.weights: {"mypkg.rewards:Sharpness": 1.0}`` with ``reward.options: {"mypkg.rewards:Sharpness": {...}}``
imports ``mypkg.rewards`` (the working directory and the config file's folder are importable:
:mod:`flowforge.runtime.imports`), looks up ``Sharpness`` (a dotted attribute path is allowed: ``Outer.Factory``)
and makes a scorer of it in one of two ways, decided by its signature (:func:`is_scoring_function`), never by
calling it and catching a ``TypeError``:

- a **scoring function** ``f(media, prompts, metadata, **options) -> scores`` (what TRL reward functions look
  like): a function whose required positional parameters not named by the options are exactly three. It is
  wrapped in a :class:`FunctionScorer` (``needs_group = False``) that calls it with the options as keywords and
  turns what it returns (a ``[B]`` tensor, a list of floats) into a ``[B]`` float32 tensor. A scoring function
  whose first parameter is named ``latents`` (``f(latents, prompts, metadata, **options)``) is a latent scorer
  (``takes_latents = True``): it gets the clean latents ``[B, *latent]`` instead of decoded media;
- a **factory**: a class, or a function with no required parameter left once the options are bound, called once
  with the options as keyword arguments. Its result must follow the same protocol as the built-ins
  (:class:`flowforge.rewards.base.RewardScorer`): a ``name`` string, a ``needs_group`` bool and a
  ``__call__(media, prompts, metadata) -> [B] float32``.

Any other function (one or two required parameters left) is refused, naming both forms. The component's metrics
are keyed by the import path (``reward/mypkg.rewards:Sharpness_mean``).

:func:`check_import_spec` is what preflight runs: it imports the module and checks the factory without loading
models where it can (a class that declares ``name`` and ``needs_group`` is checked statically and its options are
bound to its signature; a scoring function's options are bound to its signature); a factory function is called
once, since only its result can be checked.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowforge.rewards.base import RewardScorer
from flowforge.runtime.imports import REFERENCE, import_object
from flowforge.runtime.option_types import option_type_problems

SCORING_ARGS = ("media", "prompts", "metadata")
"""The three arguments a scoring function takes first, in this order."""
_FORMS = ("a scorer class, a factory function (no required arguments besides the options) or a scoring function "
          "f(media, prompts, metadata)")


def is_import_spec(name: str) -> bool:
    """True when ``name`` is written as an import path (contains ``:``); it is then resolved here, never looked up
    among the built-ins."""
    return isinstance(name, str) and ":" in name


def load_factory(spec: str) -> Callable[..., Any]:
    """Import the class or function named by ``spec`` (``pkg.module:Attr[.Attr]``).

    Raises:
        ValueError: a malformed spec, a module that fails to import (the cause is in the message), a missing
            attribute, or an attribute that is neither a class nor a function.
    """
    if not REFERENCE.match(spec):
        raise ValueError(f"reward component {spec!r}: an import path is 'pkg.module:Factory' (identifiers only)")
    obj = import_object(spec, f"reward component {spec!r}")
    if not (isinstance(obj, type) or inspect.isfunction(obj) or inspect.ismethod(obj)):
        # a builtin (os:getcwd), a module or an instance: not a scorer class, factory or scoring function
        raise ValueError(f"reward component {spec!r}: {spec.partition(':')[2]!r} is a {type(obj).__name__}, not a "
                         f"factory ({_FORMS})")
    return obj


def _required_left(fn: Callable[..., Any], options: Mapping[str, Any]) -> list[str] | None:
    """Names of ``fn``'s required positional parameters that ``options`` does not name, in order (None when the
    signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.default is p.empty and p.name not in options]


def is_scoring_function(obj: Any, options: Mapping[str, Any] | None = None) -> bool:
    """True when ``obj`` is a function (not a class) to be called per batch as ``obj(media, prompts, metadata,
    **options)``: exactly three of its required positional parameters are left once ``options`` are bound by name.
    A function with none left is a factory; see :func:`scorer_form_problem` for the rest."""
    return not isinstance(obj, type) and len(_required_left(obj, options or {}) or ()) == 3


def scorer_form_problem(spec: str, obj: Any, options: Mapping[str, Any]) -> str | None:
    """Why ``obj`` is neither a factory nor a scoring function given ``options`` (None when it is one)."""
    if isinstance(obj, type):
        return None
    left = _required_left(obj, options)
    if left is None or len(left) in (0, 3):
        return None
    return (f"reward component {spec!r}: {obj.__name__}{inspect.signature(obj)} leaves {len(left)} required "
            f"argument{'s' * (len(left) > 1)} ({', '.join(left)}) besides the options {sorted(options)}: give "
            f"{_FORMS}")


class FunctionScorer:
    """A scoring function ``fn(media, prompts, metadata, **options)`` as a scorer (``needs_group = False``).

    Called as every scorer: ``media [B, 3, H, W]`` float in [0, 1] (a video scorer sees frames), ``prompts`` and
    ``metadata`` of length B; ``fn`` may return a ``[B]`` tensor or a sequence of B numbers (NaN = not
    applicable). Returns ``[B]`` float32 on ``media``'s device. A function whose first parameter is named
    ``latents`` is called with the clean latents ``[B, *latent]`` instead (``takes_latents``).

    Raises:
        ValueError: ``fn`` returned something that is not B numbers.
    """

    needs_group = False

    def __init__(self, fn: Callable[..., Any], spec: str, options: Mapping[str, Any]) -> None:
        self.fn, self.spec, self.options = fn, spec, dict(options)
        self.name = fn.__name__
        self.takes_latents = (_required_left(fn, options) or [None])[0] == "latents"
        self.differentiable = getattr(fn, "differentiable", False) is True  # f.differentiable = True declares it

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        out = self.fn(media, prompts, metadata, **self.options)
        try:
            scores = torch.as_tensor(out, dtype=torch.float32, device=media.device)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"reward component {self.spec!r} returned {type(out).__name__}, not {media.shape[0]} "
                             f"numbers ({exc})") from None
        if scores.shape != (media.shape[0],):
            raise ValueError(f"reward component {self.spec!r} returned shape {tuple(scores.shape)}; a scoring "
                             f"function returns one score per sample: [{media.shape[0]}]")
        return scores


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


def _placeholders(scoring: bool) -> tuple[None, ...]:
    """Stand-ins for (media, prompts, metadata) when binding a scoring function's options to its signature."""
    return (None,) * len(SCORING_ARGS) if scoring else ()


def build_imported(spec: str, options: Mapping[str, Any]) -> RewardScorer:
    """The scorer ``spec`` names, built with ``options`` (module docstring: a scoring function is wrapped, a
    factory called); the result checked.

    Raises:
        ValueError: :func:`load_factory` errors, a function that is neither form, options that do not fit its
            signature, or a factory's result that does not follow the scorer protocol.
    """
    factory = load_factory(spec)
    problem = scorer_form_problem(spec, factory, options)
    if problem:
        raise ValueError(problem)
    scoring = is_scoring_function(factory, options)
    try:
        inspect.signature(factory).bind(*_placeholders(scoring), **options)
    except TypeError as exc:
        raise ValueError(f"reward component {spec!r}: options {sorted(options)} do not fit it: {exc}") from None
    except ValueError:
        pass  # no introspectable signature: the call reports
    if scoring:
        return FunctionScorer(factory, spec, options)
    scorer = factory(**options)
    problems = protocol_problems(spec, scorer)
    if problems:
        raise ValueError("; ".join(problems))
    return scorer


def check_import_spec(spec: str, options: Mapping[str, Any]) -> list[str]:
    """Problems with the import-path component ``spec`` and its ``options`` ([] when it will build).

    A class declaring ``name`` and ``needs_group`` is not instantiated and a scoring function is not called: the
    options are bound to the signature (and, for a class with a static ``option_problems(options) -> list[str]``,
    checked by it). Any other factory is called once with ``options`` and its result checked."""
    try:
        factory = load_factory(spec)
    except ValueError as exc:
        return [str(exc)]
    problem = scorer_form_problem(spec, factory, options)
    if problem:
        return [problem]
    scoring = is_scoring_function(factory, options)
    declared = isinstance(factory, type) and "name" in dir(factory) and "needs_group" in dir(factory)
    if declared or scoring:
        try:
            inspect.signature(factory).bind(*_placeholders(scoring), **options)
        except TypeError as exc:
            return [f"reward component {spec!r}: options {sorted(options)} do not fit {factory.__name__}: {exc}"]
        except ValueError:
            pass  # no introspectable signature (a C extension): the options are checked when it is built
        wrong = option_type_problems(factory, options, f"reward.options.{spec}")
        # a class's own check of its option values: a static or class method (an instance method needs an instance)
        checker = inspect.getattr_static(factory, "option_problems", None) if isinstance(factory, type) else None
        if not wrong and isinstance(checker, (staticmethod, classmethod)):
            wrong = [f"reward component {spec!r}: {p}" for p in getattr(factory, "option_problems")(dict(options))]
        return wrong or ([] if scoring else protocol_problems(spec, factory))
    try:
        scorer = factory(**options)
    except Exception as exc:  # noqa: BLE001 - preflight lists the failure instead of raising
        return [f"reward component {spec!r}: the factory failed: {type(exc).__name__}: {exc}"]
    return protocol_problems(spec, scorer)
