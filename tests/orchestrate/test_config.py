"""The pipeline config: its sections, the stage run configs made from it, and the whole-pipeline check (also
through ``flowforge check`` / ``flowforge stages``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from flowforge.cli import main
from flowforge.config import ConfigError
from flowforge.orchestrate.config import (JUDGE, check_pipeline, is_pipeline_file, load_pipeline, pipeline_dir,
                                          stage_config)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "stages" / "digits.yaml"
REWARD = {"weights": {JUDGE: 1.0}, "options": {JUDGE: {"model": "m", "base_url": "http://127.0.0.1:9/v1"}}}


def test_the_example_is_a_valid_pipeline():
    assert is_pipeline_file(EXAMPLE) and not is_pipeline_file(ROOT / "examples" / "digits" / "nft.yaml")
    pcfg = load_pipeline(EXAMPLE)
    assert check_pipeline(pcfg) == []
    assert pipeline_dir(pcfg) == Path("runs/digits-stages")
    assert (pcfg.stages.n_a, pcfg.student.kind, pcfg.train.algorithm) == (96, "scalar_head", "nft")


def test_stage_configs_replace_the_reward_and_set_the_pipeline_keys():
    pcfg = load_pipeline(EXAMPLE, ["stages.c_overrides=[train.lr=3.0e-5]", "audit.every=4"])
    a = stage_config(pcfg, "A", steps=24, reward=REWARD)
    c = stage_config(pcfg, "C", steps=45, reward=REWARD, resume="/x/step_000024")
    assert a.reward.weights == {JUDGE: 1.0} and a.reward.required == ()  # the default {digit: 1.0} is gone
    assert (a.run.output_dir, a.run.name, c.run.name) == ("runs/digits-stages", "A", "C")
    assert (a.train.steps, a.train.resume, c.train.steps, c.train.resume) == (24, "auto", 45, "/x/step_000024")
    assert (a.train.lr, c.train.lr) == (1e-4, 3e-5)  # the example's lr for A, the override for C only
    assert c.checkpoint.every == 4 and a.checkpoint.every == (pcfg.checkpoint.every or 1)  # A resumes near a crash
    every_3 = load_pipeline(EXAMPLE, ["checkpoint.every=3"])
    assert stage_config(every_3, "A", steps=24, reward=REWARD).checkpoint.every == 3
    with pytest.raises(ValueError, match="stage must be"):
        stage_config(pcfg, "B", steps=1, reward=REWARD)


def _bad(tmp_path, **changes) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["run"]["output_dir"] = str(tmp_path / "runs")
    for key, value in changes.items():
        section, _, field = key.partition("__")
        data.setdefault(section, {})[field] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_problem_of_a_pipeline_is_listed_at_once(tmp_path):
    path = _bad(tmp_path, stages__n_a=98, stages__extend_delta=3, teacher__scorer="no_such_scorer",
                stages__student_serving="in_process", student__kind="vlm_json", student__vlm_json={"base": "/m"},
                checkpoint__keep=1)
    with pytest.raises(ConfigError) as info:
        check_pipeline(load_pipeline(path))
    text = str(info.value)
    for expected in ("stages.n_a=98 must be a multiple", "stages.extend_delta=3 must be a multiple",
                     "teacher.scorer: unknown component 'no_such_scorer'", "needs student.kind='scalar_head'",
                     "checkpoint.keep=1 must be >= 2"):
        assert expected in text, expected
    with pytest.raises(ConfigError) as info:
        load_pipeline(_bad(tmp_path, reward__weights={"digit": 1.0}, stages__on_gate_fail="retry",
                           stages__bogus=1, teacher__judge={"base_url": "http://x"}))
    text = str(info.value)
    for expected in ("reward.weights: set by the pipeline", "stages.on_gate_fail='retry' is not one of",
                     "unknown key 'stages.bogus'", "teacher.judge sets ['base_url']"):
        assert expected in text, expected
    with pytest.raises(ConfigError, match="must not exceed the 220 conditions"):  # demo:train: 22 x 10 digits
        check_pipeline(load_pipeline(EXAMPLE, ["stages.n_a=224"]))
    with pytest.raises(ConfigError, match="cannot serve a student.scalar_head.reference=true student"):
        check_pipeline(load_pipeline(EXAMPLE, ["stages.student_serving=in_process", "student.scalar_head.clip_frames=1",
                                               "student.scalar_head.reference=true",
                                               "student.scalar_head.augment_rotate=0", "student.scalar_head.augment_scale=0",
                                               "student.scalar_head.augment_shift=0"]))


def test_check_and_stages_refuse_a_bad_pipeline_in_one_line(tmp_path, capsys):
    path = _bad(tmp_path, stages__n_a=98)
    for verb in ("check", "stages"):
        assert main([verb, str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: invalid pipeline config") and "stages.n_a=98" in err[0]
    assert not (tmp_path / "runs").exists()
    assert main(["check", str(EXAMPLE), "--print"]) == 0
    assert "stages:" in capsys.readouterr().out


@pytest.mark.parametrize(("change", "must_mention"), [
    ({"stages__n_aa": 96}, ["unknown key 'stages.n_aa'", "did you mean 'stages.n_a'"]),
    ({"teacher__scorr": "digit"}, ["unknown key 'teacher.scorr'", "did you mean 'teacher.scorer'"]),
    ({"stages__n_a": "many"}, ["stages.n_a: expected int"]),
    ({"teacher__scorer_options": {"batch_sise": 8}}, ["teacher.scorer / teacher.scorer_options:", "'batch_sise'"]),
    ({"teacher__scorer": "flowforge.orchestrate.demo:FineStrokeScorer", "teacher__scorer_options": {"legible_at": 1.5}},
     ["legible_at must be a number in (0, 1], got 1.5"]),
    ({"student__gate": {"min_spearman_above_baselines": 1.5}}, ["min_spearman_above_baselines=1.5 must be null or in"]),
    ({"teacher__scorer": "", "teacher__url": "http://127.0.0.1:9/v1", "teacher__scorer_options": {"batch_size": 8}},
     ["teacher.scorer_options applies to teacher.scorer only"]),
])
def test_one_bad_key_of_a_pipeline_is_one_problem(tmp_path, change, must_mention):
    """Issue 24: an unknown key in the stages section also reported 'stages.n_a=0 must be >= 1' (the section was
    rebuilt from its defaults); a value of the wrong type reported its default's problem too. One problem each."""
    from tests.cli.harness import assert_one_line_error, run_cli

    path = _bad(tmp_path, **change)
    for verb in ("check", "stages"):
        rc, _, err = run_cli([verb, path, "--no-progress"] if verb == "stages" else [verb, path], tmp_path,
                             in_process=True)
        assert_one_line_error(rc, err, ["(1 problem)", *must_mention])
        assert "n_a=0" not in err
    assert not (tmp_path / "runs").exists()


def test_a_missing_student_init_is_found_before_stage_a(tmp_path):
    """``student.scalar_head.init`` names a file the student starts from in stage B: one that is not there, or an
    unknown demo name, is a problem of the check (not an error after stage A has run); a portable check skips it."""
    for init, message in ((str(tmp_path / "nope.safetensors"), "no such file"),
                          ("demo:nope", "unknown demo name 'demo:nope'")):
        pcfg = load_pipeline(EXAMPLE, [f"student.scalar_head.init={init}"])
        with pytest.raises(ConfigError, match=message) as caught:
            check_pipeline(pcfg)
        assert len(caught.value.problems) == 1 and "student.scalar_head.init" in caught.value.problems[0]
        check_pipeline(pcfg, this_machine=False)


@pytest.mark.parametrize(("override", "owned"), [
    ("stages.a_overrides=[reward.options.vlm_judge.max_billed=0]", "reward.options"),  # lifted the hard budget
    ("stages.a_overrides=['reward.options={vlm_judge: {base_url: http://x/v1}}']", "reward.options"),
    ("stages.a_overrides=['reward.weights={digit: 1.0}']", "reward.weights"),
    ("stages.c_overrides=['reward.required=[vlm_judge]']", "reward.required"),
    ("stages.c_overrides=[train.resume=null]", "train.resume"),  # C silently restarted from the base policy
    ("stages.c_overrides=['train={resume: auto}']", "train.resume"),
    ("stages.c_overrides=[run.output_dir=/tmp/elsewhere]", "run.output_dir"),
    ("stages.a_overrides=[run.name=B]", "run.name"),
    ("stages.a_overrides=[data.prompts=demo:eval]", "data.prompts"),
])
def test_stage_overrides_may_not_change_what_the_pipeline_owns(tmp_path, override, owned):
    """Issue 42: an override of the teacher's options, the reward weights or train.resume passed `check` and took
    effect. Refused by load (check and stages alike) in one line naming the override, why, and what may change."""
    from tests.cli.harness import assert_one_line_error, run_cli

    path = _bad(tmp_path)
    for verb in ("check", "stages"):
        rc, _, err = run_cli([verb, path, override, "--no-progress"] if verb == "stages" else [verb, path, override],
                             tmp_path, in_process=True)
        assert_one_line_error(rc, err, [f"sets {owned}, which the pipeline owns", "an override may change",
                                        "train.lr"])
    assert not (tmp_path / "runs").exists()
    load_pipeline(path, ["stages.a_overrides=[train.lr=1e-5, reward.batch_size=8, data.cache_dir=/tmp/c]"])


def test_a_step_count_the_ledger_cannot_serve_is_a_check_error(tmp_path):
    """Issue 42: a_overrides train.steps beyond stages.n_a / M (or a C end beyond its conditions) spent the teacher's
    requests, then failed with an internal error; now a check problem with the numbers and the largest that fits."""
    for override, expected in (
            ("stages.a_overrides=[train.steps=25]", "train.steps=25 has stage A draw 25 steps x 4 conditions = 100, "
                                                    "but the condition ledger serves it stages.n_a=96; the largest "
                                                    "train.steps that fits is 24"),
            ("stages.c_overrides=[train.steps=60]", "the largest train.steps that fits is 55"),
            ("stages.a_overrides=[data.prompts_per_step=128]", "stage A gets no step: stages.n_a=96")):
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
            check_pipeline(load_pipeline(EXAMPLE, [override]))


@pytest.mark.parametrize("override", ["data.prompts_per_step=8", "train.steps=10"])
def test_stage_a_never_asks_the_ledger_for_more_than_its_budget(tmp_path, override):
    """The issue's `[data.prompts_per_step=4]` on M=2: A took budget / M steps of the override's M and ran out of
    conditions half way. The steps now count the stage's own M (and an override's train.steps caps them), so every
    step of A and C gets a full step of conditions; the stage configs carry those steps."""
    from flowforge.orchestrate.stages import a_steps, c_steps, open_ledger

    pcfg = load_pipeline(EXAMPLE, [f"run.output_dir={tmp_path}", f"stages.a_overrides=[{override}]"])
    check_pipeline(pcfg, stage="A")  # 10 steps' 40 conditions hold too few test groups for B's gate: a warning here
    ledger = open_ledger(pcfg)
    start, steps = a_steps(pcfg, ledger), c_steps(pcfg, ledger)
    assert start == (12 if "prompts" in override else 10)
    for stage, first, count in (("A", 0, start), ("C", start, steps)):
        m = 8 if stage == "A" and "prompts" in override else 4
        for step in range(first, first + count):
            assert len(ledger.take(stage, m, step=step, policy_version=0)) == m, (stage, step)
    assert stage_config(pcfg, "A", steps=start, reward=REWARD).train.steps == start


def test_audit_pool_beyond_what_stage_c_audits_is_refused_in_one_line(tmp_path):
    """Issue 42: audit.pool_groups=100000 made check simulate the null at 100,000 groups (165 s) and say OK, and no
    pooled verdict was ever reached. Bounded by the groups C's audits see (the Auditor's own rule, counted here
    step by step as a reference); large pools take the null's normal approximation."""
    from flowforge.orchestrate.plan import audited_groups
    from flowforge.orchestrate.stage_trainer import Auditor
    from tests.cli.harness import assert_one_line_error, run_cli

    rc, _, err = run_cli(["check", _bad(tmp_path), "audit.pool_groups=100000"], tmp_path, in_process=True)
    assert_one_line_error(rc, err, ["audit.pool_groups=100000 exceeds the 24 groups stage C audits", "at most 24"])
    check_pipeline(load_pipeline(EXAMPLE, ["audit.pool_groups=24"]))
    for overrides in ([], ["audit.every=3", "audit.first_groups=9"], ["stages.c_steps=5", "audit.every=0"],
                      ["stages.c_overrides=[data.prompts_per_step=2]", "audit.every=4"]):
        pcfg = load_pipeline(EXAMPLE, overrides)
        from flowforge.orchestrate.stages import a_steps, c_steps, open_ledger

        ledger = open_ledger(load_pipeline(EXAMPLE, [*overrides, f"run.output_dir={tmp_path / str(len(overrides))}"]))
        start, steps = a_steps(pcfg, ledger), c_steps(pcfg, ledger)
        m = 2 if "prompts_per_step=2" in " ".join(overrides) else 4
        during = dataclasses.replace(pcfg.audit, closing=False)  # the check counts the audits before C's end
        auditor = Auditor(None, during, first_step=start, end_step=start + steps, prompts_per_step=m,
                          run_dir=tmp_path)
        assert audited_groups(pcfg, 220)[0] == m * sum(auditor.due(s) for s in range(start, start + steps))
    # by hand for the example at 220 conditions: C runs steps 24..54; the first 8 groups (24, 25), every 7th (28, 35,
    # 42, 49); the closing window of ceil(8 / 4) = 2 steps (53, 54) is counted apart
    pcfg = load_pipeline(EXAMPLE)
    auditor = Auditor(None, pcfg.audit, first_step=24, end_step=55, prompts_per_step=4, run_dir=tmp_path)
    assert [s for s in range(24, 55) if auditor.due(s)] == [24, 25, 28, 35, 42, 49, 53, 54]
    assert audited_groups(pcfg, 220) == (24, "31 steps of 4 conditions from step 24: the first 8 groups, then every "
                                             "7th step: 24 groups, and 8 more of C's last steps for the closing "
                                             "verdict")
    notes: list[str] = []
    check_pipeline(pcfg, notes=notes)
    assert f"audit schedule: {audited_groups(pcfg, 220)[1]}" in notes  # what flowforge check prints


def test_the_null_s_normal_approximation_meets_the_permutation_draws():
    """Above SIMULATED_GROUPS groups the audit null is the normal approximation: next to the draws at the cap."""
    from flowforge.orchestrate.thresholds import SIMULATED_GROUPS, null_pass

    n = SIMULATED_GROUPS
    for rho, pairs in ((0.04, 0.0), (0.0, 0.51), (0.02, 0.505)):
        assert abs(null_pass(8, n + 1, rho, pairs) - null_pass(8, n, rho, pairs)) < 0.03, (rho, pairs)


def test_check_prints_the_audits_size_and_power_and_refuses_an_audit_a_random_student_passes(tmp_path):
    """Issue 39: the former 0.35 / 0.63 audits caught only an almost random student. check prints a verdict's size
    and power (simulated from the default mark model before stage A ran) and refuses, in one line naming the
    fields, thresholds a random student passes >= 1 % of the time or that stop a student at the gate's bar < 80 %."""
    from tests.cli.test_errors import assert_one_line_error, run_cli

    rc, out, _ = run_cli(["check", EXAMPLE], tmp_path, in_process=True)
    assert rc == 0 and ("audit: a random student passes 0.00 %; a student at the gate's bar is stopped 84.2 % (8 "
                        "groups per verdict; 2000 verdicts simulated from the default mark model") in out, out
    rc, _, err = run_cli(["check", _bad(tmp_path), "audit.min_spearman=0.1", "audit.min_pairwise_accuracy=0.55"],
                         tmp_path, in_process=True)
    assert_one_line_error(rc, err, ["a random student passes", ">= audit.max_null_pass=0.01",
                                    "audit.min_spearman=0.1", "audit.min_pairwise_accuracy=0.55"])
    rc, _, err = run_cli(["check", _bad(tmp_path), "audit.min_spearman=0.35", "audit.min_pairwise_accuracy=0.63"],
                         tmp_path, in_process=True)  # the former thresholds: the size holds, the power does not
    assert_one_line_error(rc, err, ["is stopped 6.", "< audit.min_power=0.8", "student.gate.min_spearman=0.5"])
    assert "random student passes" not in err
    # an explicit opt-out
    check_pipeline(load_pipeline(EXAMPLE, ["audit.min_spearman=0.35", "audit.min_pairwise_accuracy=0.63",
                                           "audit.min_power=0"]))
    # --portable without the prompt file: the audits need none, so they are checked all the same
    gpu = ROOT / "examples" / "gpu" / "wan21_t2v_qwen35_9b_student_stages.yaml"
    rc, out, _ = run_cli(["check", "--portable", gpu], tmp_path, in_process=True)
    assert rc == 0 and "a student at the gate's bar is stopped 83.2 %" in out, out
    rc, _, err = run_cli(["check", "--portable", gpu, "audit.min_spearman=0.35", "audit.min_pairwise_accuracy=0.62"],
                         tmp_path, in_process=True)
    assert_one_line_error(rc, err, ["is stopped 5.5 % < audit.min_power=0.8"])


def test_the_audit_simulation_uses_stage_a_s_judged_marks_once_they_exist(tmp_path):
    """With stage A's judge ledger in the pipeline directory the verdicts are simulated from its marks; marks the
    teacher cannot order at audit.tie_margin leave no verdict possible: refused."""
    import json

    from flowforge.orchestrate.thresholds import audit_design, record_audit_design
    from flowforge.rewards.judge.ledger import RequestLedger

    def ledger_with(marks):
        out = tmp_path / f"runs{len(list(tmp_path.iterdir()))}"
        path = out / "digits-stages" / "A" / "judge" / "ledger.sqlite"
        path.parent.mkdir(parents=True)
        ledger = RequestLedger(path)
        labels = [chr(65 + i) for i in range(8)]
        for g, group in enumerate(marks):
            ledger.begin(f"k{g}", model="m", template_sha256="t", request={"labels": labels})
            ledger.finish(f"k{g}", "ok", scores=dict(zip(labels, group, strict=True)), response=[])
        ledger.close()
        return load_pipeline(EXAMPLE, [f"run.output_dir={out}"])

    spread = ledger_with([[i / 7 for i in range(8)] for _ in range(16)])
    design = audit_design(spread)
    assert design["source"] == "the teacher's marks of stage A's 16 judged groups" and design["orderable"] == 1.0
    assert record_audit_design(spread, tmp_path / "C") == design  # what stage C records at its start
    assert json.loads((tmp_path / "C" / "audit_design.json").read_text())["power"] == design["power"]
    flat = ledger_with([[0.9 + 0.001 * i for i in range(8)] for _ in range(16)])  # all within tie_margin 0.01
    with pytest.raises(ConfigError, match="none of the 16 teacher mark vectors of 8 candidates has an order"):
        check_pipeline(flat)
    assert record_audit_design(flat, tmp_path / "C2") is None and not (tmp_path / "C2").exists()
    # audits under their power on A's real marks: the pipeline is under way (stage C records the design and warns),
    # so check warns instead of refusing -- a refusal here made a started pipeline impossible to resume and its
    # control arms impossible to run (found on the digits demo, seed 1: 70.3 % on A's marks, 84.2 % before A)
    weak = ["audit.min_spearman=0.35", "audit.min_pairwise_accuracy=0.63"]
    with pytest.raises(ConfigError, match="< audit.min_power=0.8"):
        check_pipeline(load_pipeline(EXAMPLE, [f"run.output_dir={tmp_path / 'none'}", *weak]))  # before A: refused
    started = load_pipeline(EXAMPLE, [f"run.output_dir={spread.run.output_dir}", *weak])
    warnings = check_pipeline(started)
    assert any("< audit.min_power=0.8" in w and "stage A has run, so this is recorded, not refused" in w
               for w in warnings), warnings


def test_check_refuses_bounded_staleness_in_the_stages_in_one_line(tiny_model_dir, encode_cache_dir, tmp_path):
    """``train.max_staleness > 0`` (with GRPO and rollout workers, which a plain run accepts) was refused only once
    stage A's model had loaded (the trainer's lookahead takes no ledger prompts); now by ``flowforge check``, once
    for the stages that set it, naming the field and the allowed value."""
    from tests.cli.harness import assert_one_line_error, run_cli
    from tests.orchestrate.support import write_pipeline

    async_run = {"train": {"algorithm": "grpo", "max_staleness": 1, "num_updates_per_batch": 2},
                 "rollout": {"engine": "workers"}}
    path = write_pipeline(tmp_path / "p.yaml", tiny_model_dir, tmp_path / "runs", encode_cache_dir, **async_run)
    rc, _, err = run_cli(["check", path], tmp_path, in_process=True)
    assert_one_line_error(rc, err, ["(1 problem)", "stage A: train.max_staleness=1, stage C: train.max_staleness=1",
                                    "allowed: train.max_staleness=0"])
    rc, _, err = run_cli(["check", path, "train.max_staleness=0", "stages.c_overrides=[train.max_staleness=2]"],
                         tmp_path, in_process=True)
    assert_one_line_error(rc, err, ["(1 problem)", "stage C: train.max_staleness=2: ", "allowed: "])
    assert "stage A: train" not in err
    # an algorithm and engine a plain run refuses staleness for: still the one line (preflight's are not repeated)
    rc, _, err = run_cli(["check", path, "train.algorithm=nft", "rollout.engine=local"], tmp_path, in_process=True)
    assert_one_line_error(rc, err, ["(1 problem)", "stage A: train.max_staleness=1, stage C: train.max_staleness=1"])
    rc, _, err = run_cli(["check", path, "train.max_staleness=0"], tmp_path, in_process=True)
    assert rc == 0, err
    assert not (tmp_path / "runs").exists()


def test_a_control_arm_is_not_refused_for_gate_or_audit_thresholds_it_never_uses():
    """``flowforge stages --arm`` checks the pipeline with ``stage="arm"``: an arm runs stage A and its own stage C,
    with no gate and no audits, so their threshold problems are warnings that say so; without --arm they refuse."""
    weak = ["student.gate.min_spearman=0.1", "student.gate.min_pairwise_accuracy=0.55"]
    with pytest.raises(ConfigError, match="student.gate: a random student passes"):
        check_pipeline(load_pipeline(EXAMPLE, weak))
    warnings = check_pipeline(load_pipeline(EXAMPLE, weak), stage="arm")
    assert any(w.startswith("not used by a control arm (no gate, no audits): student.gate: a random student passes")
               for w in warnings), warnings


def test_a_reference_student_is_checked_for_its_references_before_stage_a():
    """The world example's reference student needs every row's real future, a strip the judge sends whole and an
    init of its input channels: each found by `check`, before the teacher is paid."""
    world = EXAMPLE.parent / "world.yaml"
    check_pipeline(load_pipeline(world))  # as shipped: every row has its reference
    check_pipeline(load_pipeline(world, yaml.safe_load(world.read_text())["stages"]["quick"]))  # and --quick
    with pytest.raises(ConfigError) as info:
        check_pipeline(load_pipeline(world, ["data.eval_prompts=demo:world-eval", "teacher.judge.max_side=128",
                                             "student.scalar_head.init=demo:digit-tower"]))
    text = str(info.value)
    for expected in ("data.eval_prompts: 32 of 32 rows have no metadata.reference",
                     "teacher.judge.max_side=128 would shrink a reference strip",
                     "first convolution of 3 input channels; a reference student of clip_frames=8 takes 48"):
        assert expected in text, expected
