"""The name -> factory registry (:mod:`flowforge.rewards.registry`) and the package-level re-exports."""

import pytest

import flowforge.rewards
from flowforge.rewards.base import RewardScorer
from flowforge.rewards.registry import SCORERS, build_scorer


def test_registry_builds_every_scorer_and_lists_names_on_error():
    builtin = ("digit", "digit_eval", "jpeg_compressibility", "jpeg_incompressibility")
    assert set(SCORERS) >= set(builtin)
    for name in builtin:
        scorer = build_scorer(name)
        assert isinstance(scorer, RewardScorer)
        assert scorer.name == name and scorer.needs_group is False
    assert build_scorer("jpeg_compressibility", quality=50).quality == 50
    with pytest.raises(ValueError, match="allowed names.*digit.*jpeg_compressibility.*jpeg_incompressibility"):
        build_scorer("clip")


def test_every_registered_name_is_the_scorers_own_name():
    # metrics and config keys use the registry name; a factory whose ``name`` differs would log under another key
    per_sample = {"digit", "digit_eval", "jpeg_compressibility", "jpeg_incompressibility", "pickscore", "clip_score",
                  "aesthetic", "hps"}
    assert set(SCORERS) >= per_sample
    for name, factory in SCORERS.items():
        assert factory.name == name, (name, factory)
        assert isinstance(factory.needs_group, bool)
    assert all(SCORERS[name].needs_group is False for name in per_sample)


def test_package_reexports_the_registry():
    assert flowforge.rewards.SCORERS is SCORERS
    assert flowforge.rewards.build_scorer is build_scorer
    with pytest.raises(TypeError):
        build_scorer("jpeg_compressibility", qualty=50)  # a misspelt option is the factory's own error


SERVER = "base_url: 'http://127.0.0.1:9/v1', model: m"  # the discard port: nothing is sent, nothing loads
BAD_OPTIONS = [  # (scorer, its options in YAML, what the one line must say)
    ("vqa_score", f"{{{SERVER}, top_logprob: 5}}",
     "reward.options.vqa_score: unknown option ['top_logprob']; allowed: ['question_template', 'answer', "
     "'top_logprobs',"),
    ("vqa_score", f"{{{SERVER}, path: /nowhere}}",
     "reward.options.vqa_score: vqa_score needs exactly one of the options path (a local model directory) and "
     "base_url"),
    ("vqa_score", "{path: /nowhere, top_logprobs: 5}",
     "reward.options.vqa_score: unknown option ['top_logprobs']; allowed: ['path', 'question_template', 'answer', "
     "'device', 'dtype']"),
    ("edit_score", f"{{{SERVER}, scor_range: 25}}",
     "reward.options.edit_score: unknown option ['scor_range']; allowed: ['score_range', 'top_p',"),
    ("edit_score", f"{{{SERVER}, max_concurency: 2}}", "unknown option ['max_concurency']; allowed: ["),
]


@pytest.mark.parametrize(("name", "options", "message"), BAD_OPTIONS, ids=[f"{n}:{o}" for n, o, _ in BAD_OPTIONS])
def test_pointwise_scorers_unknown_or_conflicting_options_are_one_line_from_check(tmp_path, name, options, message):
    """``vqa_score`` and ``edit_score`` take their options on to another class (``**options``); the registry checks
    them against the signature of the class that will be built (``flowforge check``: one line, exit 2, nothing
    loaded). Found in review: a misspelt option, or both ``path`` and ``base_url``, passed the check."""
    import yaml

    from flowforge.rewards.registry import check_scorer_spec
    from tests.cli.harness import EXAMPLE, assert_one_line_error, run_cli

    problems = check_scorer_spec(name, yaml.safe_load(options))
    assert len(problems) == 1 and message in problems[0], problems
    rc, _, err = run_cli(["check", EXAMPLE, f"reward.weights=!{{{name}: 1.0}}", "reward.required=[]",
                          f"reward.options={{{name}: {options}}}"], tmp_path, in_process=True)
    assert_one_line_error(rc, err, ["(1 problem)", message])


def test_pointwise_scorers_good_options_pass_the_check():
    from flowforge.rewards.registry import check_scorer_spec

    server = {"base_url": "http://127.0.0.1:9/v1", "model": "m"}
    assert check_scorer_spec("vqa_score", {**server, "top_logprobs": 5, "max_concurrency": 2}) == []
    assert check_scorer_spec("vqa_score", {"path": "/nowhere", "dtype": "bfloat16"}) == []
    assert check_scorer_spec("edit_score", {**server, "score_range": 10, "retry_on": ["429"]}) == []
    assert check_scorer_spec("edit_score", {**server, "score_range": "10"}) == [
        "reward.options.edit_score.score_range: expected int, got a string '10' (quoted); write 10"]
