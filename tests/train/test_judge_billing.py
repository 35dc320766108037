"""A paid judge in plain ``flowforge train`` (issue 43 item 1, issue 42): evaluation asks ``vlm_judge`` (a paid
scorer) only for ``eval.teacher_groups`` held-out groups -- none by default -- and every billed request, training
or evaluation, is in the metrics and the report's budget line, counted against the requests flowforge's judge server
on loopback received. A spent ``max_billed``, a wrong token and an unreachable judge each end the command in one line
that says so (exit 2). Through the command line's ``main()`` on the tiny model."""

import json
import socket

import pytest

from tests.cli.harness import EXAMPLE, PROGRESS_LINE, assert_one_line_error, run_cli
from tests.rewards import loopback

EVAL_PROMPTS, SAMPLES, PROMPTS_PER_STEP, STEPS = 2, 2, 2, 1


@pytest.fixture(scope="module")
def judge():
    """flowforge's judge server on loopback, counting the POST requests it receives (``.total``)."""
    with loopback.judge_server() as (url, counter):
        yield url, counter


def _train(model, out, cache, url, *more, judge_options="", token=loopback.TOKEN):
    """``flowforge train`` of the digits example on the tiny model, judged by ``vlm_judge`` at ``url`` only (plus
    ``judge_options``, e.g. ``", max_billed: 1"``): ``STEPS`` steps of ``PROMPTS_PER_STEP`` groups, an eval of
    ``EVAL_PROMPTS`` prompts before and after."""
    options = (f"reward.options={{vlm_judge: {{model: loopback, base_url: '{url}', api_key_env: {loopback.TOKEN_ENV}, "
               f"frames: 1, max_side: 16, max_attempts: 1, retry_backoff_s: 0.0{judge_options}}}}}")
    args = ["train", EXAMPLE, f"model.path={model}", f"run.output_dir={out}", "run.name=t", f"data.cache_dir={cache}",
            f"data.prompts_per_step={PROMPTS_PER_STEP}", "data.group_size=4", "sampler.num_steps=4",
            "sampler.num_sde_steps=2", "train.micro_batch_size=4", "train.num_updates_per_batch=2", "train.lr=1e-2",
            f"train.steps={STEPS}", f"eval.max_prompts={EVAL_PROMPTS}", f"eval.samples_per_prompt={SAMPLES}",
            "eval.every=0", "eval.scorers=[digit_eval]", "checkpoint.every=0", "reward.weights={vlm_judge: 1.0}",
            "reward.required=[]", options, "--no-progress", *more]
    return run_cli(args, out, env={loopback.TOKEN_ENV: token}, in_process=True)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("teacher_groups", [0, 1])
def test_evaluation_bills_the_judge_only_for_eval_teacher_groups_and_every_billed_request_is_counted(
        tiny_model_dir, encode_cache_dir, tmp_path, judge, teacher_groups):
    """Was: every eval scored all 2 held-out groups with the judge (2 + 2 x 2 = 6 requests for 2 training ones) and
    the metrics counted only the training requests."""
    url, server = judge
    before = server.total
    rc, _, err = _train(tiny_model_dir, tmp_path, encode_cache_dir, url, f"eval.teacher_groups={teacher_groups}")
    assert rc == 0, err
    sent = server.total - before  # the server's own count
    run = tmp_path / "t"
    train_billed = int(sum(r["reward/vlm_judge_billed"] for r in _rows(run / "metrics.jsonl")))
    evals = _rows(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, STEPS]
    assert train_billed == STEPS * PROMPTS_PER_STEP
    eval_billed = int(sum(e.get("eval/billed/vlm_judge", 0) for e in evals))
    assert sent == train_billed + eval_billed  # every billed request is in the metrics
    if teacher_groups == 0:  # the free scorers only: no request, no judge score in the eval
        assert sent == train_billed
        assert all("eval/vlm_judge" not in e and "eval/billed/vlm_judge" not in e for e in evals)
    else:  # the first held-out group of each eval, billed
        assert [e["eval/billed/vlm_judge"] for e in evals] == [teacher_groups] * 2
        assert sent == train_billed + 2 * teacher_groups
        assert all(0.0 <= e["eval/vlm_judge"] <= 1.0 for e in evals)
    assert all("eval/digit_eval" in e for e in evals)
    report = (run / "report.html").read_text()
    assert (f"vlm_judge: {sent} billed requests ({train_billed} in training, {eval_billed} in evaluation)"
            in report), report[:2000]


def test_a_spent_budget_ends_train_in_one_line_naming_it_and_sends_nothing(tiny_model_dir, encode_cache_dir,
                                                                          tmp_path, judge):
    """Was: ``error: internal error: BudgetExhausted: ...`` (exit 1)."""
    url, server = judge
    before = server.total
    rc, _, err = _train(tiny_model_dir, tmp_path, encode_cache_dir, url, judge_options=", max_billed: 1")
    assert_one_line_error(rc, err, ["vlm_judge max_billed=1", "cannot pay for 2 more groups", "raise max_billed"])
    assert server.total == before


def test_a_wrong_token_ends_train_in_one_line_saying_the_judge_refused_it(tiny_model_dir, encode_cache_dir, tmp_path,
                                                                        judge):
    """Was: ``error: internal error: JudgeError: ...`` (exit 1)."""
    url, _ = judge
    rc, _, err = _train(tiny_model_dir, tmp_path, encode_cache_dir, url, token="not-the-token")
    assert_one_line_error(rc, err, ["refused the token", f"api_key_env={loopback.TOKEN_ENV}", "HTTP 401", url])


def test_an_unreachable_judge_ends_train_saying_so_not_blaming_nan_rewards(tiny_model_dir, encode_cache_dir,
                                                                          tmp_path):
    """Was: ``error: component 'vlm_judge' (weight 1.0) has NaN/inf rewards in group id(s) [...]``."""
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    rc, _, err = _train(tiny_model_dir, tmp_path, encode_cache_dir, url)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in err, err
    last = lines[-1]
    assert last.startswith("error: reward component 'vlm_judge'") and "is unreachable" in last and url in last, last
    assert "check vlm_judge base_url" in last
    # before it: progress lines and the judge's own line for each group it could not score
    assert all(PROGRESS_LINE.match(line) or "vlm_judge: request" in line for line in lines[:-1]), err


def test_a_paid_scorer_only_in_eval_scorers_needs_eval_teacher_groups():
    """Evaluation would never ask it: refused, naming eval.scorers and eval.teacher_groups."""
    from flowforge.config import load_config
    from flowforge.runtime.errors import UserError
    from flowforge.train.scorer_checks import check_paid_scorers

    paid = type("Paid", (), {"paid": True})()
    cfg = load_config(None, ["eval.scorers=[judge]"])
    with pytest.raises(UserError, match=r"eval.scorers: \['judge'\] are paid scorers .* eval.teacher_groups=0"):
        check_paid_scorers({"judge": paid}, cfg.eval, {"digit": 1.0})
    check_paid_scorers({"judge": paid}, load_config(None, ["eval.scorers=[judge]", "eval.teacher_groups=1"]).eval,
                       {"digit": 1.0})
    check_paid_scorers({"judge": paid}, cfg.eval, {"judge": 1.0})  # a training reward: scored in training
