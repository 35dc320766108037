"""``flowforge`` command line: :func:`main` parses, dispatches to one module per verb (:data:`VERBS`) and reports
failures in one line. The parser and the exit statuses are :mod:`.dispatch` (its docstring has the table); which
failures are the user's is :mod:`.errors`. This module re-exports them (``python -m flowforge.cli``).
"""

from __future__ import annotations

from flowforge.cli.dispatch import DEBUG_ENV, DESCRIPTION, EPILOG, VERBS, main, parse_args
from flowforge.cli.errors import error_message, is_user_error

__all__ = ["DEBUG_ENV", "DESCRIPTION", "EPILOG", "VERBS", "error_message", "is_user_error", "main", "parse_args"]
