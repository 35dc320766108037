"""The prompt set of ``examples/stages/world.yaml``: ``demo:world-train`` with what the pipeline's judge is sent.

``prompts/world-stages.jsonl`` is ``prompts/world-train.jsonl`` row for row (same prompts, ids, condition frames and
``cluster = "episode:<n>"``: the student's split keeps every episode whole) plus, in each row's metadata:

=============  ======================================================================================================
``reference``  the real future: the row's ``real_clip`` strip (``world-train/<clip>-clip.png``, the clip's ``F``
               frames side by side, 32 x 256), which the group judge sends as ``Reference:``
``examples``   :data:`EXAMPLES`: first frames of three held-out episodes (static) (``world-eval/``), sent as
               ``Examples:`` -- what a Breakout screen looks like, never a condition of any training row
=============  ======================================================================================================

Both are relative to the prompts directory: the pipeline's judge reads them under ``teacher.judge.reference_root``
(``flowforge/demo/prompts`` in the example, run from the repository root). Regenerate with
``python -m flowforge.demo.world_stages``.
"""

from __future__ import annotations

import json
import pathlib

PROMPTS_DIR = pathlib.Path(__file__).resolve().parent / "prompts"
SOURCE = "world-train.jsonl"
TARGET = "world-stages.jsonl"
EXAMPLES = ("world-eval/000301.png", "world-eval/001317.png", "world-eval/002330.png")  # episodes 7, 31, 55


def stage_rows(source: pathlib.Path = PROMPTS_DIR / SOURCE) -> list[dict]:
    """The rows of :data:`TARGET` from the rows of ``source`` (module docstring).

    Raises:
        ValueError: a row without ``metadata.real_clip`` or ``metadata.image``.
    """
    rows = []
    for line in source.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        meta = row["metadata"]
        if not meta.get("real_clip") or not meta.get("image"):
            raise ValueError(f"{source}: row {meta.get('sample_id')!r} lacks metadata.real_clip / metadata.image")
        folder = pathlib.PurePosixPath(meta["image"]).parent
        rows.append({"prompt": row["prompt"],
                     "metadata": {**meta, "reference": str(folder / meta["real_clip"]), "examples": list(EXAMPLES)}})
    return rows


def write_stage_prompts(directory: pathlib.Path = PROMPTS_DIR) -> pathlib.Path:
    """Write ``<directory>/world-stages.jsonl`` from ``<directory>/world-train.jsonl``; returns its path."""
    path = pathlib.Path(directory) / TARGET
    path.write_text("".join(json.dumps(r) + "\n" for r in stage_rows(pathlib.Path(directory) / SOURCE)))
    return path


if __name__ == "__main__":
    print(f"wrote {write_stage_prompts()}")
