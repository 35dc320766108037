"""The config schema machinery: typed frozen dataclass sections, YAML coercion, merging, overrides, dumping.

A *section* is a frozen dataclass deriving from :class:`Section`: its fields are the keys of one top-level mapping
of a config file, its ``section_name`` class attribute is that mapping's name, and it checks its own values when it
is constructed (:meth:`Section.problems`; a bad value raises :class:`ConfigError` naming ``section.key``, the value
and what is allowed). The *root* is a frozen dataclass whose fields are sections (:func:`make_root`).

Precedence is defaults < YAML < ``section.key=value`` overrides. :func:`build` coerces a nested mapping into a
dataclass and collects *every* problem (unknown keys with the allowed names, wrong types, values a section refuses)
into one :class:`ConfigError`, so a user fixes a file in one round trip. Every float value of every section, inside
lists and mappings too, must be a number (NaN is refused) and finite unless its field is marked :data:`ALLOW_INF`
(:func:`nonfinite_problems`, checked by :class:`Section` itself, so no section repeats it).

:func:`fingerprint` and :func:`config_diff` compare configs key by key (``"section.key"``), leaving out keys that do
not matter for the comparison (e.g. the resume-neutral keys of :mod:`flowforge.settings.sections`).

This module imports only the standard library and PyYAML: configs are validated and dumped without torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import hashlib
import math
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import yaml


class ConfigError(ValueError):
    """A config could not be loaded or is invalid. ``problems`` lists every violation found."""

    def __init__(self, problems: Sequence[str], header: str = "invalid config"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{header} ({len(self.problems)} problem{'s' * (len(self.problems) != 1)}):\n{lines}")


class Checks:
    """Collects a section's problems, each naming ``section.key``, the value and what is allowed."""

    def __init__(self, section: "Section"):
        self.section = section
        self.problems: list[str] = []

    def where(self, key: str) -> str:
        return f"{self.section.section_name}.{key}"

    def choice(self, key: str, allowed: Iterable[Any]) -> None:
        """``key``'s value must be one of ``allowed``."""
        allowed = tuple(allowed)
        note_choice(self.where(key), allowed)
        value = getattr(self.section, key)
        if value not in tuple(allowed):
            self.problems.append(f"{self.where(key)}={value!r} is not one of {list(allowed)}")

    def positive(self, *keys: str, allow_zero: bool = False) -> None:
        """Each of ``keys`` must be > 0 (>= 0 with ``allow_zero``) and finite; ``None`` (unset) passes."""
        for key in keys:
            value = getattr(self.section, key)
            if value is None:
                continue
            ok = value >= 0 if allow_zero else value > 0
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                self.problems.append(f"{self.where(key)}={value!r} must be {'>= 0' if allow_zero else '> 0'}")

    def require(self, ok: bool, message: str) -> None:
        """Record ``message`` unless ``ok``."""
        if not ok:
            self.problems.append(message)


_CHOICES: contextvars.ContextVar[dict[str, tuple[Any, ...]] | None] = contextvars.ContextVar("_CHOICES", default=None)


@contextlib.contextmanager
def recorded_choices() -> Iterator[dict[str, tuple[Any, ...]]]:
    """While active, every choice check (:meth:`Checks.choice`, and preflight's checks of names owned by other
    modules) records ``{"section.key": allowed values}`` into the yielded dict. The generated config reference
    (``docs/hooks/config_reference.py``) reads each key's allowed values this way, from the checks themselves, so
    the page cannot list values the checks would refuse."""
    seen: dict[str, tuple[Any, ...]] = {}
    token = _CHOICES.set(seen)
    try:
        yield seen
    finally:
        _CHOICES.reset(token)


def note_choice(where: str, allowed: Iterable[Any]) -> None:
    """Record that ``where`` (``"section.key"``) must be one of ``allowed`` when :func:`recorded_choices` is
    active; a no-op otherwise."""
    seen = _CHOICES.get()
    if seen is not None:
        seen[where] = tuple(allowed)


class Bound(str):
    """An allowed range in words (``"an int >= 1"``), recorded by :func:`note_bound` where a choice records values:
    the config reference prints it as it is."""


def note_bound(where: str, allowed: str) -> None:
    """Record that ``where`` must be ``allowed`` (a range in words) when :func:`recorded_choices` is active."""
    note_choice(where, (Bound(allowed),))


class Section:
    """Base of every config section (mix into a ``@dataclass(frozen=True)``).

    Subclasses set ``section_name`` and override :meth:`problems`; construction raises :class:`ConfigError` listing
    every problem of the section at once. Rules that read more than one section live in
    :func:`flowforge.train.preflight.preflight`.
    """

    section_name: ClassVar[str] = ""

    def problems(self) -> list[str]:
        """Every violation of this section's own rules (empty when valid)."""
        return []

    def __post_init__(self) -> None:
        # Non-finite floats first: a NaN compares false with everything, so a section's own rules would either let
        # it through or describe it misleadingly ("must be > 0"); their problems about that key are dropped.
        bad = nonfinite_problems(self)
        problems = self.problems()
        if bad:
            problems = [*bad.values(), *(p for p in problems if not any(f"{where}=" in p for where in bad))]
        if problems:
            raise ConfigError(problems, header=f"invalid section '{self.section_name}'")


ALLOW_INF: Mapping[str, Any] = types.MappingProxyType({"allow_inf": True})
"""``dataclasses.field(metadata=ALLOW_INF)``: a float field where ``inf`` means something (e.g. "no limit").
Every other float field of a section refuses ``inf`` and ``-inf``; every float field refuses NaN."""


def _nonfinite(value: Any, where: str, allow_inf: bool, out: dict[str, str]) -> None:
    if isinstance(value, float):
        if math.isnan(value):
            out[where] = f"{where}=nan is not a number; give a finite number"
        elif math.isinf(value) and not allow_inf:
            out[where] = f"{where}={value!r} must be finite"
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            _nonfinite(item, f"{where}[{i}]", allow_inf, out)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _nonfinite(item, f"{where}.{key}", allow_inf, out)


def nonfinite_problems(section: Section) -> dict[str, str]:
    """``{"section.key": problem}`` for every NaN float of ``section`` (inside lists and mappings too) and every
    infinite one outside fields marked :data:`ALLOW_INF`; the key is the field's ``section.key`` even when the value
    sits inside it (the problem names the exact place, e.g. ``reward.weights.digit=nan``)."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(section):
        found: dict[str, str] = {}
        _nonfinite(getattr(section, f.name), f"{section.section_name}.{f.name}", bool(f.metadata.get("allow_inf")),
                   found)
        if found:
            out[f"{section.section_name}.{f.name}"] = "; ".join(found.values())
    return out


def make_root(name: str, sections: Sequence[type], module: str, doc: str | None = None) -> type:
    """A frozen root dataclass with one field per section class (named by its ``section_name``, in this order,
    defaulting to the section's defaults).

    Raises:
        ValueError: two sections share a name, or a section class has no ``section_name``.
    """
    seen: dict[str, type] = {}
    for cls in sections:
        section = getattr(cls, "section_name", "")
        if not section:
            raise ValueError(f"{cls.__qualname__} declares no section_name")
        if section in seen and seen[section] is not cls:
            raise ValueError(f"section {section!r} is declared by both {seen[section].__qualname__} and "
                             f"{cls.__qualname__}")
        seen[section] = cls
    fields = [(section, cls, dataclasses.field(default_factory=cls)) for section, cls in seen.items()]
    root = dataclasses.make_dataclass(name, fields, frozen=True)
    root.__module__ = module  # so the class pickles by reference, as a class defined in ``module``
    root.__doc__ = doc
    return root


# ----------------------------------------------------------------------------------------------- coercion


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce_container(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    """``tuple[...]`` and ``dict[...]`` values (see :func:`_coerce`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{where}: expected a list, got {type(value).__name__} {value!r}")
            return None
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{where}[{i}]", problems) for i, v in enumerate(value))
        if len(value) != len(args):
            problems.append(f"{where}: expected a list of {len(args)} items, got {len(value)}")
            return None
        return tuple(_coerce(v, a, f"{where}[{i}]", problems) for i, (v, a) in enumerate(zip(value, args)))
    if not isinstance(value, Mapping):
        problems.append(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        return None
    kt, vt = args
    return {_coerce(k, kt, f"{where} key", problems): _coerce(v, vt, f"{where}.{k}", problems)
            for k, v in value.items()}


def _coerce_scalar(value: Any, tp: Any) -> tuple[bool, Any]:
    """``(fits, coerced)`` for bool / int / float / str."""
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return True, float(value)
            except ValueError:
                pass
        return False, None
    if tp is str:
        return isinstance(value, str), value
    return False, None


def _coerce(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    """Coerce a YAML value to ``tp``; append a problem (and return None) when it does not fit."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0], where, problems)
        for option in inner:  # e.g. int | str: the first type the value fits, in the order written
            scratch: list[str] = []
            coerced = _coerce(value, option, where, scratch)
            if not scratch:
                return coerced
        problems.append(f"{where}: expected {' or '.join(_type_name(a) for a in inner)}, got "
                        f"{type(value).__name__} {value!r}")
        return None
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            problems.append(f"{where}: expected a mapping of {sorted(f.name for f in dataclasses.fields(tp))}, "
                            f"got {type(value).__name__}")
            return None
        return _build(tp, value, where, problems)
    if origin in (tuple, dict):
        return _coerce_container(value, tp, where, problems)
    fits, coerced = _coerce_scalar(value, tp)
    if fits:
        return coerced
    problems.append(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return None


def _build(cls: type, data: Mapping[str, Any], where: str, problems: list[str]) -> Any:
    """``cls`` from ``data``; every problem appended. A key whose value does not coerce keeps its default, so the
    section still checks its other values; a section that refuses its values contributes its problems and None."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            guess = f" (did you mean '{where + '.' if where else ''}{close[0]}'?)" if close else ""
            problems.append(f"unknown key '{where + '.' if where else ''}{key}'{guess}; allowed: {', '.join(names)}")
    kwargs, failed = {}, []
    for name in names:
        if name in data:
            before = len(problems)
            value = _coerce(data[name], hints[name], f"{where + '.' if where else ''}{name}", problems)
            if len(problems) == before:
                kwargs[name] = value
            else:
                failed.append(f"{where + '.' if where else ''}{name}")
    if failed and not issubclass(cls, Section):
        # a root whose section failed: building it would build that section from its defaults, whose own rules
        # would then report values the user never gave (stages.n_a=0 for a typo in the stages section)
        return None
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # a key that failed kept its default: the section's rules about that default are not the user's problem
        problems.extend(p for p in exc.problems if not any(f"{key}=" in p for key in failed))
        return None


def build(cls: type, data: Mapping[str, Any]) -> Any:
    """A ``cls`` dataclass (a root or one section) from a nested mapping.

    Raises:
        ConfigError: ``data`` is not a mapping, or any unknown key / wrong type / refused value (all at once).
    """
    problems: list[str] = []
    if not isinstance(data, Mapping):
        raise ConfigError([f"top level: expected a mapping of sections, got {type(data).__name__}"])
    out = _build(cls, data, "", problems)
    if problems:
        raise ConfigError(problems)
    return out


class Replace(dict):
    """A mapping override that replaces the value it lands on instead of merging into it (``key=!{...}``,
    :func:`parse_overrides`); :func:`merge` stores it as a plain dict."""


def merge(base: Mapping, override: Mapping) -> dict:
    """``base`` with ``override`` applied recursively: mappings are merged key by key (a key ``override`` does not
    name keeps ``base``'s value), a :class:`Replace` mapping and every other value replace ``base``'s."""
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, Replace):
            out[k] = dict(v)
        elif isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


REPLACE_PREFIX = "!"
"""Leading character of an override value that replaces a mapping instead of merging into it."""


def parse_overrides(overrides: Sequence[str]) -> tuple[dict, list[str]]:
    """``["train.lr=1e-4", "sampler.trained_indices=[1,2]"]`` -> (nested dict, problems); values are YAML literals.

    A mapping value is *merged* into the mapping it lands on (the YAML file's, or the defaults): with
    ``reward.weights: {digit: 1.0}`` in the file, ``reward.weights={remote: 1.0}`` gives ``{digit: 1.0, remote: 1.0}``.
    A leading ``!`` *replaces* it instead: ``reward.weights=!{remote: 1.0}`` gives ``{remote: 1.0}`` (a
    :class:`Replace` in the nested dict; on a whole section, ``reward=!{...}``, the keys not given take their
    defaults, not the file's values). ``!`` before anything but a mapping is a problem (lists and scalars always
    replace). A value starting with ``!!`` is a YAML tag (``!!str 1``), not this marker.
    """
    nested: dict = {}
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"override '{item}': expected section.key=value")
            continue
        replace = raw.startswith(REPLACE_PREFIX) and not raw.startswith(REPLACE_PREFIX * 2)
        if replace:
            raw = raw[len(REPLACE_PREFIX):]
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            problems.append(f"override '{item}': value is not a YAML literal ({exc.__class__.__name__})")
            continue
        if replace:
            if not isinstance(value, dict):
                problems.append(f"override '{item}': '!' (replace instead of merge) goes only before a mapping "
                                f"'{{...}}', not a {type(value).__name__}; other values always replace")
                continue
            value = Replace(value)
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override '{item}': '{part}' is set to a value and a section at once")
                break
        else:
            node[parts[-1]] = value
    return nested, problems


def read_yaml(path: str | Path) -> dict:
    """The top-level mapping of a YAML config file (``{}`` for an empty file).

    Raises:
        ConfigError: unreadable file, invalid YAML, or a top level that is not a mapping.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError([f"cannot read config file {path}: {exc.strerror}"]) from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path} is not valid YAML: {exc}"]) from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError([f"{path}: expected a mapping of sections at the top level"])
    return loaded or {}


def to_dict(cfg: Any) -> Any:
    """Plain nested dict / list form of a config (tuples become lists), for YAML and fingerprints."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump(cfg: Any) -> str:
    """A config (or section) as YAML in field order; ``build(type(c), yaml.safe_load(dump(c))) == c``."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _ignored(key: str, ignore: Iterable[str]) -> bool:
    return any(key == i or key.startswith(i + ".") for i in ignore)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"section.key": value}`` of a nested mapping (lists and scalars are leaves)."""
    if not isinstance(data, Mapping):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, where))
        else:
            out[where] = value
    return out


def without(data: Any, ignore: Iterable[str] = ()) -> dict[str, Any]:
    """The ``{"section.key": value}`` form (:func:`flatten`) of a config or nested mapping, minus every key in
    ``ignore`` (a dotted key, or a prefix such as ``"eval"`` for a whole section)."""
    ignore = tuple(ignore)
    return {k: v for k, v in flatten(to_dict(data)).items() if not _ignored(k, ignore)}


def fingerprint(cfg: Any, ignore: Iterable[str] = ()) -> str:
    """sha256 of the canonical YAML of a config or section (first 16 hex digits), leaving out the keys in
    ``ignore`` (as :func:`without`; none by default)."""
    data = to_dict(cfg) if not tuple(ignore) else without(cfg, ignore)
    return hashlib.sha256(yaml.safe_dump(data, sort_keys=True).encode()).hexdigest()[:16]


_ABSENT = "(absent)"


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any], ignore: Iterable[str] = ()) -> list[str]:
    """The keys that differ between two configs (nested mappings, e.g. :func:`to_dict` of each), as
    ``"section.key: old -> new"`` lines in key order; keys in ``ignore`` (as :func:`without`) are left out, and a
    key present on one side only shows ``(absent)`` on the other. Values are compared as loaded from YAML / JSON
    (a list equals a tuple, ``8`` equals ``8.0``)."""
    before, after = without(old, ignore), without(new, ignore)
    lines = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key, _ABSENT), after.get(key, _ABSENT)
        if a != b:
            lines.append(f"{key}: {_show(a)} -> {_show(b)}")
    return lines


def _show(value: Any) -> str:
    """A value as a short YAML flow literal (``0.0003``, ``[1, 2]``, ``null``), as a user would type it."""
    if value is _ABSENT:
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).removesuffix("\n").removesuffix("\n...")
