"""The one resolver of ``pkg.module:Attr`` references in configs (reward components, ``model.adapter``, a student's
``scalar_head`` function): which folders are importable and how a reference becomes an object.

**Where user code is found.** A reference imports its module from ``sys.path`` plus two folders a user expects:

- the **working directory** -- the ``flowforge`` console script, unlike ``python -m``, does not put it on
  ``sys.path``, so ``reward.weights={"my_rewards:ink": 1.0}`` with ``my_rewards.py`` in the current folder would
  otherwise fail with ``ModuleNotFoundError`` unless ``PYTHONPATH`` is set;
- the **config file's folder** (:func:`flowforge.config.load_config` registers it): a module shipped next to the
  YAML that names it is found wherever the command is run from.

Both are *appended* to ``sys.path`` and stay there for the life of the process (not inserted for one import and
removed): a reference is resolved more than once (``flowforge check`` / preflight, then the trainer; each torchrun
rank; rollout worker processes, which inherit the parent's ``sys.path`` through multiprocessing's spawn), a user
module may import its own sibling modules lazily at call time, and a scorer pickled to a worker is re-imported by
module name there. Appending, not prepending, means a file in those folders never shadows the standard library or
an installed package (a ``json.py`` next to a config stays harmless); the price is that a module must not share its
name with an installed one.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path
from typing import Any

REFERENCE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
"""``pkg.module:Attr[.Attr]``, identifiers only."""


def add_import_dirs(*dirs: str | os.PathLike) -> None:
    """Append each of ``dirs`` (made absolute) to ``sys.path`` unless it is already there (module docstring)."""
    for d in dirs:
        path = str(Path(d).absolute())
        if path not in sys.path:
            sys.path.append(path)


def import_object(ref: str, what: str) -> Any:
    """The object ``ref`` (``pkg.module:Attr[.Attr]``) names, imported with the working directory importable
    (module docstring); ``what`` names the reference in errors (e.g. ``"reward component 'my_rewards:ink'"``).

    Raises:
        ValueError: a malformed reference, a module that fails to import (its error in the message, and where
            modules were looked for when it is not found), or a missing attribute.
    """
    if not REFERENCE.match(ref):
        raise ValueError(f"{what}: an import path is 'pkg.module:Name' (identifiers only), got {ref!r}")
    add_import_dirs(os.getcwd())
    module_name, _, attr_path = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # the module itself or its package is missing (not a module it imports, whose own error is more useful)
        if exc.name is not None and f"{module_name}.".startswith(f"{exc.name}."):
            raise ValueError(f"{what}: no module {module_name!r} in the working directory ({os.getcwd()}), the "
                             "config file's folder or the installed packages; put "
                             f"{module_name.replace('.', '/')}.py in one of them or add its folder to PYTHONPATH"
                             ) from None
        raise ValueError(f"{what}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any import-time failure of user code is reported, not raised raw
        raise ValueError(f"{what}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    return obj
