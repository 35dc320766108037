"""``vlm_judge`` on the wire, against flowforge's judge server on loopback (uvicorn, a free port): the request body
is byte for byte the one the SDK's typed call sends (the client skips the SDK's request transform), and where each
group is prepared and sent (worker threads for several groups, the calling thread for one: a streamed group pays
no thread-pool start)."""

import threading

import openai
import pytest
import torch

from flowforge.rewards.judge.client import VLMJudge
from flowforge.rewards.processor import RewardProcessor
from tests.rewards import loopback
from tests.rewards.loopback import FailingFor, groups


class Recorder:
    """ASGI middleware: keeps the raw body bytes of every POST, then passes the request on unchanged."""

    def __init__(self, app) -> None:
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        self.bodies.append(body)
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


@pytest.fixture()
def server(monkeypatch):
    from flowforge.serve.judge_server import build_app

    monkeypatch.setenv(loopback.TOKEN_ENV, loopback.TOKEN)
    recorder = Recorder(build_app(FailingFor(), loopback.TOKEN))
    with loopback.serve(recorder) as url:
        yield url + "/v1", recorder


def _judge(url, tmp_path, concurrency=4, name="ledger"):
    return VLMJudge(model="loopback", base_url=url, api_key_env=loopback.TOKEN_ENV, max_concurrency=concurrency,
                    frames=1, max_side=16, timeout_s=30.0, retry_backoff_s=0.0, ledger=tmp_path / f"{name}.sqlite")


def test_the_request_body_is_byte_identical_to_the_sdks_typed_call(server, tmp_path):
    url, recorder = server
    judge = _judge(url, tmp_path)
    media, prompts, metadata, _ = groups(1, k=4)
    scores = judge(media, prompts, metadata)
    assert not torch.isnan(scores).any() and len(recorder.bodies) == 1  # answered and parsed
    messages = [{"role": "user", "content": judge._prepare(media, prompts, metadata).content}]
    client = openai.OpenAI(base_url=url, api_key=loopback.TOKEN, max_retries=0)
    client.chat.completions.create(model="loopback", messages=messages, temperature=0.0, max_tokens=512, seed=0)
    assert len(recorder.bodies) == 2 and recorder.bodies[0] == recorder.bodies[1]
    assert b'"messages":[{"role":"user","content":[' in recorder.bodies[0]  # not the placeholder


def _threads(judge, monkeypatch):
    """Record the thread names in which the judge prepares and sends its groups."""
    seen = {"prepare": [], "ask": []}
    prepare, ask = judge._prepare, judge._ask

    def recorded(kind, fn):
        def call(*args):
            seen[kind].append(threading.current_thread().name)
            return fn(*args)
        return call

    monkeypatch.setattr(judge, "_prepare", recorded("prepare", prepare))
    monkeypatch.setattr(judge, "_ask", recorded("ask", ask))
    return seen


def test_several_groups_are_prepared_on_workers_and_one_in_the_calling_thread(server, tmp_path, monkeypatch):
    url, recorder = server
    media, prompts, metadata, ids = groups(3, k=4)
    calls = [(media[ids == g], [prompts[i] for i in torch.nonzero(ids == g).squeeze(1).tolist()],
              [metadata[i] for i in torch.nonzero(ids == g).squeeze(1).tolist()]) for g in range(3)]
    several = _judge(url, tmp_path, concurrency=3, name="several")
    seen = _threads(several, monkeypatch)
    batch = several.score_groups(calls)
    assert len(seen["prepare"]) == 3 and all(name.startswith("vlm_judge") for name in seen["prepare"])
    assert len(seen["ask"]) == 3 and all(name.startswith("vlm_judge") for name in seen["ask"])
    one = _judge(url, tmp_path, concurrency=3, name="one")
    seen = _threads(one, monkeypatch)
    singles = [one.score_groups([call])[0] for call in calls]
    me = threading.current_thread().name
    assert seen == {"prepare": [me] * 3, "ask": [me] * 3}
    assert all(torch.equal(a, b) for a, b in zip(batch, singles, strict=True))  # the same scores either way
    assert len(recorder.bodies) == 6


def test_a_bad_group_among_several_raises_its_own_error_first(server, tmp_path):
    url, recorder = server
    judge = _judge(url, tmp_path, concurrency=3)
    good = (torch.rand(4, 3, 16, 16), ["a"] * 4, [{}] * 4)
    mixed = (torch.rand(4, 3, 16, 16), ["a", "b", "a", "a"], [{}] * 4)
    flat = (torch.rand(4, 16, 16), ["c"] * 4, [{}] * 4)
    with pytest.raises(ValueError, match="one prompt's group at a time"):
        judge.score_groups([good, mixed, flat])
    assert recorder.bodies == []  # nothing is sent when a group cannot be prepared


def test_a_streamed_group_is_sent_from_the_streams_worker(server, tmp_path, monkeypatch):
    url, _ = server
    judge = _judge(url, tmp_path, concurrency=2)
    seen = _threads(judge, monkeypatch)
    media, prompts, metadata, ids = groups(2, k=4)
    stream = RewardProcessor({"vlm_judge": judge}, {"vlm_judge": 1.0}).stream(prompts, metadata, ids)
    stream.add(torch.arange(8), media)
    _, components, _ = stream.finish()
    assert not torch.isnan(components["vlm_judge"]).any()
    assert len(seen["ask"]) == 2 and all(name.startswith("stream-vlm_judge") for name in seen["ask"])
    assert sorted(seen["prepare"]) == sorted(seen["ask"])  # each group prepared where it is sent
