"""A step's scorer calls in flight together (:func:`flowforge.rewards.groups.call_many`) and streamed during the
rollout (:mod:`flowforge.rewards.stream`), against real loopback servers (flowforge's judge and reward apps under
uvicorn): the concurrency is honoured (the server records the most requests in flight), results land in canonical
order with the sequential path's scores and metrics, and a failing call is handled as sequentially (required
component -> an error naming it; otherwise NaN, counted)."""

import math

import pytest
import torch

from flowforge.rewards.judge.client import VLMJudge
from flowforge.rewards.processor import RewardProcessor
from flowforge.rewards.scorers.remote import RemoteScorer
from flowforge.rewards.stream import hidden_fraction
from tests.rewards import loopback
from tests.rewards.loopback import Brightness, groups


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv(loopback.TOKEN_ENV, loopback.TOKEN)


def _judge(url, concurrency, tmp_path, name):
    return VLMJudge(model="loopback", base_url=url, api_key_env=loopback.TOKEN_ENV, max_concurrency=concurrency,
                    frames=1, max_side=16, retry_backoff_s=0.0, timeout_s=30.0, ledger=tmp_path / f"{name}.sqlite")


def _comparable(metrics):
    """Metrics without wall-clock values (times, the judge's mean latency)."""
    return {k: v for k, v in metrics.items() if not k.endswith(("_time", "_latency_s"))}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) or (torch.isnan(a[k]).equal(torch.isnan(b[k]))
                                           and torch.equal(a[k].nan_to_num(-1), b[k].nan_to_num(-1))), k


def _stream(processor, media, prompts, metadata, ids, chunk=3):
    """Feed the batch to a score stream in row-order chunks of ``chunk`` rows, as a rollout would."""
    stream = processor.stream(prompts, metadata, ids)
    for start in range(0, len(prompts), chunk):
        rows = torch.arange(start, min(start + chunk, len(prompts)))
        stream.add(rows, media[rows])
    return stream.finish()


@pytest.mark.parametrize("concurrency", [1, 3])
def test_judge_groups_are_in_flight_together_up_to_max_concurrency(tmp_path, concurrency):
    media, prompts, metadata, ids = groups(6)
    with loopback.judge_server(parties=concurrency) as (url, server):
        processor = RewardProcessor({"vlm_judge": _judge(url, concurrency, tmp_path, "batch")}, {"vlm_judge": 1.0})
        processor(media, prompts, metadata, ids)
        assert (server.max, server.total) == (concurrency, 6)
    with loopback.judge_server(parties=concurrency) as (url, server):
        processor = RewardProcessor({"vlm_judge": _judge(url, concurrency, tmp_path, "stream")}, {"vlm_judge": 1.0})
        _stream(processor, media, prompts, metadata, ids, chunk=24)  # every group completes at once
        assert (server.max, server.total) == (concurrency, 6)


def test_concurrent_and_streamed_judge_scores_equal_the_sequential_path_in_canonical_order(tmp_path):
    media, prompts, metadata, ids = groups(5)
    with loopback.judge_server() as (url, _):
        sequential = RewardProcessor({"vlm_judge": _judge(url, 1, tmp_path, "seq")}, {"vlm_judge": 1.0})
        concurrent = RewardProcessor({"vlm_judge": _judge(url, 5, tmp_path, "con")}, {"vlm_judge": 1.0})
        streamed = RewardProcessor({"vlm_judge": _judge(url, 5, tmp_path, "str")}, {"vlm_judge": 1.0})
        seq_c, seq_m = sequential(media, prompts, metadata, ids)
        con_c, con_m = concurrent(media, prompts, metadata, ids)
        _, str_c, str_m = _stream(streamed, media, prompts, metadata, ids)
    _same(seq_c, con_c)
    _same(seq_c, str_c)
    assert _comparable(seq_m) == _comparable(con_m) == {k: v for k, v in _comparable(str_m).items()
                                                         if not k.startswith(("time/", "perf/"))}
    assert seq_m["reward/vlm_judge_requests_sent"] == 5 and seq_m["reward/vlm_judge_groups_scored"] == 5
    # canonical order: each sample's score is its own candidate's, ranked by brightness within its group
    scores = seq_c["vlm_judge"]
    for g in range(5):
        rows = torch.nonzero(ids == g).squeeze(1)
        brightness = media[rows].mean(dim=(1, 2, 3))
        assert torch.argsort(scores[rows]).tolist() == torch.argsort(brightness).tolist()


@pytest.mark.parametrize("mode", ["sequential", "concurrent", "streamed"])
def test_a_failing_judge_group_is_nan_and_counted_or_an_error_when_required(tmp_path, mode):
    media, prompts, metadata, ids = groups(4, fail=(2,))
    concurrency = 1 if mode == "sequential" else 4
    with loopback.judge_server() as (url, _):
        judge = _judge(url, concurrency, tmp_path, f"{mode}-optional")
        optional = RewardProcessor({"vlm_judge": judge}, {"vlm_judge": 1.0})
        if mode == "streamed":
            _, components, metrics = _stream(optional, media, prompts, metadata, ids)
        else:
            components, metrics = optional(media, prompts, metadata, ids)
        required = RewardProcessor({"vlm_judge": _judge(url, concurrency, tmp_path, f"{mode}-required")},
                                   {"vlm_judge": 1.0}, ["vlm_judge"])
        with pytest.raises(ValueError) as error:
            if mode == "streamed":
                _stream(required, media, prompts, metadata, ids)
            else:
                required(media, prompts, metadata, ids)
    nan = torch.isnan(components["vlm_judge"])
    assert nan.tolist() == (ids == 2).tolist()
    assert metrics["reward/vlm_judge_failures"] == 1 and metrics["reward/vlm_judge_nan_fraction"] == 0.25
    assert str(error.value).startswith("required reward component 'vlm_judge' scored NaN for sample 2 (4 of 16 samples "
                                       f"are NaN): the judge at {url}/ gave a group no scores (failed: HTTP 500: ")


@pytest.mark.parametrize("concurrency", [1, 4])
def test_remote_batches_are_in_flight_together_with_the_sequential_scores(concurrency):
    media, prompts, metadata, _ = groups(4)
    with loopback.reward_server({"brightness": Brightness()}, parties=concurrency) as (url, server):
        scorer = RemoteScorer(url, ["brightness"], token_env=loopback.TOKEN_ENV, max_concurrency=concurrency)
        components, metrics = RewardProcessor({"remote": scorer}, {"remote": 1.0}, batch_size=4)(
            media, prompts, metadata)
        assert (server.max, server.total) == (concurrency, 4)
    assert torch.equal(components["remote"], Brightness()(media, prompts, metadata))
    assert metrics["reward/remote_nan_fraction"] == 0.0


class _FailOn:
    """Hosted by the reward server: raises (HTTP 500) when a batch holds a prompt containing "FAILME"."""

    name = "fail_on"
    needs_group = False

    def __call__(self, media, prompts, metadata):
        if any("FAILME" in p for p in prompts):
            raise RuntimeError("scripted failure")
        return Brightness()(media, prompts, metadata)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_failing_remote_batch_is_nan_or_an_error_naming_the_component(concurrency):
    media, _, metadata, _ = groups(4)
    prompts = [f"prompt {i}" + (" FAILME" if 4 <= i < 8 else "") for i in range(16)]  # the second batch of 4 fails
    with loopback.reward_server({"fail_on": _FailOn()}) as (url, _):
        def make():
            return RemoteScorer(url, ["fail_on"], token_env=loopback.TOKEN_ENV, retries=0,
                                max_concurrency=concurrency)
        components, metrics = RewardProcessor({"remote": make()}, {"remote": 1.0}, batch_size=4)(
            media, prompts, metadata)
        with pytest.raises(ValueError, match=r"^required reward component 'remote' scored NaN for sample 4 "
                                             r"\(4 of 16 samples are NaN\): reward service .* HTTP 500"):
            RewardProcessor({"remote": make()}, {"remote": 1.0}, ["remote"], batch_size=4)(media, prompts, metadata)
    nan = torch.isnan(components["remote"])
    assert nan.tolist() == [4 <= i < 8 for i in range(16)] and metrics["reward/remote_nan_fraction"] == 0.25
    assert torch.equal(components["remote"][~nan], Brightness()(media, prompts, metadata)[~nan])


def test_scores_of_a_concurrent_scorer_land_in_canonical_order():
    class Slow:
        """Per-sample index as the score, later batches answered first (they sleep less)."""

        name, needs_group, max_concurrency = "slow", False, 4

        def __call__(self, media, prompts, metadata):
            import time

            first = metadata[0]["i"]
            time.sleep(0.02 * (8 - first // 2))
            return torch.tensor([float(m["i"]) for m in metadata])

    metadata = [{"i": i} for i in range(16)]
    components, _ = RewardProcessor({"slow": Slow()}, {"slow": 1.0}, batch_size=2)(
        torch.zeros(16, 3, 4, 4), [str(i) for i in range(16)], metadata)
    assert components["slow"].tolist() == [float(i) for i in range(16)]


def test_stream_refuses_media_given_twice_and_a_batch_left_incomplete():
    processor = RewardProcessor({"b": Brightness()}, {"b": 1.0})
    stream = processor.stream(["p"] * 4, [{}] * 4, torch.tensor([0, 0, 1, 1]))
    stream.add(torch.tensor([0, 1]), torch.zeros(2, 3, 4, 4))
    with pytest.raises(ValueError, match="added twice"):
        stream.add(torch.tensor([1]), torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="2 samples of the batch never got their media"):
        stream.finish()


def test_hidden_fraction_is_the_share_of_busy_time_before_the_boundary():
    assert hidden_fraction([(0.0, 2.0), (1.0, 3.0)], 2.0) == pytest.approx(2 / 3)
    assert hidden_fraction([(0.0, 1.0), (2.0, 3.0)], 2.5) == pytest.approx(0.75)
    assert hidden_fraction([(3.0, 4.0)], 2.0) == 0.0
    assert math.isnan(hidden_fraction([], 1.0))


class Probe:
    """A per-sample scorer (brightness) that records how many requests the judge server had in flight when it was
    called (once ``expect`` requests have reached the server), and raises when asked to."""

    name, needs_group = "probe", False

    def __init__(self, counter, fail: bool = False, expect: int = 0) -> None:
        self.counter, self.fail, self.expect, self.in_flight = counter, fail, expect, []

    def __call__(self, media, prompts, metadata):
        import time

        deadline = time.monotonic() + 10  # the stream's requests may still be on their way: wait for them to arrive
        while self.counter.total < self.expect and time.monotonic() < deadline:
            time.sleep(0.01)
        self.in_flight.append(self.counter.now)
        if self.fail:
            raise RuntimeError("probe failed")
        return Brightness()(media, prompts, metadata)


@pytest.fixture()
def slow_judge():
    """flowforge's judge server whose every request is held 1.5 s (InFlight never reaches 99 parties)."""
    from flowforge.serve.judge_server import build_app

    counter = loopback.InFlight(build_app(loopback.FailingFor(), loopback.TOKEN), parties=99, hold_s=1.5)
    with loopback.serve(counter) as url:
        yield url + "/v1", counter


def test_streamed_per_sample_components_are_scored_while_the_judge_is_in_flight(tmp_path, slow_judge):
    """The judge first in order, a per-sample component after it: the component is scored while the last groups'
    requests are still at the server, not after them; scores and metrics as on the sequential path."""
    url, counter = slow_judge
    media, prompts, metadata, ids = groups(2)
    probe = Probe(counter, expect=2)
    streamed = RewardProcessor({"vlm_judge": _judge(url, 2, tmp_path, "str"), "probe": probe},
                               {"vlm_judge": 1.0, "probe": 1.0})
    _, str_c, str_m = _stream(streamed, media, prompts, metadata, ids, chunk=8)
    assert probe.in_flight == [2]
    sequential = RewardProcessor({"vlm_judge": _judge(url, 1, tmp_path, "seq"), "probe": Probe(counter)},
                                 {"vlm_judge": 1.0, "probe": 1.0})
    seq_c, seq_m = sequential(media, prompts, metadata, ids)
    _same(seq_c, str_c)
    assert list(str_c) == ["vlm_judge", "probe"]
    assert _comparable(seq_m) == {k: v for k, v in _comparable(str_m).items() if not k.startswith(("time/", "perf/"))}


def test_streamed_errors_come_in_the_sequential_order(tmp_path, slow_judge):
    """A failing judge group (required) before a failing per-sample component: the judge's error, as sequentially;
    a failing per-sample component before the judge: its own error."""
    url, counter = slow_judge
    media, prompts, metadata, ids = groups(2, fail=(1,))
    judge_first = RewardProcessor({"vlm_judge": _judge(url, 2, tmp_path, "a"), "probe": Probe(counter, fail=True)},
                                  {"vlm_judge": 1.0, "probe": 1.0}, ["vlm_judge"])
    with pytest.raises(ValueError, match="required reward component 'vlm_judge' scored NaN"):
        _stream(judge_first, media, prompts, metadata, ids, chunk=8)
    probe_first = RewardProcessor({"probe": Probe(counter, fail=True), "vlm_judge": _judge(url, 2, tmp_path, "b")},
                                  {"vlm_judge": 1.0, "probe": 1.0}, ["vlm_judge"])
    with pytest.raises(RuntimeError, match="probe failed"):
        _stream(probe_first, media, prompts, metadata, ids, chunk=8)
