"""``flowforge compare``: several algorithms (and seeds) on the same model, prompts, rewards and sample budget.

The study (config, runs, summaries, tables) is :mod:`.run` (its docstring says what is compared and how); the
figures are :mod:`.plot`. This module re-exports the API.
"""

from __future__ import annotations

from flowforge.tools.compare.run import (REACH_TOLERANCE, CompareConfig, aggregate, arm_table, final_cell,
                                         load_compare, run_compare, summarize, vs_first_cell, write_tables)

__all__ = ["REACH_TOLERANCE", "CompareConfig", "aggregate", "arm_table", "final_cell", "load_compare", "run_compare",
           "summarize", "vs_first_cell", "write_tables"]
