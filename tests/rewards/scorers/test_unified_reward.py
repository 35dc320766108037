"""``unified_reward`` against a real OpenAI-compatible server on loopback (flowforge's judge server, in a thread):
the official prompt and image encoding, the strict ``Final Score`` parse, the ledger that never bills twice, and
the retry rules of the group judge."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from flowforge.rewards.judge.ledger import RequestLedger
from flowforge.rewards.judge.protocol import MalformedReply, read_request_log
from flowforge.rewards.registry import build_scorer
from flowforge.rewards.scorers.unified_reward import parse_final_score
from tests.rewards.loopback import TOKEN, TOKEN_ENV
from tests.rewards.scorers.pointwise_server import Answers, pointwise_server

# the f-string of CodeGoat24/UnifiedReward inference_qwen/image_generation/qwen_point_score_image_generation.py
# (commit ed52f98), typed from the file; {prompt} is the caption
OFFICIAL = ('You are given a text caption and a generated image based on that caption. Your task is to evaluate this '
            'image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with '
            'the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as '
            'described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including '
            'clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nExtract key elements from '
            'the provided text caption, evaluate their presence in the generated image using the format: \'element '
            '(type): value\' (where value=0 means not generated, and value=1 means generated), and assign a score '
            'from 1 to 5 after \'Final Score:\'.\nYour task is provided as follows:\nText Caption: [{prompt}]')


def brightness_reply(images, text):
    """A content-dependent answer: ``Final Score: 1 + 4 * mean pixel`` (two decimals) after an element line."""
    return f"cat (object): 1\nFinal Score: {1 + 4 * float(images[0].mean()):.2f}"


@pytest.fixture()
def server(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    backend = Answers(brightness_reply)
    log = tmp_path / "requests.jsonl"
    with pointwise_server(backend, log) as url:
        yield url, backend, log


def scorer(url, tmp_path, **options):
    return build_scorer("unified_reward", model="UnifiedReward", base_url=url, api_key_env=TOKEN_ENV,
                        ledger=str(tmp_path / "ledger.sqlite"), retry_backoff_s=0.0, **options)


def test_parse_final_score_is_strict():
    assert parse_final_score("a (object): 1\nb (attribute): 0\nFinal Score: 3.5") == 3.5
    assert parse_final_score("Final Score: **4**") == 4.0
    for bad in ("", None, "The image is fine.", "Final Score: 10", "Final Score: 0.5", "Final Score: five",
                "Final Score: 3\nFinal Score: 4", "Final Score: -2"):
        with pytest.raises(MalformedReply):
            parse_final_score(bad)


def test_official_prompt_and_image_bytes(server, tmp_path):
    from PIL import Image

    url, backend, _ = server
    media = torch.rand(1, 3, 24, 20, generator=torch.Generator().manual_seed(0))
    scores = scorer(url, tmp_path)(media, ["a cat on a mat"], [{}])
    parts = backend.seen[0][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text"]  # image first, then the text (the official order)
    assert parts[1]["text"] == OFFICIAL.format(prompt="a cat on a mat")
    # the official client: PIL RGB image saved as JPEG quality 95 -- the sent bytes are those bytes exactly
    from flowforge.rewards.judge.protocol import decode_data_url

    pixels = (media[0] * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert("RGB").save(buffer, format="JPEG", quality=95)
    assert decode_data_url(parts[0]["image_url"]["url"]) == buffer.getvalue()
    decoded = torch.from_numpy(np.array(Image.open(buffer).convert("RGB"))).permute(2, 0, 1) / 255
    expected = round(1 + 4 * float(decoded.mean()), 2) / 5
    assert abs(float(scores[0]) - expected) < 1e-6


def test_scores_follow_the_image_and_nothing_is_billed_twice(server, tmp_path):
    url, _, log = server
    dark, light = torch.full((3, 16, 16), 0.2), torch.full((3, 16, 16), 0.8)
    media = torch.stack([dark, light, dark])
    score = scorer(url, tmp_path)
    first = score(media, ["p", "p", "p"], [{}] * 3)
    assert first[1] > first[0] and first[0] == first[2]
    assert len(read_request_log(log)) == 2  # the repeated sample is one request
    m = score.pop_metrics()
    assert (m["requests_sent"], m["billed"], m["failures"]) == (2.0, 2.0, 0.0)
    again = scorer(url, tmp_path)(media, ["p", "p", "p"], [{}] * 3)  # a rerun: a new scorer on the same ledger
    assert torch.equal(first, again)
    assert len(read_request_log(log)) == 2


def test_malformed_answers_are_nan_recorded_and_never_resent(server, tmp_path):
    url, _, log = server
    media = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    prompts = ["MALFORMED", "TWICE", "OUT", "fine"]
    score = scorer(url, tmp_path)
    out = score(media, prompts, [{}] * 4)
    assert [math.isnan(float(s)) for s in out] == [True, True, True, False]
    m = score.pop_metrics()
    assert (m["malformed"], m["failures"], m["billed"]) == (3.0, 3.0, 4.0)
    ledger = RequestLedger(tmp_path / "ledger.sqlite")
    assert sorted(e.status for e in ledger.entries()) == ["malformed", "malformed", "malformed", "ok"]
    assert all(e.attempts == 1 for e in ledger.entries())
    score(media, prompts, [{}] * 4)
    assert len(read_request_log(log)) == 4  # answered, malformed or not: never asked again


def test_retry_rules_are_the_judges(server, tmp_path):
    url, _, log = server
    media = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    score = scorer(url, tmp_path)
    out = score(media, ["FAIL500", "BUSY429"], [{}] * 2)
    # a 500 may have been billed: not retried by default; a 429 cannot have been: retried and answered
    assert math.isnan(float(out[0])) and not math.isnan(float(out[1]))
    assert len(read_request_log(log)) == 3
    assert score.pop_metrics()["retries"] == 1.0
    score(media, ["FAIL500", "BUSY429"], [{}] * 2)
    assert len(read_request_log(log)) == 3  # the billed 500 is never sent again
    opted = scorer(url, tmp_path / "opt", retry_on=["5xx"], max_attempts=2)
    assert math.isnan(float(opted(media[:1], ["FAIL500"], [{}])[0]))
    assert len(read_request_log(log)) == 5  # opted in: sent twice (max_attempts), then given up


def test_options_are_checked(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(ValueError, match="retry_on"):
        build_scorer("unified_reward", model="m", base_url="http://127.0.0.1:9/v1", api_key_env=TOKEN_ENV,
                     retry_on=["sometimes"])
    with pytest.raises(ValueError, match="jpeg_quality"):
        build_scorer("unified_reward", model="m", base_url="http://127.0.0.1:9/v1", api_key_env=TOKEN_ENV,
                     jpeg_quality=101)
    with pytest.raises(ValueError, match="FF_NOT_SET_ANYWHERE"):
        build_scorer("unified_reward", model="m", base_url="http://127.0.0.1:9/v1", api_key_env="FF_NOT_SET_ANYWHERE")


def test_through_the_reward_processor(server, tmp_path):
    from flowforge.rewards.processor import RewardProcessor

    url, _, log = server
    media = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    processor = RewardProcessor({"unified_reward": scorer(url, tmp_path)}, {"unified_reward": 1.0})
    components, metrics = processor(media, ["a", "b", "MALFORMED", "d"], [{}] * 4)
    scores = components["unified_reward"]
    assert math.isnan(float(scores[2])) and not scores[[0, 1, 3]].isnan().any()
    assert (metrics["reward/unified_reward_billed"], metrics["reward/unified_reward_malformed"]) == (4.0, 1.0)
    # a paid scorer at evaluation: only the groups allowed are asked (none here), nothing is sent
    components, _ = processor(media, ["e", "f", "g", "h"], [{}] * 4, group_ids=torch.arange(4), paid_groups=0)
    assert len(read_request_log(log)) == 4
    required = RewardProcessor({"unified_reward": scorer(url, tmp_path)}, {"unified_reward": 1.0},
                               required=["unified_reward"])
    with pytest.raises(ValueError, match="unified_reward"):
        required(media, ["a", "b", "MALFORMED", "d"], [{}] * 4)


def test_a_refused_token_is_an_error_and_not_billed(server, tmp_path, monkeypatch):
    from flowforge.rewards.judge.transport import JudgeError

    url, _, log = server
    monkeypatch.setenv("FF_TEST_WRONG_TOKEN", "not-the-token")
    score = build_scorer("unified_reward", model="UnifiedReward", base_url=url, api_key_env="FF_TEST_WRONG_TOKEN",
                         ledger=str(tmp_path / "ledger.sqlite"))
    with pytest.raises(JudgeError, match="unified_reward: .*refused the token from api_key_env=FF_TEST_WRONG_TOKEN"):
        score(torch.rand(1, 3, 8, 8), ["p"], [{}])
    assert RequestLedger(tmp_path / "ledger.sqlite").billed() == 0


def test_killed_after_any_ledger_commit_the_rerun_sends_no_body_twice(server, tmp_path, monkeypatch):
    """Every state a kill can leave: the run stops right after each of the ledger's commits in turn (claims, begin,
    attempt recorded, answer + end) of a malformed and a parseable sample; a new process (another owner token)
    reruns both. The server never receives one body twice. Found in review: the malformed answer and the request's
    end were two commits; a kill between them left an answered attempt beside a pending request, and the rerun sent
    it again (paid twice)."""
    from flowforge.rewards.judge import ledger as ledger_module
    from tests.serve.test_judge_crash import _DieAfterCommit, _Killed

    url, _, log = server
    media = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    prompts = ["MALFORMED", "fine"]
    commits, stop = None, 1
    while commits is None or stop <= commits:
        before = len(read_request_log(log))
        root = tmp_path / f"stop_{stop}"
        killed = scorer(url, root, max_concurrency=1)  # one at a time: the commits come in one order
        killed.ledger._db = _DieAfterCommit(killed.ledger._db, stop)
        try:
            killed(media, prompts, [{}] * 2)
        except _Killed:
            pass
        else:  # ran to the end: every commit has been a stopping point
            commits = killed.ledger._db.commits
        killed.close()
        monkeypatch.setattr(ledger_module, "OWNER", f"rerun-{stop}")
        rerun = scorer(url, root, max_concurrency=1)
        out = rerun(media, prompts, [{}] * 2)
        keys = [r["key"] for r in read_request_log(log)[before:]]
        assert len(keys) == len(set(keys)), f"stopped after commit {stop}: a body was sent twice"
        assert math.isnan(float(out[0]))  # malformed (or lost): never a reward
        lost = [f for f in rerun.ledger.failures() if f["status"] == "lost"]
        # the ledger's bill agrees with the server's log (a lost attempt is billed: it may have left)
        assert len(lost) <= 1 and len(keys) <= rerun.ledger.billed() <= len(keys) + len(lost)
        rerun.close()
        stop += 1
    assert commits == 8  # claim, claim; begin, attempt, answer + end (malformed); begin, attempt, answer + end
