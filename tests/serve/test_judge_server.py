"""``flowforge serve judge`` and the ``vlm_judge`` client against it, over real HTTP on loopback.

Servers run as subprocesses on a free port with a token and print the URL they serve at: the scorer backend
(``python -m flowforge.cli serve judge --scorer ...``), the tiny random Qwen2-VL backend (``--model DIR``), and a
scripted backend (:mod:`tests.serve.judge_support`, the same app factory) that produces malformed replies, slow
answers and 5xx errors on demand. Every server keeps its own request log (one JSON line per request it received:
the group it belongs to and each candidate's frame hashes), which is what the billing assertions count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from flowforge.rewards.judge import protocol as P
from flowforge.rewards.judge.client import JudgeError, VLMJudge
from flowforge.rewards.judge.ledger import BudgetExhausted
from flowforge.serve.judge_server import billed_per_group, read_request_log
from tests.serve import judge_support as S
from tests.serve.server import post_declared_only

TOKEN = "judge-test-token"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(autouse=True)
def _token_env(monkeypatch):
    monkeypatch.setenv(S.TOKEN_ENV, TOKEN)


@pytest.fixture(scope="module")
def scorer_server(token_file, tmp_path_factory):
    """``serve judge --scorer`` with the content-dependent ``Brightness`` scorer: ``(base URL, request log)``."""
    log = tmp_path_factory.mktemp("scorer") / "requests.log"
    proc, url = S.start(["-m", "flowforge.cli", "serve", "judge", "--scorer", "tests.serve.judge_support:Brightness",
                         "--model-name", "brightness", "--port", "0", "--token-file", str(token_file),
                         "--request-log", str(log), "--max-body-mb", "1", "--num-threads", "1"])
    yield url, log
    S.stop(proc)


@pytest.fixture(scope="module")
def scripted_server(token_file, tmp_path_factory):
    """The scripted backend: ``(base URL, script file, request log)``; write the behaviours before each request."""
    root = tmp_path_factory.mktemp("scripted")
    script, log = root / "script.json", root / "requests.log"
    proc, url = S.start(["-m", "tests.serve.judge_support", "scripted", "--script", str(script), "--token-file",
                         str(token_file), "--request-log", str(log)])
    yield url, script, log
    S.stop(proc)


def _lines(path: Path) -> list[str]:
    """The request keys of a server's request log, in order."""
    return [r["key"] for r in read_request_log(path)]


def _brightness(media: torch.Tensor) -> torch.Tensor:
    return media.float().flatten(1).mean(1)


def _http(url: str, body: bytes | None = None, token: str | None = TOKEN) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


# ------------------------------------------------------------------------------------------------ scorer backend

def test_scores_come_back_to_the_right_candidates_and_are_served_from_the_ledger(scorer_server, tmp_path):
    url, log = scorer_server
    judge = VLMJudge(model="brightness", base_url=url + "/v1", api_key_env=S.TOKEN_ENV, ledger=tmp_path / "l.db",
                     frames=3, max_side=64, max_concurrency=3, seed=7)
    groups = [S.group(seed) for seed in range(5)] + [S.group(9, k=3, frames=4)]  # images, then videos
    perms = [judge._prepare(*g).perm for g in groups]
    assert sum(p != sorted(p) for p in perms) >= 3  # the candidates really were shown shuffled
    before = len(_lines(log))
    out = judge.score_groups(groups)
    for (media, _, _), scores in zip(groups, out, strict=True):
        # candidates differ by >= 0.2 in brightness, so any mix-up of positions would be far off
        assert torch.allclose(scores, _brightness(media), atol=0.01), (scores, _brightness(media))
    metrics = judge.pop_metrics()
    assert metrics["requests_sent"] == 6 and metrics["served_from_ledger"] == 0 and metrics["failures"] == 0
    assert metrics["tokens"] > 0 and metrics["latency_s"] > 0
    assert len(_lines(log)) == before + 6
    again = judge.score_groups(groups)  # a rerun of the same step: every answer from the ledger, nothing sent
    assert all(torch.equal(a, b) for a, b in zip(out, again, strict=True))
    assert judge.pop_metrics()["served_from_ledger"] == 6 and len(_lines(log)) == before + 6
    twice = judge.score_groups([S.group(40), S.group(40)])  # one group twice in one call: asked once
    assert torch.equal(twice[0], twice[1]) and judge.pop_metrics()["requests_sent"] == 1
    assert len(_lines(log)) == before + 7


def test_the_reference_reaches_the_scorer(scorer_server, tmp_path):
    from PIL import Image

    url, _ = scorer_server
    Image.new("RGB", (16, 16), (128, 128, 128)).save(tmp_path / "ref.png")
    judge = VLMJudge(model="brightness", base_url=url + "/v1", api_key_env=S.TOKEN_ENV, ledger=tmp_path / "l.db",
                     frames=1, max_side=64, reference_root=tmp_path)
    media, prompts, metadata = S.group(21)
    scores = judge(media, prompts, [{**m, "reference": "ref.png"} for m in metadata])
    assert torch.allclose(scores, 1 - (_brightness(media) - 128 / 255).abs(), atol=0.01)


def test_auth_and_payload_errors(scorer_server, tmp_path, monkeypatch):
    url, _ = scorer_server
    assert _http(url + "/health", token=None)[0] == 200
    assert _http(url + "/v1/models", token=None)[0] == 401
    assert _http(url + "/v1/models", token="wrong")[0] == 401
    status, body = _http(url + "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["brightness"]
    chat = url + "/v1/chat/completions"
    valid = {"model": "brightness", "messages": [{"role": "user", "content": "hi"}]}
    status, body = _http(chat, json.dumps(valid).encode(), token=None)
    assert status == 401 and "bearer" in body["error"]["message"].lower()
    cases = [
        (b"{not json", 400, "not JSON"),
        (json.dumps({"model": "brightness"}).encode(), 422, "messages"),
        (json.dumps({**valid, "model": "gpt-9"}).encode(), 404, "unknown model"),
        (json.dumps({**valid, "n": 2}).encode(), 400, "n=1"),
        (json.dumps(valid).encode(), 422, "Candidate"),  # no group in the message
        (json.dumps({**valid, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Candidate A:"},
            {"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}]}]}).encode(),
         422, "data:image"),
    ]
    for body_bytes, code, text in cases:
        status, body = _http(chat, body_bytes)
        assert status == code and text in body["error"]["message"], (code, status, body)
    # an oversized body is refused from its Content-Length, before it is read
    status, body = post_declared_only(chat, 2 * 2**20, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 413 and "exceeds" in body["error"]["message"], (status, body)
    monkeypatch.setenv("FF_WRONG_TOKEN_ENV", "not-the-token")
    wrong = VLMJudge(model="brightness", base_url=url + "/v1", api_key_env="FF_WRONG_TOKEN_ENV",
                     ledger=tmp_path / "l.db", frames=1, max_side=16)
    with pytest.raises(JudgeError, match="401"):
        wrong(*S.group(0))


def test_videos_reach_the_judge_as_videos_frames_counted_and_ordered(token_file, tmp_path):
    """Through the reward processor, as the trainer calls it: a step of 2 prompts x 4 candidate videos of 30 frames
    becomes 2 requests of 4 candidates x 24 frames each (never 8 x 30 single-frame candidates). The server's own log
    holds each label's frames exactly as the client encoded the candidate shown there (count, content, temporal
    order), and the video scorer on the server confirms the order from the pixels."""
    from flowforge.rewards import RewardProcessor

    log = tmp_path / "requests.log"
    proc, url = S.start(["-m", "flowforge.cli", "serve", "judge", "--scorer", "tests.serve.judge_support:FrameOrder",
                         "--model-name", "frames", "--port", "0", "--token-file", str(token_file), "--request-log",
                         str(log), "--num-threads", "1", "--score-range", "0", "1"])
    try:
        judge = VLMJudge(model="frames", base_url=url + "/v1", api_key_env=S.TOKEN_ENV, ledger=tmp_path / "l.db",
                         max_side=64, seed=5, max_concurrency=1)  # one at a time: the log in group order
        assert judge.frames == 24  # the protocol's default
        levels = [[0.2, 0.8, 0.5, 0.35], [0.65, 0.1, 0.9, 0.45]]
        media = torch.cat([S.ordered_video(lv, frames=30) for lv in levels])  # [8, 3, 30, 16, 16]
        prompts = [f"prompt {g}" for g in (0, 1) for _ in range(4)]
        metadata = [{"sample_id": f"c{g}"} for g in (0, 1) for _ in range(4)]
        components, metrics = RewardProcessor({"vlm_judge": judge}, {"vlm_judge": 1.0})(
            media, prompts, metadata, torch.tensor([0] * 4 + [1] * 4))
        assert metrics["reward/vlm_judge_groups_scored"] == 2 and metrics["reward/vlm_judge_requests_sent"] == 2
        # the scorer saw every candidate's frames in temporal order (else 0) and each score came back to its video
        assert torch.allclose(components["vlm_judge"], torch.tensor(levels).view(-1), atol=0.02)
        records = read_request_log(log)
        assert len(records) == 2 and billed_per_group(records) == {r["group"]: 1 for r in records}
        indices = P.frame_indices(30, 24)
        for record, g in zip(records, (0, 1), strict=True):
            rows = media[4 * g:4 * g + 4]
            perm = judge._prepare(rows, prompts[4 * g:4 * g + 4], metadata[4 * g:4 * g + 4]).perm
            assert sorted(perm) == [0, 1, 2, 3] and perm != [0, 1, 2, 3]
            labels = P.candidate_labels(4)
            assert list(record["candidates"]) == labels
            for label, candidate in zip(labels, perm, strict=True):
                expected = [P.sha256_hex(P.jpeg_bytes(rows[candidate][:, f], 64)) for f in indices]
                assert record["candidates"][label] == expected  # 24 frames, this candidate's, in order
    finally:
        S.stop(proc)


# ------------------------------------------------------------------------------------------------ scripted replies

def _scripted_judge(url: str, tmp_path: Path, **kw) -> VLMJudge:
    return VLMJudge(model="scripted", base_url=url + "/v1", api_key_env=S.TOKEN_ENV, ledger=tmp_path / "l.db",
                    frames=1, max_side=32, max_concurrency=1, retry_backoff_s=0.01, **kw)


def _billed_by_server(log: Path, before: int) -> list[int]:
    """Requests per group the server received since line ``before`` of its log."""
    return sorted(billed_per_group(read_request_log(log)[before:]).values())


@pytest.mark.parametrize("behaviour, reason", [
    ("malformed", "not a single JSON object"), ("wrong_count", "wrong count"), ("out_of_range", "outside"),
    ("extra_key", "extra keys"), ("nan", "non-finite"), ("fence", "not a single JSON object"),
])
def test_a_malformed_reply_is_repaired(scripted_server, tmp_path, behaviour, reason):
    url, script, log = scripted_server
    script.write_text(json.dumps([behaviour]))
    judge = _scripted_judge(url, tmp_path, max_attempts=3)
    media, prompts, metadata = S.group(31)
    before = len(_lines(log))
    scores = judge(media, prompts, metadata)
    assert torch.allclose(scores, _brightness(media), atol=0.01)
    metrics = judge.pop_metrics()
    assert (metrics["requests_sent"], metrics["billed"], metrics["retries"], metrics["failures"]) == (2, 2, 1, 0)
    assert _billed_by_server(log, before) == [2]  # the first send and its repair: one group, two billed requests
    entry = judge.ledger.get(judge.ledger.keys()[0])
    assert entry.status == "ok" and entry.attempts == 2 and reason in entry.response[0]["verdict"]
    assert entry.request["repairs"] and "Reply again" in entry.request["repairs"][0]
    assert [a["kind"] for a in judge.ledger.attempts(entry.key)] == ["first", "repair"]


def test_still_malformed_after_every_attempt_is_nan_counted_and_never_resent(scripted_server, tmp_path):
    url, script, log = scripted_server
    script.write_text(json.dumps(["wrong_count", "out_of_range", "extra_key"]))
    media, prompts, metadata = S.group(32)
    judge = _scripted_judge(url, tmp_path, max_attempts=3)
    before = len(_lines(log))
    assert torch.isnan(judge(media, prompts, metadata)).all()
    metrics = judge.pop_metrics()
    assert (metrics["requests_sent"], metrics["retries"], metrics["failures"]) == (3, 2, 1)
    entry = judge.ledger.get(judge.ledger.keys()[0])
    assert entry.status == "malformed" and [a["verdict"].split(":")[0] for a in entry.response] == ["malformed"] * 3
    judge.close()
    rerun = _scripted_judge(url, tmp_path, max_attempts=5)  # the answer was given: it is not asked again
    assert torch.isnan(rerun(media, prompts, metadata)).all()
    metrics = rerun.pop_metrics()
    assert (metrics["requests_sent"], metrics["served_from_ledger"], metrics["failures"]) == (0, 1, 1)
    assert _billed_by_server(log, before) == [3]


@pytest.mark.parametrize("behaviour", ["sleep:2.5", "status:503", "status:500", "status:408", "not_json",
                                       "no_choices"])
def test_a_failure_that_may_have_been_billed_is_never_sent_again_by_default(scripted_server, tmp_path, behaviour):
    """A timeout, a 5xx, a 408 or a 200 that is no chat completion may have been processed and billed by the
    provider: the attempt is recorded billed, the group dropped (NaN, counted) and never sent again -- not on this
    call, not by the next call, not by a rerun -- and nothing crashes."""
    url, script, log = scripted_server
    script.write_text(json.dumps([behaviour, "ok", "ok"]))
    judge = _scripted_judge(url, tmp_path, timeout_s=1.0, max_attempts=3)
    media, prompts, metadata = S.group(33)
    before = len(_lines(log))
    assert torch.isnan(judge(media, prompts, metadata)).all()
    metrics = judge.pop_metrics()
    assert (metrics["requests_sent"], metrics["billed"], metrics["retries"], metrics["failures"]) == (1, 1, 0, 1)
    failure = judge.ledger.failures()[0]
    assert failure["status"] == "failed" and failure["attempts"] == 1 and judge.ledger.billed() == 1
    assert torch.isnan(judge(media, prompts, metadata)).all() and judge.pop_metrics()["requests_sent"] == 0
    judge.close()
    rerun = _scripted_judge(url, tmp_path, max_attempts=3)
    assert torch.isnan(rerun(media, prompts, metadata)).all() and rerun.pop_metrics()["requests_sent"] == 0
    assert _billed_by_server(log, before) == [1]  # the server's own count


def test_retries_of_billed_failures_are_opt_in_and_bounded(scripted_server, tmp_path):
    """``retry_on: [timeout, 5xx]`` pays for a re-send: ``max_attempts`` bounds what one group can cost over every
    run -- here 3 billed attempts, the server's log agreeing, and no 4th on a rerun."""
    url, script, log = scripted_server
    script.write_text(json.dumps(["sleep:2.5", "status:503", "status:500", "ok"]))
    judge = _scripted_judge(url, tmp_path, timeout_s=1.0, max_attempts=3, retry_on=["timeout", "5xx"])
    media, prompts, metadata = S.group(33)
    before = len(_lines(log))
    assert torch.isnan(judge(media, prompts, metadata)).all()
    metrics = judge.pop_metrics()
    assert (metrics["requests_sent"], metrics["billed"], metrics["retries"], metrics["failures"]) == (3, 3, 2, 1)
    key = judge.ledger.keys(statuses=("failed",))[0]
    attempts = judge.ledger.attempts(key)
    assert [(a["kind"], a["outcome"], a["billed"]) for a in attempts] == [
        ("first", "timeout", 1), ("retry", "http_error", 1), ("retry", "http_error", 1)]
    assert [a["http_status"] for a in attempts] == [None, 503, 500]
    assert _billed_by_server(log, before) == [3] and judge.ledger.billed() == 3
    judge.close()
    rerun = _scripted_judge(url, tmp_path, max_attempts=3, retry_on=["timeout", "5xx"])  # spent: not asked again
    assert torch.isnan(rerun(media, prompts, metadata)).all() and rerun.pop_metrics()["requests_sent"] == 0
    assert _billed_by_server(log, before) == [3]
    script.write_text(json.dumps(["status:503", "ok"]))  # a retry that is answered: 2 billed, scores correct
    fresh = _scripted_judge(url, tmp_path / "fresh", max_attempts=3, retry_on=["5xx"])
    assert torch.allclose(fresh(*S.group(35)), _brightness(S.group(35)[0]), atol=0.01)
    assert fresh.pop_metrics()["billed"] == 2


def test_failures_that_cannot_have_been_billed_are_retried(scripted_server, tmp_path):
    """A 429 (rate limited before any work) and a refused connection (nothing left the machine) are not billed and
    are retried by default; a 400 is billed and never sent again."""
    url, script, log = scripted_server
    script.write_text(json.dumps(["status:429", "ok"]))
    judge = _scripted_judge(url, tmp_path, max_attempts=2)
    media, prompts, metadata = S.group(34)
    before = len(_lines(log))
    assert torch.allclose(judge(media, prompts, metadata), _brightness(media), atol=0.01)
    assert [(a["outcome"], a["billed"], a["http_status"]) for a in judge.ledger.attempts()] == [
        ("http_error", 0, 429), ("answered", 1, None)]
    assert judge.ledger.billed() == 1 and len(_lines(log)) - before == 2
    script.write_text(json.dumps(["status:400"]))
    assert torch.isnan(judge(*S.group(36))).all()
    assert torch.isnan(judge(*S.group(36))).all() and judge.pop_metrics()["requests_sent"] == 3  # 429, ok, 400
    assert "HTTP 400" in judge.ledger.failures()[0]["error"]
    refused = VLMJudge(model="scripted", base_url="http://127.0.0.1:9/v1", api_key_env=None,
                       ledger=tmp_path / "refused.db", frames=1, max_side=32, max_attempts=2, retry_backoff_s=0.01)
    assert torch.isnan(refused(media, prompts, metadata)).all()
    outcomes = [(a["outcome"], a["billed"]) for a in refused.ledger.attempts()]
    assert outcomes == [("connection_error", 0)] * 2 and refused.ledger.billed() == 0  # nothing left the machine


def test_the_budget_stops_a_step_before_it_is_exceeded(scripted_server, tmp_path):
    url, script, log = scripted_server
    script.write_text("[]")
    judge = _scripted_judge(url, tmp_path, max_billed=3)
    judge.score_groups([S.group(50), S.group(51)])
    before = len(_lines(log))
    with pytest.raises(BudgetExhausted, match="cannot pay for 2 more groups"):
        judge.score_groups([S.group(52), S.group(53)])  # 2 to send, 1 left: nothing is sent
    assert len(_lines(log)) == before and judge.ledger.billed() == 2
    judge.score_groups([S.group(50), S.group(52)])  # 1 served from the ledger, 1 sent: within the budget
    assert judge.ledger.billed() == 3 and len(_lines(log)) == before + 1


def test_example_images_reach_the_server_in_their_own_slot(scorer_server, tmp_path):
    """The server's own request log names the example images it received under ``examples`` (apart from the
    condition, the reference and the candidates), the same frames the client's ledger recorded as sent."""
    from PIL import Image

    url, log = scorer_server
    for i, colour in enumerate([(250, 10, 10), (10, 10, 250)]):
        Image.new("RGB", (8, 8), colour).save(tmp_path / f"sprite{i}.png")
    judge = VLMJudge(model="brightness", base_url=url + "/v1", api_key_env=S.TOKEN_ENV, ledger=tmp_path / "l.db",
                     frames=1, max_side=32, max_concurrency=1, reference_root=tmp_path,
                     template=Path(P.DEFAULT_TEMPLATE).with_name("group_v3.txt"))
    media, prompts, metadata = S.group(80)
    metadata = [{**m, "examples": ["sprite0.png", "sprite1.png"]} for m in metadata]
    assert torch.allclose(judge(media, prompts, metadata), _brightness(media), atol=0.01)
    received = read_request_log(log)[-1]
    sent = judge.ledger.get(judge.ledger.keys()[0]).request
    assert received["examples"] == [e["sha256"] for e in sent["examples"]] and len(received["examples"]) == 2
    assert received["condition"] == [] and received["reference"] == [] and len(received["candidates"]) == 4


# ------------------------------------------------------------------------------------------------ HF VLM backend

def test_tiny_qwen2_vl_backend_answers_an_openai_client_request_with_images(token_file, tmp_path):
    import openai

    model_dir = S.save_tiny_qwen2_vl(tmp_path / "tiny-qwen2-vl")
    proc, url = S.start(["-m", "flowforge.cli", "serve", "judge", "--model", str(model_dir), "--port", "0",
                         "--token-file", str(token_file), "--num-threads", "1", "--max-new-tokens", "16"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-qwen2-vl"]
        images = [P.data_url(P.jpeg_bytes(torch.rand(3, 16, 24), 64)) for _ in range(2)]
        content = [{"type": "text", "text": "describe the image"},
                   *({"type": "image_url", "image_url": {"url": u}} for u in images)]
        reply = client.chat.completions.create(model="tiny-qwen2-vl", max_tokens=6, temperature=0, seed=1,
                                               messages=[{"role": "user", "content": content}])
        assert reply.object == "chat.completion" and reply.model == "tiny-qwen2-vl" and len(reply.choices) == 1
        assert reply.choices[0].message.role == "assistant" and isinstance(reply.choices[0].message.content, str)
        usage = reply.usage
        # two 16x24 images at patch 4, merge 1 -> 2 x 24 image tokens in the prompt
        assert usage.prompt_tokens > 48 and 1 <= usage.completion_tokens <= 6
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        S.stop(proc)


def test_cli_refuses_no_auth_off_loopback_and_two_backends():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(S.ROOT)}
    base = [sys.executable, "-m", "flowforge.cli", "serve", "judge"]
    off = subprocess.run([*base, "--scorer", "digit", "--no-auth", "--host", "0.0.0.0", "--port", "0"], cwd=S.ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert off.returncode == 2 and "non-loopback" in off.stderr
    both = subprocess.run([*base, "--scorer", "digit", "--model", "x"], cwd=S.ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
