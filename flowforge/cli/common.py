"""Arguments and config loading shared by the config-driven verbs (``train``, ``sft``, ``check``, ``compare``)."""

from __future__ import annotations

import argparse
from pathlib import Path


TRAILING = "trailing_positionals"
"""Namespace attribute naming the list (``"overrides"``, check's ``"paths"``) that takes the words argparse leaves
over after an option (:func:`flowforge.cli.parse_args`): overrides are accepted anywhere after the config."""


def add_config_args(parser: argparse.ArgumentParser, what: str = "YAML config") -> None:
    """``CONFIG [section.key=value ...] [--no-progress]`` on ``parser``; overrides may also follow options."""
    parser.set_defaults(**{TRAILING: "overrides"})
    parser.add_argument("config", type=Path, help=what)
    parser.add_argument("overrides", nargs="*", help="section.key=value (values are YAML literals; a "
                        "{...} mapping merges into the config's, !{...} replaces it)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def load_config_file(path: Path, overrides: list[str]):
    """:func:`flowforge.config.load_config` of ``path`` + ``overrides``; a file that cannot be decoded or read
    raises a :class:`~flowforge.runtime.errors.UserError` naming it (``ConfigError`` passes through).

    Raises:
        ConfigError: unknown keys, wrong types, invalid YAML (every problem listed).
        UserError: ``path`` is not UTF-8 text or cannot be read.
    """
    from flowforge.config import load_config
    from flowforge.runtime.errors import file_error

    try:
        return load_config(path, overrides)
    except (UnicodeDecodeError, OSError) as exc:  # the config file itself: the only file load_config reads
        raise file_error(path, exc, "give a YAML config file") from exc


def finite_float(text: str) -> float:
    """argparse ``type`` for a float flag: a finite number (``nan``, ``inf`` and ``-inf`` refused, exit 2)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value
