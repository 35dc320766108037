"""The prompt sets of ``examples/stages/world.yaml``: Breakout clips with what the pipeline's judge is sent.

``prompts/world-stages.jsonl`` holds :data:`STAGE_STARTS` clips evenly spaced over the training episodes of the
default recording (:class:`~flowforge.data.atari.AtariDataConfig`, the one ``demo:world`` was trained on), written
like ``demo:world-train`` (:func:`flowforge.data.atari.write_prompt_file`: first frame, the clip's real actions as the
prompt, ``cluster = "episode:<n>"`` so the student's split keeps every episode whole; files in
``prompts/world-stages/``) -- twice ``demo:world-train``'s 128, so that stage C gets a pass of its own after stage
A's 96. ``prompts/world-stages-eval.jsonl`` is ``prompts/world-eval.jsonl`` row for row (the held-out starts: stage
C's student, which compares each candidate with its real future, scores the evaluation's samples too). Each row's
metadata also has:

=============  ======================================================================================================
``reference``  the real future: the row's ``real_clip`` strip (``<folder>/<clip>-clip.png``, the clip's ``F``
               frames side by side, 32 x 256), which the group judge sends as ``Reference:``
``examples``   :data:`EXAMPLES`: first frames of three held-out episodes (static) (``world-eval/``), sent as
               ``Examples:`` -- what a Breakout screen looks like, never a condition of any training row
=============  ======================================================================================================

Both are relative to the prompts directory: the pipeline's judge reads them under ``teacher.judge.reference_root``
(``flowforge/demo/prompts`` in the example, run from the repository root). Regenerate with
``python -m flowforge.demo.world_stages`` (records the Atari clips with ale-py on the first call, ~20 s, cached).
"""

from __future__ import annotations

import json
import pathlib

PROMPTS_DIR = pathlib.Path(__file__).resolve().parent / "prompts"
STAGES = "world-stages"
"""The pass's prompt set (``<STAGES>.jsonl`` and its folder)."""
EVAL_SETS = {"world-eval.jsonl": "world-stages-eval.jsonl"}
"""source -> target, in the prompts directory: the held-out starts with their references."""
STAGE_STARTS = 256
EXAMPLES = ("world-eval/000301.png", "world-eval/001317.png", "world-eval/002330.png")  # episodes 7, 31, 55


def stage_rows(source: pathlib.Path) -> list[dict]:
    """The rows of ``source`` (a ``write_prompt_file`` JSONL) with ``reference`` and ``examples`` added (module
    docstring).

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


def _write_rows(path: pathlib.Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_eval_prompts(directory: pathlib.Path = PROMPTS_DIR) -> list[pathlib.Path]:
    """Write every :data:`EVAL_SETS` target in ``directory`` from its source there; returns their paths."""
    paths = []
    for source, target in EVAL_SETS.items():
        paths.append(pathlib.Path(directory) / target)
        _write_rows(paths[-1], stage_rows(pathlib.Path(directory) / source))
    return paths


def write_stage_prompts(directory: pathlib.Path = PROMPTS_DIR, cache_dir: str = ".cache/flowforge",
                        clips=None) -> list[pathlib.Path]:
    """Write ``<STAGES>.jsonl`` (and its PNGs) from the default recording's training episodes (``clips``: an
    :class:`~flowforge.data.atari.AtariClips` of the default config, recorded or read from ``cache_dir`` when None),
    then the :data:`EVAL_SETS`; returns the JSONL paths."""
    from flowforge.data.atari import AtariDataConfig, load_atari_clips, write_prompt_file
    from flowforge.demo.world import spaced

    clips = load_atari_clips(AtariDataConfig(), cache_dir) if clips is None else clips
    path = write_prompt_file(clips, spaced(clips.split("train"), STAGE_STARTS), directory, STAGES)
    _write_rows(path, stage_rows(path))
    return [path, *write_eval_prompts(directory)]


if __name__ == "__main__":
    print("wrote " + ", ".join(map(str, write_stage_prompts())))
