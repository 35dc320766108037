"""The world pipeline's prompt sets (``flowforge/demo/prompts/world-stages.jsonl`` / ``world-stages-eval.jsonl``):
clips of demo:world's training episodes and demo:world-eval row for row, with the real future and the example
frames every judge request of ``examples/stages/world.yaml`` carries."""

from __future__ import annotations

import json

import pytest

from flowforge.data.prompts import load_prompts
from flowforge.demo import world_stages as W
from flowforge.rewards.judge.reference import load_reference


def test_the_shipped_stage_prompts_are_training_clips_plus_reference_and_examples(tmp_path):
    shipped = W.PROMPTS_DIR / f"{W.STAGES}.jsonl"
    rows = [json.loads(line) for line in shipped.read_text().splitlines()]
    assert len(rows) == W.STAGE_STARTS == len({r["metadata"]["sample_id"] for r in rows})
    assert all(r["metadata"]["cluster"] == f"episode:{r['metadata']['episode']}" for r in rows)
    assert all(r["prompt"] == " ".join(r["metadata"]["actions"]) for r in rows)
    stages = load_prompts(shipped)
    train_episodes = {r.metadata["episode"] for r in load_prompts("demo:world-train")}
    eval_rows = load_prompts("demo:world-eval")
    assert {r.metadata["episode"] for r in stages} == train_episodes  # every training episode, no held-out one
    assert not train_episodes & {r.metadata["episode"] for r in eval_rows}
    for source, target in W.EVAL_SETS.items():  # regenerated: the same
        assert (W.PROMPTS_DIR / target).read_text() == "".join(
            json.dumps(r) + "\n" for r in W.stage_rows(W.PROMPTS_DIR / source))
    stages_eval = load_prompts(W.PROMPTS_DIR / "world-stages-eval.jsonl")
    assert [(r.prompt, r.metadata["image"]) for r in stages_eval] == [
        (r.prompt, r.metadata["image"]) for r in eval_rows]  # the same held-out starts
    held_out = {r.metadata["image"] for r in eval_rows}
    for record in stages[::64] + stages_eval[:2]:
        assert (W.PROMPTS_DIR / record.metadata["image"]).is_file()
        reference = load_reference(W.PROMPTS_DIR / record.metadata["reference"])
        assert reference.shape == (3, 32, 8 * 32)  # the real future: 8 frames side by side
        assert [str(W.PROMPTS_DIR / e) for e in record.metadata["examples"]] == [
            str(W.PROMPTS_DIR / e) for e in W.EXAMPLES]
        assert all(str((W.PROMPTS_DIR / e).resolve()) in held_out for e in W.EXAMPLES)  # never a training frame


@pytest.mark.slow
def test_the_stage_prompts_regenerate_byte_for_byte_from_the_recording(tmp_path):
    """``python -m flowforge.demo.world_stages`` from the ale-py recording (~20 s) writes the shipped files."""
    import shutil

    pytest.importorskip("ale_py")
    for source in W.EVAL_SETS:
        shutil.copy(W.PROMPTS_DIR / source, tmp_path / source)
    paths = W.write_stage_prompts(tmp_path, cache_dir=str(tmp_path / "cache"))
    for path in paths:
        assert path.read_text() == (W.PROMPTS_DIR / path.name).read_text()
    written = sorted(p.name for p in (tmp_path / W.STAGES).iterdir())
    assert written == sorted(p.name for p in (W.PROMPTS_DIR / W.STAGES).iterdir())
    for name in written[::50]:
        assert (tmp_path / W.STAGES / name).read_bytes() == (W.PROMPTS_DIR / W.STAGES / name).read_bytes()
