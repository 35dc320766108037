"""Generate images with a trained run or an export: ``flowforge sample RUN_OR_EXPORT --prompt "..." --out grid.png``.

Sampling and the budget checks are :mod:`.run` (its docstring says what is reproducible and how); loading a run or
an export is :mod:`.load`, the grid :mod:`.grid`. This module re-exports the API.
"""

from __future__ import annotations

from flowforge.tools.sample.load import SampleModel, load_for_sampling, source_config
from flowforge.tools.sample.run import (MAX_IMAGES, MAX_PIXELS, SampleResult, check_budget, check_sample_targets,
                                        read_prompts, run_sample, sample, schedule)

__all__ = ["MAX_IMAGES", "MAX_PIXELS", "SampleModel", "SampleResult", "check_budget", "check_sample_targets",
           "load_for_sampling", "read_prompts", "run_sample", "sample", "schedule", "source_config"]
