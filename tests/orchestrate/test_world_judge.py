"""The world pipeline's teacher (:mod:`flowforge.orchestrate.world_judge`) on real Breakout frames from ale-py.

Each start is a real game state (seeded emulator, random moves); from it the emulator plays the commanded moves --
the real future, which is also the reference -- and the same moves with LEFT and RIGHT swapped (a future with the
wrong paddle moves, every frame a real one). A shuffled future is the real frames 1..F-1 out of order.
"""

from __future__ import annotations

import pytest
import torch

from flowforge.orchestrate.world_judge import WorldMechanicsJudge, commands_from_prompt
from flowforge.rewards.judge import protocol as P
from flowforge.rewards.judge.client import VLMJudge
from tests.orchestrate.world_support import SHUFFLE, real_starts, save_png
from tests.serve import judge_support as S

ale_py = pytest.importorskip("ale_py")


@pytest.fixture(scope="module")
def starts():
    """Six real starts where the game is running (:func:`tests.orchestrate.world_support.real_starts`)."""
    return real_starts(6)


def test_the_real_future_beats_shuffled_frames_and_wrong_paddle_moves(starts):
    judge = WorldMechanicsJudge(passes=4)
    all_scores = []
    for prompt, real, bad in starts:
        video = torch.stack([real, real[:, SHUFFLE], bad])
        scores = judge(video, [prompt] * 3, [{"reference_media": real}] * 3)
        assert scores[0] > scores[1] and scores[0] > scores[2], (prompt, scores)
        marks = judge.marks(video, [prompt] * 3, [{"reference_media": real}] * 3)
        assert marks[0]["command"] > marks[2]["command"]  # the commanded moves are what tells them apart
        all_scores.append(scores)
    mean = torch.stack(all_scores).mean(0)  # [real, shuffled, wrong moves]
    assert mean[0] > 0.9 and mean[0] - mean[1] > 0.2 and mean[0] - mean[2] > 0.2, mean


def test_a_mark_depends_on_the_candidate_alone_and_the_strip_reference_reads_like_frames(starts):
    prompt, real, bad = starts[0]
    judge = WorldMechanicsJudge(passes=3)
    strip = real.permute(0, 2, 1, 3).flatten(2)  # [3, H, F W]: the prompt rows' real_clip layout
    group = judge(torch.stack([bad, real]), [prompt] * 2, [{"reference_media": strip}] * 2)
    alone = judge(bad[None], [prompt], [{"reference_media": real}])
    torch.testing.assert_close(group[0], alone[0])


def test_bad_input_is_refused_naming_what_is_allowed(starts):
    prompt, real, _ = starts[0]
    judge = WorldMechanicsJudge(passes=1)
    with pytest.raises(ValueError, match="allowed: \\['LEFT', 'NOOP', 'RIGHT'\\]"):
        commands_from_prompt("LEFT JUMP", 2)
    with pytest.raises(ValueError, match="reference_media"):
        judge(real[None], [prompt], [{}])
    with pytest.raises(ValueError, match="passes"):
        WorldMechanicsJudge(passes=0)


def test_served_over_loopback_it_answers_a_group_billed_once(starts, tmp_path):
    """``flowforge serve judge --scorer ...WorldMechanicsJudge`` on 127.0.0.1 answers a K = 4 group sent by the
    ``vlm_judge`` client with the real future as a strip PNG reference: the real future ranks first, and the
    server's own request log shows one request for the group."""
    prompt, real, bad = starts[1]
    save_png(real, tmp_path / "real.png")
    (tmp_path / "token").write_text("world-token\n")
    (tmp_path / "opts.yaml").write_text("passes: 2\nlatency_s: 0.0\n")
    log = tmp_path / "requests.log"
    proc, url = S.start(["-m", "flowforge.cli", "serve", "judge", "--scorer",
                         "flowforge.orchestrate.world_judge:WorldMechanicsJudge", "--options",
                         str(tmp_path / "opts.yaml"), "--model-name", "world", "--port", "0", "--token-file",
                         str(tmp_path / "token"), "--request-log", str(log), "--num-threads", "1"])
    try:
        import os

        os.environ["FF_WORLD_TOKEN"] = "world-token"
        judge = VLMJudge(model="world", base_url=url + "/v1", api_key_env="FF_WORLD_TOKEN",
                         ledger=tmp_path / "l.db", frames=8, max_side=256, jpeg_quality=95, max_concurrency=1,
                         reference_root=tmp_path)
        media = torch.stack([bad, real, real[:, SHUFFLE], bad.flip(-1)])
        meta = [{"sample_id": "s0", "reference": "real.png"}] * 4
        scores = judge(media, [prompt] * 4, meta)
        judge.close()
    finally:
        S.stop(proc)
        os.environ.pop("FF_WORLD_TOKEN", None)
    assert torch.isfinite(scores).all() and int(scores.argmax()) == 1, scores
    records = P.read_request_log(log)
    assert len(records) == 1 and list(P.billed_per_group(records).values()) == [1]
    assert len(records[0]["reference"]) == 1  # the strip travelled as the request's reference
