"""The config reference page, generated from the schema at every docs build (a mkdocs hook), so it cannot drift.

Walks :data:`flowforge.orchestrate.config.PipelineConfig` -- every run section (the base sections, the algorithm
sections the registered objectives declare, the shared anchor section) plus the pipeline's own (``stages``,
``teacher``, ``audit``, ``student``) -- field by field, nested dataclasses included (``metrics.wandb.project``), and
writes one table per section: key, type, default, allowed values, and the comment the field carries in the source.
A scorer that declares its options as a section (:func:`flowforge.rewards.registry.option_sections`, e.g.
``reward.options.vlm_judge``) gets its own table right after ``reward``.

Allowed values come from the checks themselves: every section is built from its defaults and the default run config
goes through preflight while :func:`flowforge.settings.schema.recorded_choices` records each choice check's allowed
values (a section whose defaults it refuses, e.g. ``stages.n_a=0``, still records its checks before refusing).

Run ``python docs/hooks/config_reference.py`` to print the page; ``mkdocs build`` writes it as
``reference/config.md`` (:func:`on_files`). The same rows, as a smaller table, sit in the guides between
``<!-- options: SECTION -->`` and ``<!-- /options -->`` (:data:`GUIDE_TABLES`, :func:`guide_table`): a test
compares them with the schema, and ``python docs/hooks/config_reference.py --write-guides`` rewrites them.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import os
import re
import sys
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGE = "reference/config.md"
PIPELINE_ONLY = ("stages", "teacher", "audit", "student")
GUIDE_TABLES = {"docs/guides/rewards.md": ("reward.options.vlm_judge",)}
"""Guide pages holding a generated option table, and the sections they hold."""


@dataclasses.dataclass(frozen=True)
class Row:
    key: str  # "section.key" or "section.sub.key"
    type: str
    default: str  # a YAML flow literal, as a user writes it
    allowed: str  # "" when the checks name no set of values
    note: str  # the field's comment in the source


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        inner = f"{_type_name(args[0])}, ..." if len(args) == 2 and args[1] is Ellipsis else \
            ", ".join(_type_name(a) for a in args)
        return f"list[{inner}]"
    if origin is dict:
        return f"mapping[{_type_name(args[0])}, {_type_name(args[1])}]"
    if tp is Any:
        return "any"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _yaml(value: Any) -> str:
    from flowforge.settings.schema import to_dict

    text = yaml.safe_dump(to_dict(value), default_flow_style=True, width=1 << 30)
    return text.removesuffix("\n").removesuffix("\n...")


def _allowed(value: Any) -> str:
    """An allowed value as a YAML literal; a range in words (:class:`flowforge.settings.schema.Bound`) as it is."""
    from flowforge.settings.schema import Bound

    return str(value) if isinstance(value, Bound) else _yaml(value)


def _comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` from the class source: the comment on the field's line, after any full-line comments
    directly above it."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if tok.type == tokenize.COMMENT:
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    above: list[str] = []
    for n, line in enumerate(lines, start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        name = stripped.split(":", 1)[0].strip()
        if name in names and ":" in stripped and name not in out:
            parts = above + ([trailing[n]] if n in trailing else [])
            out[name] = " ".join(parts)
        above = []
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def rows_of(cls: type, prefix: str, choices: dict[str, tuple]) -> list[Row]:
    """Every key of the dataclass ``cls`` under ``prefix``, nested dataclasses walked (their own keys follow)."""
    hints = typing.get_type_hints(cls)
    notes = _comments(cls)
    out: list[Row] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        tp = hints[f.name]
        nested = tp if dataclasses.is_dataclass(tp) else None
        default = _default(f)
        allowed = choices.get(key)
        out.append(Row(key, _type_name(tp), "" if nested or default is dataclasses.MISSING else _yaml(default),
                       ", ".join(_allowed(v) for v in allowed) if allowed else "", notes.get(f.name, "")))
        if nested:
            out.extend(rows_of(nested, key, choices))
    return out


def sections() -> list[tuple[str, type]]:
    """``(section name, section class)`` of every section a config file may hold, run sections first, each scorer's
    option section (``reward.options.vlm_judge``) right after ``reward``."""
    from flowforge.orchestrate.config import PipelineConfig
    from flowforge.rewards.registry import option_sections

    hints = typing.get_type_hints(PipelineConfig)
    out = []
    for f in dataclasses.fields(PipelineConfig):
        out.append((f.name, hints[f.name]))
        if f.name == "reward":
            out += option_sections()
    return out


def collect_choices() -> dict[str, tuple]:
    """``{"section.key": allowed values}`` of every choice check the default sections and preflight run."""
    from flowforge.config import Config
    from flowforge.settings.schema import ConfigError, recorded_choices
    from flowforge.train.preflight import preflight

    with recorded_choices() as seen:
        for _, cls in sections():
            try:
                cls()
            except ConfigError:
                pass  # a section whose defaults it refuses (stages.n_a=0) recorded its checks first
        try:
            preflight(Config(), this_machine=False)
        except ConfigError:
            pass
    return seen


def _cell(text: str) -> str:
    return text.replace("|", "&#124;").replace("\n", " ")


def _section_doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    if not doc or doc.startswith(f"{cls.__name__}("):  # the dataclass's generated signature, not a description
        return ""
    return doc.split("\n\n", 1)[0].replace("\n", " ")


def guide_table(section: str, choices: dict[str, tuple] | None = None) -> str:
    """The option table of ``section`` (a name :func:`sections` lists) as it sits in a guide: option, type, default,
    allowed values, what it does."""
    cls = dict(sections())[section]
    choices = collect_choices() if choices is None else choices
    out = ["| option | type | default | allowed | what |", "|---|---|---|---|---|"]
    for r in rows_of(cls, section, choices):
        default = f"`{r.default}`" if r.default and "|" not in r.default else _cell(r.default)
        out.append(f"| `{r.key.removeprefix(section + '.')}` | {_cell(r.type)} | {default} | {_cell(r.allowed)} | "
                   f"{_cell(r.note)} |")
    return "\n".join(out)


def guide_block(section: str, table: str) -> str:
    """The marked block of ``section``'s table in a guide page."""
    return f"<!-- options: {section} (generated: python docs/hooks/config_reference.py --write-guides) -->\n" \
           f"{table}\n<!-- /options -->"


def write_guides() -> list[str]:
    """Rewrite the marked tables of :data:`GUIDE_TABLES` from the schema; the pages changed.

    Raises:
        ValueError: a page lacks the marked block of a section it should hold.
    """

    choices = collect_choices()
    changed = []
    for page, names in GUIDE_TABLES.items():
        path = ROOT / page
        text = old = path.read_text()
        for section in names:
            pattern = re.compile(rf"<!-- options: {re.escape(section)} .*?<!-- /options -->", re.S)
            if not pattern.search(text):
                raise ValueError(f"{page} has no '<!-- options: {section} ...' block")
            text = pattern.sub(lambda _: guide_block(section, guide_table(section, choices)), text)
        if text != old:
            path.write_text(text)
            changed.append(page)
    return changed


def reference_markdown() -> str:
    """The whole page."""
    choices = collect_choices()
    out = ["# Config reference", "",
           "Generated from the schema at every docs build (`docs/hooks/config_reference.py`): every key a config file "
           "may hold, with its type, default and -- where a check enforces a set of values -- the allowed values. "
           "Defaults < YAML < `section.key=value` on the command line (see [Configs](../guides/configs.md)). "
           "The sections " + ", ".join(f"`{s}`" for s in PIPELINE_ONLY) + " belong to a "
           "[three-stage pipeline](../guides/pipeline.md) file only. A `reward.options.<scorer>` table lists the "
           "options of a scorer that declares them as a section (the mapping under `reward.options.<scorer>`).", ""]
    for name, cls in sections():
        out += [f"## `{name}`", ""]
        doc = _section_doc(cls)
        if doc:
            out += [_cell(doc), ""]
        out += ["| key | type | default | allowed | note |", "|---|---|---|---|---|"]
        for r in rows_of(cls, name, choices):
            default = f"`{r.default}`" if r.default and "|" not in r.default else _cell(r.default)
            out.append(f"| `{r.key}` | {_cell(r.type)} | {default} | {_cell(r.allowed)} | {_cell(r.note)} |")
        out.append("")
    return "\n".join(out)


def on_files(files, config):  # noqa: ANN001 - mkdocs hook signature
    """mkdocs hook: add the generated page to the site."""
    from mkdocs.structure.files import File

    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("FLOWFORGE_THREAD_CHECK", "0")
    files.append(File.generated(config, PAGE, content=reference_markdown()))
    return files


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1:] == ["--write-guides"]:
        print("\n".join(write_guides()) or "the guides' tables are current")
    else:
        print(reference_markdown())
