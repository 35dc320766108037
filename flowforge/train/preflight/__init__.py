"""Validate a whole config before any model loads: every violation collected, one error raised.

:func:`~flowforge.train.preflight.check.preflight` (its module docstring lists what is checked) runs the checks of
the config alone (:mod:`.static`), of this machine (:mod:`.machine`), of trained submodules (:mod:`.modules`) and the
cross-section rules (:mod:`.rules`); :func:`~flowforge.train.preflight.loaded.check_loaded_model` checks what needs
the loaded model. This module re-exports their API.
"""

from __future__ import annotations

from flowforge.train.preflight.check import PreflightError, PreflightReport, preflight
from flowforge.train.preflight.loaded import check_loaded_model, media_bytes, memory_limit
from flowforge.train.preflight.modules import module_path_problems
from flowforge.train.preflight.rules import run_rules
from flowforge.train.preflight.static import VIDEO_TASKS

__all__ = ["PreflightError", "PreflightReport", "VIDEO_TASKS", "check_loaded_model", "media_bytes", "memory_limit",
           "module_path_problems", "preflight", "run_rules"]
