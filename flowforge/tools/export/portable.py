"""Exports carry no path of the machine that wrote them: how the base, the run and the config are named in an
export's files (``adapter_config.json``, ``trained_modules.json``, ``flowforge_export.json``, ``config.yaml``, the
model card, a world model's ``source_provenance.json``).

==============================  ======================================================================================
what                            how it is written
==============================  ======================================================================================
the base model                  as the user named it (``model.path`` or ``--base``): a ``demo:`` name or a hub id as
                                it is; a local directory as a path relative to the export directory (``../base``),
                                so an export moved together with its base still finds it (:func:`base_ref`)
the run                         its path relative to the export directory, the checkpoint relative to the run
every other absolute path       relative to the export directory (:func:`portable_config`); a relative path stays
in the config                   as written (relative to where the run was started)
``_name_or_path`` of a saved     removed (:func:`drop_name_or_path`): diffusers records the directory it loaded
``config.json``                 the model from; no loader reads it back
the model card's config         the portable config without the sections of other algorithms (``grpo`` of an
                                ``nft`` run, ``sft``): only what this run read (:func:`own_sections`)
==============================  ======================================================================================

A relative base is resolved against the export directory (:func:`resolve_base_ref`): ``flowforge sample OUT`` and
the model card's loading code do that.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from flowforge.demo.paths import is_demo_name

LOCAL_SECTIONS_OF_OTHER_COMMANDS = ("sft",)
"""Sections no ``flowforge train`` run reads (``flowforge sft``'s): never in a training run's card."""


def relative_to(path: str | Path, out: Path) -> str:
    """``path`` relative to the export directory ``out`` (both as realpaths), as a POSIX string."""
    rel = os.path.relpath(os.path.realpath(os.path.expanduser(str(path))), os.path.realpath(out))
    return PurePosixPath(*Path(rel).parts).as_posix()


def base_ref(model_path: str, base: Path | None, out: Path) -> str:
    """The base model as an export names it (module table).

    Args:
        model_path: ``model.path`` of the run (or ``--base``) as the user wrote it.
        base: its local directory when it exists here (a ``demo:`` name resolved), else ``None``.
        out: the export directory (need not exist yet).

    Returns:
        ``model_path`` for a ``demo:`` name or a hub id; a path relative to ``out`` for a local directory (or for an
        absolute ``model_path`` of a base that is not here).
    """
    if is_demo_name(model_path):
        return model_path
    if base is not None or os.path.isabs(os.path.expanduser(model_path)):
        return relative_to(base if base is not None else model_path, out)
    return model_path


def resolve_base_ref(ref: str, out: Path) -> str:
    """The base named ``ref`` by export ``out`` as something loaders accept: a relative path that exists below
    ``out`` becomes that path; a ``demo:`` name, a hub id or an absolute path (older exports) is returned as is."""
    if not is_demo_name(ref) and not os.path.isabs(ref) and (out / ref).exists():
        return str(out / ref)
    return ref


def _portable(value: Any, out: Path) -> Any:
    if isinstance(value, dict):
        return {k: _portable(v, out) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v, out) for v in value]
    if isinstance(value, str) and "\n" not in value and os.path.isabs(value):
        return relative_to(value, out)
    return value


def portable_config(config_text: str, out: Path, base: str) -> dict:
    """The run's ``config.yaml`` text as a dict with ``model.path = base`` (:func:`base_ref`) and every other
    absolute path string relative to ``out`` (module table).

    Raises:
        ValueError: ``config_text`` is not a YAML mapping (the run's config was read before, so this is not expected).
    """
    data = yaml.safe_load(config_text)
    if not isinstance(data, dict):
        raise ValueError("the run's config.yaml is not a mapping")
    data = _portable(data, out)
    if isinstance(data.get("model"), dict):
        data["model"]["path"] = base
    return data


def own_sections(data: dict, algorithm: str) -> dict:
    """``data`` (a config dict) without the sections of algorithms other than ``algorithm`` and of other commands
    (:data:`LOCAL_SECTIONS_OF_OTHER_COMMANDS`); sections shared by every algorithm stay."""
    from flowforge.objectives import OBJECTIVES

    own = {s.section_name for s in getattr(OBJECTIVES.get(algorithm), "sections", ())}
    others = {s.section_name for cls in OBJECTIVES.values() for s in cls.sections} - own
    drop = others | set(LOCAL_SECTIONS_OF_OTHER_COMMANDS)
    return {k: v for k, v in data.items() if k not in drop}


def drop_name_or_path(config_file: Path) -> None:
    """Remove ``_name_or_path`` from a saved diffusers / transformers ``config.json``: the libraries record the
    directory a model was loaded from (a path of this machine) and ignore the key when they load it."""
    import json

    data = json.loads(config_file.read_text())
    if isinstance(data, dict) and "_name_or_path" in data:
        del data["_name_or_path"]
        config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def dump(data: dict) -> str:
    """YAML in the key order of ``data`` (as :func:`flowforge.config.dump_config` writes a config)."""
    return yaml.safe_dump(data, sort_keys=False)
