"""The ``remote`` scorer against a real ``flowforge serve reward`` subprocess: exact scores, retries with backoff,
NaN (never 0) after failed retries, errors for refused requests and required components, and a training run with
``digit`` served remotely that logs the same metrics, step by step, as the in-process run."""

import json
import socket
import time

import pytest
import torch

from flowforge.config import load_config
from flowforge.rewards import RewardProcessor
from flowforge.rewards.registry import build_scorer
from flowforge.rewards.scorers.remote import RemoteScorer, RemoteScorerError
from flowforge.train.trainer import Trainer
from tests.serve.server import reward_server

HOSTED = ("digit,jpeg_compressibility,tests.serve.scorers:Flaky,tests.serve.scorers:Slow,"
          "tests.serve.scorers:Broken,tests.serve.scorers:NotApplicable")
FLAKY, SLOW = "tests.serve.scorers:Flaky", "tests.serve.scorers:Slow"
BROKEN, NOT_APPLICABLE = "tests.serve.scorers:Broken", "tests.serve.scorers:NotApplicable"
ENV = "FF_TEST_REWARD_TOKEN"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    (root / "options.yaml").write_text(f"'{FLAKY}': {{failures: 2}}\n")
    with reward_server(HOSTED, "--options", str(root / "options.yaml"), token_dir=root) as (url, token):
        yield url, token


@pytest.fixture
def remote(server, monkeypatch):
    url, token = server
    monkeypatch.setenv(ENV, token)

    def make(components, **options):
        return RemoteScorer(url, components, token_env=ENV, **{"backoff": 0.01, **options})
    return make


def _batch(n, seed=0):
    media = torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    digits = [i % 10 for i in range(n)]
    return media, [f"the number {d}" for d in digits], [{"digit": d} for d in digits]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_digit_equals_in_process_bit_for_bit_through_the_processor(remote):
    media, prompts, meta = _batch(10)
    processor = RewardProcessor({"remote": remote(["digit"], batch_size=4), "digit": build_scorer("digit")},
                                {"remote": 1.0}, ["remote"])
    components, metrics = processor(media, prompts, meta)
    assert torch.equal(components["remote"], components["digit"])
    assert metrics["reward/remote_mean"] == metrics["reward/digit_mean"]
    assert metrics["reward/remote_nan_fraction"] == 0.0


def test_weighted_components_are_summed(remote):
    media, prompts, meta = _batch(3)
    got = remote({"digit": 2.0, "jpeg_compressibility": 0.5})(media, prompts, meta)
    digit = build_scorer("digit")(media, prompts, meta).double()
    jpeg = build_scorer("jpeg_compressibility")(media, prompts, meta).double()
    assert torch.equal(got, (2.0 * digit + 0.5 * jpeg).float())
    with pytest.raises(ValueError, match="hosts .*name the ones to use"):
        remote(None)(media, prompts, meta)


def test_server_errors_are_retried_with_backoff_until_they_pass(remote):
    media, prompts, meta = _batch(2)
    scorer = remote([FLAKY], retries=2)  # the server's Flaky fails twice (HTTP 500), then answers
    assert torch.equal(scorer(media, prompts, meta), media.mean(dim=(1, 2, 3)))
    assert scorer.failed_batches == 0


def test_failures_after_retries_are_nan_never_zero(remote, caplog):
    media, prompts, meta = _batch(2)
    broken = remote([BROKEN], retries=1)
    processor = RewardProcessor({"broken": broken, "jpeg": build_scorer("jpeg_compressibility")}, {"jpeg": 1.0})
    components, metrics = processor(media, prompts, meta)
    assert torch.isnan(components["broken"]).all() and metrics["reward/broken_nan_fraction"] == 1.0
    assert broken.failed_batches == 1 and "HTTP 500" in broken.last_error and "this scorer is broken" in caplog.text
    # a required component that fails is an error naming the cause
    required = RewardProcessor({"broken": remote([BROKEN], retries=0)}, {"broken": 1.0}, ["broken"])
    with pytest.raises(ValueError, match=r"required reward component 'broken' scored NaN.*failed after 1 attempts"):
        required(media, prompts, meta)


def test_timeouts_are_retried_then_nan(remote):
    media, prompts, meta = _batch(1)
    scorer = remote([SLOW], timeout=0.3, retries=1)
    scores = scorer(media, prompts, [{"sleep": 0.8}])
    assert torch.isnan(scores).all() and "ReadTimeout" in scorer.last_error
    assert "failed after 2 attempts" in scorer.last_error  # the timeout was retried once (no timing assertion)
    time.sleep(1.2)  # let the server finish the abandoned requests before the next test


def test_connection_errors_are_retried_then_nan(monkeypatch):
    monkeypatch.setenv(ENV, "x")
    scorer = RemoteScorer(f"http://127.0.0.1:{_closed_port()}", ["digit"], token_env=ENV, retries=2, backoff=0.01)
    scores = scorer(*_batch(3))
    assert torch.isnan(scores).all() and scorer.failed_batches == 1
    assert "ConnectError" in scorer.last_error and "after 3 attempts" in scorer.last_error


def test_not_applicable_is_nan_per_sample(remote):
    media, _, _ = _batch(2)
    scores = remote([NOT_APPLICABLE])(media, ["a", "b"], [{"score": 0.5}, {}])
    assert scores[0] == 0.5 and torch.isnan(scores[1])


def test_refused_requests_raise_with_the_servers_message(server, remote, monkeypatch):
    media, prompts, meta = _batch(2)
    with pytest.raises(RemoteScorerError, match="422: unknown components \\['pickscore'\\]"):
        remote(["pickscore"])(media, prompts, meta)
    # no metadata.digit and prompts that name no digit: the digit reward has nothing to score against
    with pytest.raises(RemoteScorerError, match="422: component 'digit' rejected the request: .*a cat"):
        remote(["digit"])(media, ["a cat", "a dog"], [{}, {}])
    monkeypatch.setenv("FF_WRONG_TOKEN", "wrong")
    with pytest.raises(RemoteScorerError, match="401: missing or wrong bearer token"):
        RemoteScorer(server[0], ["digit"], token_env="FF_WRONG_TOKEN")(media, prompts, meta)
    monkeypatch.delenv("FF_UNSET_TOKEN", raising=False)
    with pytest.raises(ValueError, match=r"\$FF_UNSET_TOKEN is unset"):
        RemoteScorer(server[0], ["digit"], token_env="FF_UNSET_TOKEN")
    with pytest.raises(ValueError, match="cannot be sent as JSON"):
        remote(["digit"])(media, prompts, [{"digit": 1, "x": object()}, {"digit": 2}])
    for bad in ({"url": "127.0.0.1:80"}, {"timeout": 0}, {"retries": -1}, {"encoding": "webp"}, {"batch_size": 0}):
        with pytest.raises(ValueError):
            RemoteScorer(**{"url": server[0], "token_env": None, **bad})


def _tiny_run(model_dir, out_dir, cache_dir, name, *extra):
    cfg = load_config(None, [
        f"model.path={model_dir}", f"run.output_dir={out_dir}", f"run.name={name}", f"data.cache_dir={cache_dir}",
        "data.prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "sampler.num_sde_steps=2",
        "train.micro_batch_size=2", "train.num_updates_per_batch=2", "train.steps=2", "train.lr=1e-3",
        "grpo.clip_low=1e-3", "eval.max_prompts=2", "eval.every=0", "eval.scorers=[]", *extra])
    run_dir = Trainer(cfg, progress=False).train()
    return ([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()],
            [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()])


def _comparable(row: dict, component: str) -> dict:
    """The row without wall-clock values, with the component's metrics renamed to ``digit``."""
    out = {}
    for key, value in row.items():
        if key.startswith(("time/", "perf/")) or key.endswith("_time"):
            continue
        out[key.replace(f"/{component}_", "/digit_").replace(f"eval/{component}", "eval/digit")] = value
    return out


def test_training_with_digit_served_remotely_logs_the_same_metrics(server, tiny_model_dir, tmp_path,
                                                                   encode_cache_dir, monkeypatch):
    url, token = server
    monkeypatch.setenv(ENV, token)
    local_rows, local_evals = _tiny_run(tiny_model_dir, tmp_path, encode_cache_dir, "local")
    remote_rows, remote_evals = _tiny_run(
        tiny_model_dir, tmp_path, encode_cache_dir, "remote", "reward.weights={remote: 1.0}",
        "reward.required=[remote]", f"reward.options={{remote: {{url: '{url}', components: [digit], "
                                    f"token_env: {ENV}}}}}")
    assert "reward/remote_mean" in remote_rows[0] and "reward/digit_mean" not in remote_rows[0]
    assert [r["step"] for r in remote_rows] == [1, 2]
    assert [_comparable(r, "remote") for r in remote_rows] == [_comparable(r, "digit") for r in local_rows]
    assert [_comparable(e, "remote") for e in remote_evals] == [_comparable(e, "digit") for e in local_evals]
