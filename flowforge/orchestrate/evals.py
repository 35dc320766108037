"""The held-out evaluations a pipeline directory holds: a run's last one, and the one of an audit stop's last good
checkpoint of stage C (:func:`flowforge.orchestrate.stages.evaluate_last_good`), read by the report, the arm table
and the stages."""

from __future__ import annotations

import math
from pathlib import Path

from flowforge.orchestrate.directory import PipelineLayout
from flowforge.runtime.durable import step_of


def last_eval(run_dir: Path) -> dict[str, float]:
    """The last held-out evaluation of a run directory (``eval.jsonl``), ``{}`` when there is none."""
    from flowforge.report.run import read_jsonl

    path = run_dir / "eval.jsonl"
    if not path.is_file():
        return {}
    rows, _ = read_jsonl(path)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rows[-1].items()} if rows else {}


def c_checkpoint_step(layout: PipelineLayout, checkpoint: str | Path | None) -> int | None:
    """The step of ``checkpoint`` when it is one of stage C's checkpoints (an audit stop's last good one), else None
    (none, or stage A's: the hand-off)."""
    if checkpoint is None or Path(checkpoint).resolve().parent.parent != layout.c_run.resolve():
        return None
    return step_of(Path(checkpoint))


def last_good_eval(layout: PipelineLayout, checkpoint: str | Path | None) -> dict[str, float]:
    """The held-out evaluation of an audit stop's last good checkpoint of stage C
    (:meth:`PipelineLayout.last_good_run`), ``{}`` when ``checkpoint`` is none, stage A's, or not evaluated."""
    step = c_checkpoint_step(layout, checkpoint)
    return {} if step is None else last_eval(layout.last_good_run(step))
