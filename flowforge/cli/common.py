"""Arguments and config loading shared by the config-driven verbs (``train``, ``sft``, ``check``, ``compare``), and
the argument checks several verbs share (:func:`finite_float`, :func:`check_device`)."""

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


def check_device(text: str | None, flag: str = "--device") -> str | None:
    """The device a ``--device`` flag names, checked before anything loads: ``None`` (the verb's default) passes
    through; ``cuda`` and ``cuda:N`` must exist on this machine (other device types pass to torch unchecked).

    Raises:
        UserError: ``<flag>: CUDA is not available on this machine; use --device cpu`` (no CUDA device, or torch
            built without CUDA), an index past the device count, or a string torch does not read as a device.
    """
    if text is None:
        return None
    import torch

    from flowforge.runtime.errors import UserError

    try:
        device = torch.device(text)
    except RuntimeError:
        raise UserError(flag, f"{text!r} is not a device", "give cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(flag, "CUDA is not available on this machine", f"use {flag} cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UserError(flag, f"{text!r} but this machine has {count} CUDA device(s)",
                            f"give cuda:0 ... cuda:{count - 1} or cpu")
    return text
