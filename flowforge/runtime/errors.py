"""User errors: a problem with something the user gave flowforge (a file, a flag, a config value), told in one line.

A :class:`UserError` carries three parts and prints as ``"<what>: <why>; <fix>"``:

======  ==========================================================  =============================================
part    what it holds                                               example
======  ==========================================================  =============================================
what    the thing at fault: a file path, a flag, a config key       ``runs/r/checkpoints/step_000002/optimizer.pt``
why     what is wrong with it                                       ``not a torch.save archive (zeroed or cut)``
fix     what to do, or the allowed values                           ``export another step with --step N``
======  ==========================================================  =============================================

The command line (:mod:`flowforge.cli`) prints any of these as ``error: <what>: <why>; <fix>`` on one line and exits
with status 2; ``--debug`` (or ``FLOWFORGE_DEBUG=1``) shows the traceback instead. Raise one wherever the input is
at fault; an exception that is not a user error is a bug and is reported as an internal error.

Errors from reading a file (``OSError``, ``json.JSONDecodeError``, a safetensors or pickle error) name no file or a
misleading cause by themselves; :func:`file_error` turns one into a :class:`UserError` naming the file, at the point
where the file is read::

    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise file_error(path, exc, "restore the file or pick another checkpoint") from exc

:class:`UserError` is a ``ValueError``, so code that catches ``ValueError`` for bad input keeps working.
"""

from __future__ import annotations

import json

__all__ = ["UserError", "file_error", "one_line"]


class UserError(ValueError):
    """Bad input from the user, printed as ``"<what>: <why>; <fix>"`` (``"<what>: <why>"`` without a fix).

    Args:
        what: the thing at fault (a file path, a flag such as ``--overwrite``, a config key such as ``lora.rank``).
        why: what is wrong with it.
        fix: what to do about it, or the allowed values; ``""`` when there is nothing to suggest.
    """

    def __init__(self, what: object, why: str, fix: str = "") -> None:
        self.what, self.why, self.fix = str(what), str(why), str(fix)
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.what}: {self.why}" + (f"; {self.fix}" if self.fix else "")

    def __reduce__(self):  # pickle (multiprocessing, torch.distributed object lists) rebuilds from the three parts
        return type(self), (self.what, self.why, self.fix)


def file_error(path: object, exc: BaseException, fix: str = "") -> UserError:
    """A :class:`UserError` naming ``path`` for ``exc``, an error raised while reading that file.

    The ``why`` part states the cause in words: the OS error's text (``Too many levels of symbolic links``,
    ``Permission denied``), a JSON syntax error's position, or the exception's own message otherwise.
    """
    if isinstance(exc, OSError) and exc.strerror:
        why = f"cannot be read ({exc.strerror})"
    elif isinstance(exc, json.JSONDecodeError):
        why = f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    elif isinstance(exc, UnicodeDecodeError):
        why = f"is not UTF-8 text (byte {exc.start})"
    else:
        why = f"cannot be read ({type(exc).__name__}: {one_line(str(exc)) or 'no message'})"
    return UserError(path, why, fix)


def one_line(text: str) -> str:
    """``text`` on one line: lines stripped, a list item's leading ``- `` dropped, lines joined by ``"; "`` (by a
    space after a line ending in ``:``)."""
    lines = [line.strip() for line in str(text).splitlines()]
    out = ""
    for line in (ln.removeprefix("- ") for ln in lines if ln):
        out = line if not out else f"{out} {line}" if out.endswith(":") else f"{out}; {line}"
    return out
