"""A scorer's options as one typed, validated config section: ``reward.options.<name>`` for a scorer that declares
``options_class``.

A scorer whose options are many (the ``vlm_judge``: endpoint, budget, retries, frames) declares them as a frozen
dataclass deriving from :class:`ScorerOptions`, named by ``section_name = "reward.options.<name>"``, and takes an
instance as its first argument. Every field carries its type, its default and a comment (what the generated config
reference, ``docs/hooks/config_reference.py``, prints for it); :meth:`~flowforge.settings.schema.Section.problems`
holds the value rules. An option with a set of allowed values names them in the class's ``choices`` (a list
option: the allowed items); the base class checks them, names them in a wrong type's problem too, and records them
for that page (:func:`~flowforge.settings.schema.note_choice`).

Built from a YAML mapping (:meth:`ScorerOptions.from_options`), in this order, every problem naming
``reward.options.<name>.<option>``:

1. unknown options, with the allowed names;
2. wrong types (:func:`flowforge.runtime.option_types.option_type_problems`, the rule every scorer's options follow:
   an int is no float's string, a bool no int, and a YAML 1.1 float string such as ``1.0e9`` is named with what to
   write instead);
3. values the section refuses (its :meth:`problems`), NaN and infinite floats (:class:`Section`).

Steps 1 and 2 come together; step 3 only when they found nothing (a value of the wrong type has no range to check).
The registry (:mod:`flowforge.rewards.registry`) builds the section before the scorer, and preflight
(``flowforge check``) builds it without the scorer, so a bad option stops a run before any model loads.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from flowforge.runtime.option_types import option_type_problems
from flowforge.settings.schema import Checks, ConfigError, Section, note_bound, note_choice

__all__ = ["ScorerOptions"]

_S = TypeVar("_S", bound="ScorerOptions")


def _plain(value: Any) -> Any:
    """A value as YAML would give it: a path is its string."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _frozen(value: Any) -> Any:
    """A list as a tuple (the sections are frozen), items too."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


class ScorerOptions(Section):
    """Base of a scorer's option section (mix into a ``@dataclass(frozen=True)``; module docstring).

    Construction checks the types of the fields (as YAML gives them) before the section's own rules: a wrong type
    raises :class:`ConfigError` with the type problems only. A subclass's :meth:`problems` extends
    ``super().problems()`` (the :attr:`choices` checks).
    """

    choices: ClassVar[Mapping[str, tuple[Any, ...]]] = {}
    """``{option: allowed values}``; for a list option, the allowed items."""

    def __post_init__(self) -> None:
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        wrong = type(self)._type_problems(given)
        if wrong:
            raise ConfigError(wrong, header=f"invalid {self.section_name}")
        super().__post_init__()

    def problems(self) -> list[str]:
        c = Checks(self)
        for key, allowed in self.choices.items():
            note_choice(c.where(key), allowed)
            value = getattr(self, key)
            if isinstance(value, tuple):
                bad = [v for v in value if v not in allowed]
                c.require(not bad, f"{c.where(key)}={list(value)!r}: {bad} not allowed; give a list of {list(allowed)}")
            else:
                c.require(value in allowed, f"{c.where(key)}={value!r} is not one of {list(allowed)}")
        return c.problems

    def bound(self, c: Checks, key: str, ok: bool, allowed: str) -> None:
        """Require ``ok`` of option ``key`` (else ``"<section>.<key>=<value> must be <allowed>"``); the config
        reference lists ``allowed`` (a range in words, ``"an int >= 1"``) as the option's allowed values."""
        note_bound(c.where(key), allowed)
        c.require(ok, f"{c.where(key)}={getattr(self, key)!r} must be {allowed}")

    @classmethod
    def _type_problems(cls, given: Mapping[str, Any]) -> list[str]:
        """:func:`option_type_problems` of ``given``, each naming the allowed values of an option in
        :attr:`choices`."""
        out = []
        for problem in option_type_problems(cls, given, cls.section_name):
            key = problem.partition(":")[0].removeprefix(f"{cls.section_name}.")
            allowed = cls.choices.get(key)
            out.append(f"{problem}; allowed: {list(allowed)}" if allowed else problem)
        return out

    @classmethod
    def names(cls) -> list[str]:
        """The option names, in field order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls: type[_S], options: Mapping[str, Any]) -> _S:
        """The section from a mapping of options (YAML's, or keyword arguments; a path may be a ``PathLike``, a
        sequence a list); the options it does not name keep their defaults.

        Raises:
            ConfigError: every problem (module docstring), each naming ``<section_name>.<option>`` -- or
                ``<section_name>: unknown option(s) [...]; allowed: [...]``.
        """
        if not isinstance(options, Mapping):
            raise ConfigError([f"{cls.section_name}: expected a mapping of options, got {type(options).__name__}"])
        names = cls.names()
        unknown = sorted(str(k) for k in options if k not in names)
        problems = [f"{cls.section_name}: unknown option{'s' * (len(unknown) > 1)} {unknown}; allowed: {names}"
                    ] if unknown else []
        given = {k: _plain(v) for k, v in options.items() if k in names}
        problems += cls._type_problems(given)
        if problems:
            raise ConfigError(problems, header=f"invalid {cls.section_name}")
        return cls(**{k: _frozen(v) for k, v in given.items()})

    @classmethod
    def option_problems(cls, options: Mapping[str, Any]) -> list[str]:
        """:meth:`from_options`'s problems without raising (``[]`` when the options build)."""
        try:
            cls.from_options(options)
        except ConfigError as exc:
            return exc.problems
        return []
