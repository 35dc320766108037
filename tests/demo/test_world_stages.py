"""The world pipeline's prompt set (``flowforge/demo/prompts/world-stages.jsonl``): demo:world-train row for row,
with the real future and the example frames every judge request of ``examples/stages/world.yaml`` carries."""

from __future__ import annotations

import json

from flowforge.data.prompts import load_prompts
from flowforge.demo import world_stages as W
from flowforge.rewards.judge.reference import load_reference


def test_the_shipped_stage_prompts_are_world_train_plus_reference_and_examples(tmp_path):
    shipped = W.PROMPTS_DIR / W.TARGET
    assert shipped.read_text() == "".join(json.dumps(r) + "\n" for r in W.stage_rows())  # regenerated: the same
    stages, train = load_prompts(shipped), load_prompts("demo:world-train")
    assert [(r.prompt, r.metadata["sample_id"], r.metadata["cluster"]) for r in stages] == [
        (r.prompt, r.metadata["sample_id"], r.metadata["cluster"]) for r in train]
    held_out = {r.metadata["image"] for r in load_prompts("demo:world-eval")}
    for record in stages[:4]:
        reference = load_reference(W.PROMPTS_DIR / record.metadata["reference"])
        assert reference.shape == (3, 32, 8 * 32)  # the real future: 8 frames side by side
        assert [str(W.PROMPTS_DIR / e) for e in record.metadata["examples"]] == [
            str(W.PROMPTS_DIR / e) for e in W.EXAMPLES]
        assert all(str((W.PROMPTS_DIR / e).resolve()) in held_out for e in W.EXAMPLES)  # never a training frame
