"""A ``vlm_json`` student on a world model's group (issue 39): the world pipeline's teacher
(:class:`flowforge.orchestrate.world_judge.WorldMechanicsJudge` behind a real ``flowforge serve judge`` on loopback)
judges a K = 4 group of real Breakout futures sent as the world pipeline sends them -- 8 ordered frames per candidate,
the real future as ``Reference:``, the condition frame, three static example images in their own slot. The judged
group read back from the request ledger keeps every image of the request, so the message a student trains on is the
message the teacher was sent (the server's own hash of it), and a tiny random Qwen2-VL student fitted on it, served by
``flowforge serve judge --student``, is sent that same message by stage C's client and answers the teacher's marks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from flowforge.reward_model.config import student_config
from flowforge.reward_model.data import (
    group_from_dict, group_message, group_to_dict, read_judged_groups, score_answer,
)
from flowforge.reward_model.students import create_student, load_student
from flowforge.rewards.judge import protocol as P
from flowforge.rewards.judge.client import VLMJudge
from flowforge.serve.judge_server import request_key
from tests.orchestrate.world_support import SHUFFLE, real_starts, save_png
from tests.reward_model import support
from tests.serve import judge_support as S

pytest.importorskip("ale_py")

FRAMES, SIDE = 8, 256  # as examples/stages/world.yaml: 8 frames, and a max side that keeps the reference strip whole
TOKEN = "world-vlm-token"
TEMPLATE = Path(__file__).resolve().parents[2] / "flowforge" / "rewards" / "judge_templates" / "group_v3.txt"


def _world_judge(url: str, run_dir, model: str, root) -> VLMJudge:
    return VLMJudge(model=model, base_url=url + "/v1", api_key_env="FF_WORLD_VLM_TOKEN", run_dir=run_dir,
                    frames=FRAMES, max_side=SIDE, max_concurrency=1, seed=0, reference_root=root,
                    template=TEMPLATE)


@pytest.fixture(scope="module")
def world_group(tmp_path_factory):
    """``(group, the teacher server's request record, media [4, 3, F, H, W], metadata, root)``: one group judged by
    the world teacher over loopback, read back from the client's request ledger."""
    root = tmp_path_factory.mktemp("world-vlm")
    starts = real_starts(2)
    prompt, real, bad = starts[0]
    other = starts[1][1]  # static examples: frames of another start (the pipeline's come from held-out episodes)
    meta = {"sample_id": "world-0", "reference": save_png(real, root / "real.png"),
            "image": save_png(real[:, 0], root / "first.png"),
            "examples": [save_png(other[:, t], root / f"example{t}.png") for t in (0, 3, 6)]}
    media = torch.stack([bad, real, real[:, SHUFFLE], bad.flip(-1)])
    (root / "token").write_text(TOKEN + "\n")
    (root / "opts.yaml").write_text("passes: 2\nlatency_s: 0.0\n")
    log = root / "teacher-requests.log"
    proc, url = S.start(["-m", "flowforge.cli", "serve", "judge", "--scorer",
                         "flowforge.orchestrate.world_judge:WorldMechanicsJudge", "--options", str(root / "opts.yaml"),
                         "--model-name", "world", "--port", "0", "--token-file", str(root / "token"),
                         "--request-log", str(log), "--num-threads", "1"])
    os.environ["FF_WORLD_VLM_TOKEN"] = TOKEN
    try:
        judge = _world_judge(url, root / "A", "world", root)
        judge(media, [prompt] * 4, [meta] * 4)
        judge.close()
    finally:
        S.stop(proc)
        os.environ.pop("FF_WORLD_VLM_TOKEN", None)
    [record] = P.read_request_log(log)
    [group] = read_judged_groups(root / "A" / "judge" / "ledger.sqlite")
    return group, record, media, meta, root


def test_a_judged_world_group_keeps_every_image_and_rebuilds_the_message_the_teacher_was_sent(world_group):
    group, record, _, _, _ = world_group
    assert [len(c) for c in group.candidates] == [FRAMES] * 4 and len(group.reference) == 1  # the reference strip
    assert len(group.condition) == 1 and len(group.examples) == 3
    assert group.condition_hashes == tuple(record["condition"]) and group.examples_hashes == tuple(record["examples"])
    # the server hashed the first user message's content as it arrived: the student's training message is that one
    assert request_key(group_message(group)[0]["content"]) == record["group"]
    parsed = P.read_group_request(group_message(group)[0]["content"])
    assert len(parsed.condition) == 1 and len(parsed.examples) == 3 and len(parsed.reference) == 1
    assert group_from_dict(json.loads(json.dumps(group_to_dict(group)))) == group  # side images survive JSON


def test_a_vlm_json_student_fits_a_world_group_and_answers_stage_c_with_the_teachers_marks(world_group, tmp_path,
                                                                                          monkeypatch):
    group, record, media, meta, root = world_group
    torch.set_num_threads(1)
    base = support.save_tiny_json_qwen2_vl(tmp_path / "tiny-json-qwen2-vl")
    student = create_student(student_config({"kind": "vlm_json", "vlm_json": {
        "base": str(base), "lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.0}}))
    losses = support.overfit(student, [group])
    assert losses[-1] < 0.2 * losses[0]
    expected = P.parse_scores(score_answer(group), group.labels)  # the teacher's marks, to 0.01
    student.save(tmp_path / "student")
    assert load_student(tmp_path / "student").predict([group])[0].tolist() == pytest.approx(expected)

    (tmp_path / "token").write_text(TOKEN + "\n")
    log = tmp_path / "student-requests.log"
    proc, url = S.start(["-m", "flowforge.cli", "serve", "judge", "--student", str(tmp_path / "student"), "--port",
                         "0", "--token-file", str(tmp_path / "token"), "--num-threads", "1", "--request-log", str(log)])
    monkeypatch.setenv("FF_WORLD_VLM_TOKEN", TOKEN)
    try:  # stage C's client, pointed at the student, sends the same media and side images
        judge = _world_judge(url, tmp_path / "C", "student", root)
        scores = judge(media, [group.prompt] * 4, [meta] * 4)
        judge.close()
    finally:
        S.stop(proc)
    [served] = P.read_request_log(log)
    assert served["group"] == record["group"]  # the student was sent, byte for byte, what it was trained on
    teacher_order = [0.0] * 4
    for position, candidate in enumerate(group.permutation):
        teacher_order[candidate] = expected[position]
    assert scores.tolist() == pytest.approx(teacher_order)


def test_a_group_whose_example_image_is_gone_is_skipped_like_one_without_a_candidate_frame(world_group, tmp_path):
    import shutil

    group, _, _, _, root = world_group
    moved = tmp_path / "A"
    shutil.copytree(root / "A", moved)
    media = root / "A" / "judge" / "media"
    media.rename(root / "A" / "judge" / "media-away")  # the stored absolute paths now lead nowhere: found by hash
    try:
        assert [g.key for g in read_judged_groups(moved / "judge" / "ledger.sqlite")] == [group.key]
        digest = group.examples_hashes[1]
        (moved / "judge" / "media" / digest[:2] / f"{digest}.jpg").unlink()
        assert read_judged_groups(moved / "judge" / "ledger.sqlite") == []  # not a message without its examples
    finally:
        (root / "A" / "judge" / "media-away").rename(media)
