"""Which failures are the user's (exit 2) and their one-line rendering: shared by :func:`flowforge.cli.main` and
``flowforge check`` (several configs, each failure named on its own line)."""

from __future__ import annotations

import pickle
import sys

from flowforge.runtime.errors import one_line


def is_user_error(exc: BaseException) -> bool:
    """True for errors caused by the input (exit 2): ``ValueError`` (``UserError``, ``ConfigError``,
    ``ExportError``, ``json.JSONDecodeError`` included), ``OSError``, and the safetensors / pickle errors a damaged
    file raises. Everything else is a bug."""
    if isinstance(exc, (ValueError, OSError, pickle.UnpicklingError)):
        return True
    safetensors = sys.modules.get("safetensors")  # not imported: nothing can have raised its error
    return safetensors is not None and isinstance(exc, getattr(safetensors, "SafetensorError", ()))


def error_message(exc: BaseException) -> str:
    """``exc`` as one line (an ``OSError`` names its file)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        other = f" -> {exc.filename2}" if exc.filename2 is not None else ""
        return f"{exc.filename}{other}: {exc.strerror}; check the path and its permissions"
    return one_line(str(exc)) or type(exc).__name__
