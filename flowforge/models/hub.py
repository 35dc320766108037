"""Hugging Face Hub ids as ``model.path``: recognising one, the local cache, offline mode, resolving to a snapshot
(used by :func:`flowforge.models.registry.build_adapter` for registered families; re-exported by
:mod:`flowforge.models`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from flowforge.runtime.errors import UserError, one_line

_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"{_HUB_PART}/{_HUB_PART}")


def looks_like_hub_id(path: str) -> bool:
    """Whether ``path`` has the form of a Hub repository id, ``org/name`` (letters, digits, ``-``, ``_``, ``.``;
    no ``--`` or ``..``), and is not on disk. A relative two-part path that exists is a path."""
    text = str(path)
    return bool(_HUB_ID.fullmatch(text)) and "--" not in text and ".." not in text and not Path(text).exists()


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set (to anything but ``0`` / ``false`` / ``no``): nothing may be downloaded."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no", "off")


def cached_hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot directory of Hub model ``repo_id`` in the Hugging Face cache, or None (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None


def download_hint(repo_id: str) -> str:
    """How to put Hub model ``repo_id`` on disk by hand, and what to set then."""
    return (f"download it with `hf download {repo_id} --local-dir DIR` (older huggingface_hub: `huggingface-cli "
            f"download {repo_id} --local-dir DIR`), then set model.path=DIR")


def resolve_model_path(path: str | os.PathLike) -> str:
    """``path`` itself, or for a Hub id (:func:`looks_like_hub_id`) its local snapshot directory: from the
    Hugging Face cache, else downloaded (``huggingface_hub.snapshot_download``) unless ``HF_HUB_OFFLINE`` is set.

    Raises:
        UserError: a Hub id that is not cached while offline, or whose download fails (naming ``model.path``, the
            cause and how to download it by hand).
    """
    text = str(path)
    if not looks_like_hub_id(text):
        return text
    cached = cached_hub_snapshot(text)
    if cached is not None:
        return str(cached)
    if hub_offline():
        raise UserError(f"model.path={text!r}", "a Hub id that is not in the local Hugging Face cache, and "
                                                "HF_HUB_OFFLINE=1 forbids downloading it", download_hint(text))
    from huggingface_hub import snapshot_download

    try:
        return str(snapshot_download(text))
    except Exception as exc:  # noqa: BLE001 - network, auth and missing-repo errors all mean "cannot get it"
        raise UserError(f"model.path={text!r}", f"cannot download this Hub model ({type(exc).__name__}: "
                                                f"{one_line(str(exc))[:300]})", download_hint(text)) from exc
