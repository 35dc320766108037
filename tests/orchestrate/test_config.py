"""The pipeline config: its sections, the stage run configs made from it, and the whole-pipeline check (also
through ``flowforge check`` / ``flowforge stages``)."""

from __future__ import annotations

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
])
def test_one_bad_key_of_a_pipeline_is_one_problem(tmp_path, change, must_mention):
    """Issue 24: an unknown key in the stages section also reported 'stages.n_a=0 must be >= 1' (the section was
    rebuilt from its defaults); a value of the wrong type reported its default's problem too. One problem each."""
    from tests.cli.test_errors import assert_one_line_error, run_cli

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
