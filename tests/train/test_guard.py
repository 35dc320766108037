"""Reward-hacking guard: the rule on recorded curves, its preflight rules, and a tiny run on a deliberately
exploitable reward (brightness) judged by the independent digit classifier, stopped and rolled back."""

import json
import math
import pathlib

import pytest
import torch

from flowforge.config import load_config
from flowforge.train.guard import detect_reward_hacking, guard_problems, slope
from flowforge.train.preflight import PreflightError, preflight

# The main job's measured curve (README: DigitEval at steps 0..150, every 10) with its rising training reward: a
# plateau with noise, never three falls in a row.
MAIN_JOB = [0.54, 0.65, 0.73, 0.76, 0.82, 0.86, 0.87, 0.86, 0.88, 0.87, 0.89, 0.88, 0.89, 0.88, 0.90, 0.89]


def _curves(judge, reward_start=0.4, reward_per_step=0.003, every=10):
    evals = [(k * every, v) for k, v in enumerate(judge)]
    rewards = [(s, reward_start + reward_per_step * s) for s in range(1, every * (len(judge) - 1) + 1)]
    return evals, rewards


def _first_trigger(judge, rewards_per_step=0.003, **kw):
    evals, rewards = _curves(judge, reward_per_step=rewards_per_step)
    for k in range(1, len(evals) + 1):
        seen = [r for r in rewards if r[0] <= evals[k - 1][0]]
        verdict = detect_reward_hacking(evals[:k], seen, **kw)
        if verdict is not None:
            return evals[k - 1][0], verdict
    return None


def test_guard_rule_on_recorded_curves():
    assert _first_trigger(MAIN_JOB, patience=3) is None
    assert _first_trigger(MAIN_JOB, patience=1) == (70, _first_trigger(MAIN_JOB, patience=1)[1])  # 0.87 -> 0.86
    hacked = [0.54, 0.70, 0.82, 0.88, 0.86, 0.83, 0.80, 0.78]
    step, verdict = _first_trigger(hacked, patience=3)
    assert step == 60 and [v for _, v in verdict.judge] == [0.88, 0.86, 0.83, 0.80]
    assert verdict.reward_slope == pytest.approx(0.003)
    assert "fell at 3 consecutive evaluations" in verdict.describe("eval/digit_eval", "reward/total_mean")
    assert _first_trigger(hacked, patience=4)[0] == 70
    assert _first_trigger(hacked, patience=5) is None
    # the same falls with a falling or flat training reward are not reward hacking
    assert _first_trigger(hacked, rewards_per_step=-0.003, patience=3) is None
    assert _first_trigger(hacked, rewards_per_step=0.0, patience=3) is None
    # falls smaller than min_delta do not count
    assert _first_trigger([0.9, 0.895, 0.89, 0.885], patience=3, min_delta=0.01) is None
    assert _first_trigger([0.9, 0.895, 0.89, 0.885], patience=3)[0] == 30
    # a NaN judge breaks the run of falls
    assert _first_trigger([0.9, 0.8, math.nan, 0.7, 0.6], patience=3) is None


def test_guard_rule_errors_and_slope():
    assert slope([(1, 1.0), (2, 3.0), (3, 5.0)]) == pytest.approx(2.0)
    assert math.isnan(slope([(1, 1.0)])) and math.isnan(slope([(1, 1.0), (2, math.nan)]))
    with pytest.raises(ValueError, match="patience must be >= 1"):
        detect_reward_hacking([], [], patience=0)


def test_guard_preflight_rules():
    base = ["guard.patience=2", "eval.scorers=[digit_eval]", "eval.every=5"]
    assert guard_problems(load_config(None, base)) == ([], [])
    assert guard_problems(load_config(None, ["eval.every=0"])) == ([], [])  # off: nothing to check
    problems, _ = guard_problems(load_config(None, [*base, "eval.every=0"]))
    assert problems == ["guard.patience=2 needs periodic held-out evaluations: set eval.every > 0"]
    problems, _ = guard_problems(load_config(None, ["guard.patience=2", "eval.every=5"]))
    assert "needs a held-out judge" in problems[0]
    problems, _ = guard_problems(load_config(None, [*base, "guard.judge=eval/pickscore"]))
    assert problems[0].startswith("guard.judge='eval/pickscore' is not logged by the evaluation; allowed: [")
    problems, _ = guard_problems(load_config(None, [*base, "guard.reward=reward/digit_mean_typo"]))
    assert problems == ["guard.reward='reward/digit_mean_typo' is not a logged training reward; allowed: "
                        "['reward/digit_mean', 'reward/total_mean']"]
    _, warnings = guard_problems(load_config(None, [*base, "guard.judge=eval/digit"]))
    assert "is a training reward component" in warnings[0]
    with pytest.raises(PreflightError, match="needs periodic held-out evaluations"):
        preflight(load_config(None, [*base, "eval.every=0"]), this_machine=False)
    with pytest.raises(ValueError, match=r"guard.action='undo' is not one of \['stop', 'rollback'\]"):
        load_config(None, ["guard.action=undo"])
    with pytest.raises(ValueError, match="guard.judge='digit_eval' must name an eval metric"):
        load_config(None, ["guard.judge=digit_eval"])


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]

def _hack_cfg(tmp_path, action, *extra):
    """The embedded default on the exploitable brightness reward, judged by DigitEval every 2 steps, guard p=2."""
    return load_config(None, [
        "run.name=hack", f"run.output_dir={tmp_path}", "model.path=demo:base", "lora.trainable=full",
        "data.prompts_per_step=2", "data.group_size=4", "sampler.num_steps=6", "sampler.num_sde_steps=2",
        "sampler.sde_window=[0.0, 0.6]", "reward.weights={tests.rewards.byo_scorers:Brightness: 1.0}",
        "train.steps=16", "train.lr=3e-4", "train.micro_batch_size=4", "grpo.clip_low=1e-2", "eval.every=2",
        "eval.samples_per_prompt=2", "eval.max_prompts=30", "eval.scorers=[digit_eval]", "metrics.trackers=[jsonl]",
        "guard.patience=2", f"guard.action={action}", *extra])


def _base_weights():
    from flowforge.demo.paths import resolve_demo_path
    from flowforge.models import build_adapter

    return build_adapter("sd3", resolve_demo_path("demo:base")).transformer.float().state_dict()


@pytest.mark.parametrize("action", ["rollback", "stop"])
def test_guard_stops_a_run_exploiting_its_reward(tmp_path, monkeypatch, action):
    """The embedded default trained on brightness (a reward the policy can raise without drawing digits), judged by
    the independent DigitEval classifier: the judge falls while the reward rises, and the guard ends the run and
    says so in the log, eval.jsonl and the report; with rollback the final weights are the best evaluation's (the
    base: measured DigitEval 0.93 -> 0.93 -> 0.85 -> 0.68 at steps 0 / 2 / 4 / 6, brightness reward 0.10 -> 0.22)."""
    from flowforge.train.trainer import Trainer

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[2]))  # tests.rewards.byo_scorers
    cfg = _hack_cfg(tmp_path, action)
    trainer = Trainer(cfg, progress=False)
    run_dir = trainer.train()
    evals = _read(run_dir / "eval.jsonl")
    stop = evals[-1]
    assert stop["eval/guard_stop"] == 1.0 and stop["eval/guard_patience"] == 2.0
    assert not any("eval/guard_stop" in e for e in evals[:-1])
    judge = [e["eval/digit_eval"] for e in evals]
    assert judge[-3] > judge[-2] > judge[-1]  # two consecutive falls of the held-out judge
    rewards = [(r["step"], r["reward/total_mean"]) for r in _read(run_dir / "metrics.jsonl")]
    assert rewards[-1][0] == stop["step"] < cfg.train.steps  # stopped early, at the evaluation that fired
    assert slope([r for r in rewards if r[0] >= evals[-3]["step"]]) > 0  # while the reward rose
    assert "reward-hacking guard: held-out eval/digit_eval fell at 2 consecutive evaluations" in \
        (run_dir / "train.log").read_text()
    report = (run_dir / "report.html").read_text()
    assert "Reward-hacking guard stopped the run at step" in report and "reward-hacking guard</th>" in report
    assert (run_dir / "checkpoints" / f"step_{int(stop['step']):06d}" / "COMMITTED").is_file()
    best_step = int(stop["eval/guard_best_step"])
    assert stop["eval/guard_best"] == max(judge) and judge[best_step // 2] == max(judge)
    assert stop["eval/guard_rolled_back"] == float(action == "rollback")
    final = trainer.policy.named_weights("live")
    assert best_step == 0  # the base was the best: rolling back restores it exactly
    base = _base_weights()
    same = all(torch.equal(final[k], base[k]) for k in base)
    assert same == (action == "rollback")


def test_a_resumed_run_rolls_back_to_the_best_evaluation_before_the_resume(tmp_path, monkeypatch):
    """The same run interrupted after step 4 (its best evaluation, the base at step 0, lies before the resume) and
    resumed: the guard reads the best step's weights back from guard_best.safetensors and the stop at step 6 rolls
    back to them exactly."""
    from flowforge.runtime.run_dir import GUARD_BEST_FILE
    from flowforge.train.trainer import Trainer

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[2]))  # tests.rewards.byo_scorers
    Trainer(_hack_cfg(tmp_path, "rollback", "checkpoint.every=2"), progress=False).train(stop_at=4)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hack" / GUARD_BEST_FILE), framework="pt") as f:
        assert f.metadata()["step"] == "0"
    trainer = Trainer(_hack_cfg(tmp_path, "rollback", "checkpoint.every=2", "train.resume=auto"), progress=False)
    run_dir = trainer.train()
    stop = _read(run_dir / "eval.jsonl")[-1]
    assert stop["step"] == 6 and stop["eval/guard_stop"] == 1.0  # the fall logged before the resume counted
    assert stop["eval/guard_best_step"] == 0.0 and stop["eval/guard_rolled_back"] == 1.0
    final, base = trainer.policy.named_weights("live"), _base_weights()
    assert all(torch.equal(final[k], base[k]) for k in base)


@pytest.mark.parametrize("saved_step", [None, 2, 6, "torn"])
def test_a_resumed_guard_reads_the_curves_logged_before_the_resume(tmp_path, caplog, saved_step):
    """After train.resume the guard continues from eval.jsonl / metrics.jsonl: the falls logged before the resume
    count (rows past the resumed step, left by the killed run, do not). The rollback target is the best logged
    evaluation (step 2) when guard_best.safetensors holds that step; when the file is missing or holds another step
    (a later best of the killed run) or is unreadable, the log says so and the target is the best evaluation since
    the resume."""
    from safetensors.torch import save_file

    from flowforge.settings.sections import GuardConfig
    from flowforge.train.guard import RewardHackingGuard
    from flowforge.runtime.run_dir import GUARD_BEST_FILE

    evals = [(0, 0.70), (2, 0.80), (4, 0.75), (6, 0.10)]  # step 6: logged by the killed run after the checkpoint
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval/digit_eval": v}) + "\n"
                                                 for s, v in evals))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/total_mean": 0.1 * s}) + "\n"
                                                    for s in range(1, 7)))
    if saved_step == "torn":  # a file cut short (a crash while a copy of the run was made): logged, not raised
        (tmp_path / GUARD_BEST_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    elif saved_step is not None:
        save_file({"live/w": torch.zeros(1)}, str(tmp_path / GUARD_BEST_FILE), metadata={"step": str(saved_step)})
    guard = RewardHackingGuard(GuardConfig(patience=2, action="rollback"), "eval/digit_eval", run_dir=tmp_path)
    guard.observe_step(5, {"reward/total_mean": 0.5})  # the first step after resuming from step 4
    assert guard.judge_curve == [(0, 0.70), (2, 0.80), (4, 0.75)]
    assert [s for s, _ in guard.reward_curve] == [1, 2, 3, 4, 5]  # step 5 given, step 6 of the killed run dropped
    recovered = saved_step == 2
    assert guard.best == ((2, 0.80) if recovered else None)
    assert ("rollback target is the best evaluation from now on" in caplog.text) == (not recovered)
    guard.observe_step(6, {"reward/total_mean": 0.6})
    out = guard.observe_eval(6, {"eval/digit_eval": 0.72})
    assert out["eval/guard_stop"] == 1.0 and out["eval/guard_best_step"] == (2.0 if recovered else 6.0)
    # without the file, the best held in memory is this evaluation itself: nothing to roll back to
    assert out["eval/guard_rolled_back"] == float(recovered)
    assert "0.8000 (step 2) -> 0.7500 (step 4) -> 0.7200 (step 6)" in guard.message
    off = RewardHackingGuard(GuardConfig(), "eval/digit_eval", run_dir=tmp_path)
    assert off.observe_eval(6, {"eval/digit_eval": 0.1}) == {} and off.sync(None) is False


def test_resuming_a_run_the_guard_stopped_is_refused_unless_the_guard_is_off(tmp_path):
    """The stop is recorded in eval.jsonl; train.resume on that run is refused before anything is written (it would
    train on past the stop), and guard.patience=0 continues it deliberately."""
    from flowforge.config import load_config
    from flowforge.runtime.errors import UserError
    from flowforge.train.guard import RewardHackingGuard

    rows = [{"step": 0, "eval/digit_eval": 0.7}, {"step": 4, "eval/digit_eval": 0.5, "eval/guard_stop": 1.0}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "ev')
    before = (tmp_path / "eval.jsonl").read_bytes()
    cfg = load_config(None, ["train.resume=auto", "guard.patience=2", "guard.judge=eval/digit_eval", "eval.every=2"])
    with pytest.raises(UserError, match=r"guard stopped this run at step 4.*guard.patience=0"):
        RewardHackingGuard.from_config(cfg, tmp_path)
    assert (tmp_path / "eval.jsonl").read_bytes() == before
    RewardHackingGuard.from_config(load_config(None, ["train.resume=auto", "eval.every=2"]), tmp_path)  # guard off
    RewardHackingGuard.from_config(load_config(None, ["guard.patience=2", "guard.judge=eval/digit_eval"]), tmp_path)
