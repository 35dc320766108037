"""``reward.options.vlm_judge`` as one typed section (:class:`flowforge.rewards.judge.options.JudgeOptions`): every
bad option is one line from ``flowforge check`` naming the option and what is allowed (exit 2, before any model
loads), the keyword path and the section build the same judge, and a pipeline names ``teacher.judge``."""

import dataclasses

import pytest

from flowforge.rewards.judge.client import VLMJudge
from flowforge.rewards.judge.options import JudgeOptions
from flowforge.rewards.judge.transport import RETRY_KINDS
from flowforge.rewards.registry import build_scorer, check_scorer_spec, option_sections
from flowforge.settings.schema import ConfigError
from tests.cli.harness import EXAMPLE, PIPELINE, assert_one_line_error, run_cli

UNREACHABLE = "http://127.0.0.1:9/v1"  # the discard port: these tests never send
ENDPOINT = {"model": "m", "base_url": UNREACHABLE, "api_key_env": None}
ALLOWED = str(list(RETRY_KINDS))

BAD = [  # (option YAML, what the one line must say)
    ("model: ''", "reward.options.vlm_judge.model='' must be a non-empty model id"),
    ("base_url: ''", "reward.options.vlm_judge.base_url='' must be a non-empty API root"),
    ("api_key_env: 3", "reward.options.vlm_judge.api_key_env: expected str | None, got int 3"),
    ("timeout_s: 0", "reward.options.vlm_judge.timeout_s=0 must be a number > 0"),
    ("timeout_s: .nan", "reward.options.vlm_judge.timeout_s=nan is not a number"),
    ("max_concurrency: 0", "reward.options.vlm_judge.max_concurrency=0 must be an int >= 1"),
    ("template: [a]", "reward.options.vlm_judge.template: expected str | None, got list ['a']"),
    ("frames: 0", "reward.options.vlm_judge.frames=0 must be an int >= 1"),
    ("frames: many", "reward.options.vlm_judge.frames: expected int, got a string 'many'"),
    ("max_side: -1", "reward.options.vlm_judge.max_side=-1 must be an int >= 1"),
    ("max_attempts: 0", "reward.options.vlm_judge.max_attempts=0 must be an int >= 1"),
    ("retry_on: [timeout, nope]", f"reward.options.vlm_judge.retry_on=['timeout', 'nope']: ['nope'] not allowed; "
                                  f"give a list of {ALLOWED}"),
    ("retry_on: timeout", f"reward.options.vlm_judge.retry_on: expected tuple[str, ...], got a string 'timeout'; "
                          f"allowed: {ALLOWED}"),
    ("retry_backoff_s: -1.0", "reward.options.vlm_judge.retry_backoff_s=-1.0 must be a number >= 0"),
    ("retry_backoff_s: 1.0e9", "reward.options.vlm_judge.retry_backoff_s: expected float, got a string '1.0e9'"),
    ("seed: 0.5", "reward.options.vlm_judge.seed: expected int, got float 0.5"),
    ("temperature: -0.1", "reward.options.vlm_judge.temperature=-0.1 must be a number >= 0"),
    ("max_tokens: true", "reward.options.vlm_judge.max_tokens: expected int, got bool True"),
    ("jpeg_quality: 101", "reward.options.vlm_judge.jpeg_quality=101 must be an int from 1 to 100"),
    ("jpeg_quality: 0", "reward.options.vlm_judge.jpeg_quality=0 must be an int from 1 to 100"),
    ("reference_root: 1", "reward.options.vlm_judge.reference_root: expected str | None, got int 1"),
    ("ledger: {a: 1}", "reward.options.vlm_judge.ledger: expected str | None, got dict {'a': 1}"),
    ("max_billed: -1", "reward.options.vlm_judge.max_billed=-1 must be an int >= 0"),
    ("paid: 1", "reward.options.vlm_judge.paid: expected bool, got int 1"),
    ("framez: 2", "reward.options.vlm_judge: unknown option ['framez']; allowed: ['model', 'base_url',"),
]


def _check(more: str, cwd):
    judge = ("reward.options={vlm_judge: {model: m, base_url: 'http://127.0.0.1:1/v1', api_key_env: null, "
             f"{more}}}}}")
    return run_cli(["check", EXAMPLE, "reward.weights=!{vlm_judge: 1.0}", "reward.required=[]", judge], cwd,
                   in_process=True)


def test_every_option_has_a_bad_case():
    """The catalogue below covers every option (a new option without a bad case fails here)."""
    covered = {option.partition(":")[0] for option, _ in BAD}
    assert set(JudgeOptions.names()) <= covered, sorted(set(JudgeOptions.names()) - covered)


@pytest.mark.parametrize(("option", "message"), BAD, ids=[o for o, _ in BAD])
def test_each_bad_option_is_one_line_from_check(tmp_path, option, message):
    """``flowforge check`` (preflight, no model loaded) refuses the option in one line naming it and what is
    allowed; the same problem comes from the registry's check and from building the judge."""
    rc, _, err = _check(option, tmp_path)
    assert_one_line_error(rc, err, ["(1 problem)", message])
    import yaml

    given = {**ENDPOINT, **yaml.safe_load("{" + option + "}")}
    problems = check_scorer_spec("vlm_judge", given)
    assert len(problems) == 1 and message in problems[0]
    with pytest.raises(ConfigError, match="reward.options.vlm_judge") as caught:
        VLMJudge(**given)
    assert caught.value.problems == problems


def test_the_keyword_path_and_the_section_build_the_same_judge(tmp_path):
    """``VLMJudge(**keywords)``, ``VLMJudge(JudgeOptions)``, ``VLMJudge(mapping)`` and the registry (YAML lists,
    paths as strings) give the same settings, request key material and ledger place."""
    keywords = dict(ENDPOINT, frames=2, max_side=16, retry_on=["timeout"], ledger=tmp_path / "l.db", seed=4)
    options = JudgeOptions.from_options(keywords)
    assert options.retry_on == ("timeout",) and options.ledger == str(tmp_path / "l.db")
    judges = [VLMJudge(**keywords), VLMJudge(options), VLMJudge(keywords),
              build_scorer("vlm_judge", run_dir=tmp_path / "run", **keywords)]
    for judge in judges:
        assert judge.options == options and judge.settings == judges[0].settings
        assert judge.retry_on == {"timeout"} and judge.ledger_path == str(tmp_path / "l.db")
    assert build_scorer("vlm_judge", run_dir=tmp_path, **ENDPOINT).ledger_path == str(tmp_path / "judge" /
                                                                                       "ledger.sqlite")
    with pytest.raises(TypeError, match="not both"):
        VLMJudge(options, frames=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.frames = 3


def test_option_sections_are_declared_by_the_registry():
    assert option_sections() == [("reward.options.vlm_judge", JudgeOptions)]
    assert JudgeOptions.from_options(ENDPOINT) == JudgeOptions(**ENDPOINT)  # defaults: the former keyword defaults
    assert (JudgeOptions(**ENDPOINT).frames, JudgeOptions(**ENDPOINT).retry_on) == (24, ("refused", "429"))


def test_a_pipeline_names_teacher_judge_once(tmp_path):
    """A bad ``teacher.judge`` option is one problem naming ``teacher.judge.<option>`` (not one per stage under
    the stage configs' ``reward.options.vlm_judge``)."""
    rc, _, err = run_cli(["check", PIPELINE, "teacher.judge={frames: 0}"], tmp_path, in_process=True)
    assert_one_line_error(rc, err, ["(1 problem)", "teacher.judge.frames=0 must be an int >= 1"])
