"""Bring-your-own scorers by import path: built like built-ins, checked at preflight without loading models where
possible, scored by the processor under their import path; group scorers see whole groups and report how many."""

import re

import pytest
import torch

from flowforge.config import load_config
from flowforge.rewards import RewardProcessor
from flowforge.rewards.byo import is_import_spec
from flowforge.rewards.registry import build_scorer, check_scorer_spec
from flowforge.train.preflight import PreflightError, preflight

MOD = "tests.rewards.byo_scorers"


def _media(n, seed=0):
    return torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_an_import_path_builds_a_scorer_like_a_builtin():
    assert is_import_spec(f"{MOD}:Brightness") and not is_import_spec("digit")
    media = _media(4)
    for spec in (f"{MOD}:Brightness", f"{MOD}:make_brightness"):
        scorer = build_scorer(spec, scale=2.0)
        assert scorer.name == "brightness" and scorer.needs_group is False
        assert torch.equal(scorer(media, ["p"] * 4, [{}] * 4), 2.0 * media.mean(dim=(1, 2, 3)))
    spec = f"{MOD}:Brightness"
    components, metrics = RewardProcessor({spec: build_scorer(spec)}, {spec: 1.0})(media, ["p"] * 4, [{}] * 4)
    assert metrics[f"reward/{spec}_mean"] == pytest.approx(media.mean().item())
    with pytest.raises(ValueError, match="no bool attribute 'needs_group'"):
        build_scorer(f"{MOD}:NoGroupFlag")


@pytest.mark.parametrize("spec, options, message", [
    (f"{MOD}:Brightness", {"scale": 2.0}, None),
    (f"{MOD}:make_brightness", {}, None),
    ("digit", {}, None),
    ("jpeg_compressibility", {"quality": 80}, None),
    ("jpeg_compressibility", {"qualty": 80},
     "reward.options.jpeg_compressibility: unknown option \\['qualty'\\]; allowed: \\['quality'\\]"),
    ("sharpness", {}, "unknown component 'sharpness'; allowed: .*'digit'.*or an import path"),
    (f"{MOD}:Brightness", {"colour": 1}, "options \\['colour'\\] do not fit Brightness"),
    ("tests.rewards.no_such_module:X", {}, "no module 'tests.rewards.no_such_module' in the working directory "
                                          ".*put tests/rewards/no_such_module.py in one of them"),
    (f"{MOD}:Missing", {}, "has no attribute 'Missing'"),
    (f"{MOD}:NOT_CALLABLE", {}, "is a int, not a factory"),
    (f"{MOD}:not_a_scorer", {}, "no string attribute 'name'"),
    (f"{MOD}:failing_factory", {}, "the factory failed: RuntimeError: cannot load my model"),
    (f"{MOD}:NoGroupFlag", {}, "no bool attribute 'needs_group'"),
    ("not a path:x y", {}, "an import path is 'pkg.module:Factory'"),
])
def test_check_scorer_spec_lists_what_is_wrong(spec, options, message):
    problems = check_scorer_spec(spec, options)
    if message is None:
        assert problems == []
    else:
        assert len(problems) >= 1 and any(re.search(message, p) for p in problems), problems


def test_preflight_accepts_byo_components_and_lists_broken_ones():
    good = f"{MOD}:Brightness"
    cfg = load_config(None, [f"reward.weights={{'{good}': 1.0}}", f"reward.options={{'{good}': {{scale: 3}}}}",
                             f"eval.scorers=['{MOD}:make_brightness']"])
    preflight(cfg, world_size=1)
    bad = load_config(None, [f"reward.weights={{'{MOD}:Missing': 1.0, digit: 1.0}}",
                             f"eval.scorers=['{MOD}:failing_factory']"])
    with pytest.raises(PreflightError) as info:
        preflight(bad, world_size=1)
    text = str(info.value)
    assert f"reward.weights: reward component '{MOD}:Missing'" in text
    assert f"eval.scorers: reward component '{MOD}:failing_factory': the factory failed" in text


def _group_batch(sizes):
    """Interleaved members of groups with ``sizes``; metadata says each member's group, index and group size."""
    rows = [(g, k) for g, size in enumerate(sizes) for k in range(size)]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(3)).tolist()
    rows = [rows[i] for i in order]
    meta = [{"group": g, "member": k, "size": sizes[g]} for g, k in rows]
    return _media(len(rows)), ["p"] * len(rows), meta, torch.tensor([g for g, _ in rows])


def test_group_scorer_sees_whole_groups_and_metrics_count_them():
    media, prompts, meta, group_ids = _group_batch([3, 2, 4])
    scorer = build_scorer(f"{MOD}:GroupRank")
    processor = RewardProcessor({"rank": scorer}, {"rank": 1.0}, batch_size=2)  # batch_size never splits a group
    components, metrics = processor(media, prompts, meta, group_ids)
    assert len(scorer.calls) == 3 and sorted(len(c) for c in scorer.calls) == [2, 3, 4]
    assert metrics["reward/rank_groups_scored"] == 3.0
    assert metrics["reward/rank_first_fraction"] == pytest.approx(3 / 9)  # the scorer's sample_flags
    for g in range(3):
        members = group_ids == g
        expected = media[members].mean(dim=(1, 2, 3)).argsort().argsort().float()
        assert torch.equal(components["rank"][members], expected)
    assert "reward/rank_groups_scored" not in RewardProcessor({"b": build_scorer(f"{MOD}:Brightness")}, {"b": 1.0})(
        media, prompts, meta, group_ids)[1]


def test_a_dotted_path_to_a_builtin_function_is_refused():
    """Issue 24: ``os:getcwd`` names a callable that is no scorer class or factory: refused in one line, and options
    that do not fit a factory are a ValueError (exit 2), not a TypeError from inside the call."""
    from flowforge.rewards.byo import build_imported, check_import_spec, load_factory

    for spec in ("os:getcwd", "os:sep"):
        with pytest.raises(ValueError, match="not a factory \\(a scorer class, a factory function .* or a scoring "
                                             "function f\\(media, prompts, metadata\\)\\)"):
            load_factory(spec)
        assert check_import_spec(spec, {}) and "not a factory" in check_import_spec(spec, {})[0]
    with pytest.raises(ValueError, match="do not fit"):
        build_imported("tests.rewards.byo_scorers:make_brightness", {"no_such_option": 1})


def test_a_plain_scoring_function_is_told_from_a_factory_by_its_signature():
    """``f(media, prompts, metadata, **options)`` is called per batch (its list of floats made a [B] float32 tensor),
    never as a factory; a function whose required arguments the options fill is a factory; one that leaves one or
    two required arguments is refused naming both forms. Preflight never calls a scoring function."""
    from flowforge.rewards.byo import FunctionScorer, is_scoring_function, load_factory

    media = _media(4)
    scorer = build_scorer(f"{MOD}:mean_above", threshold=0.25)
    assert isinstance(scorer, FunctionScorer) and scorer.needs_group is False and scorer.name == "mean_above"
    out = scorer(media, ["p"] * 4, [{}] * 4)
    assert out.dtype == torch.float32 and out.shape == (4,)
    assert torch.equal(out, (media > 0.25).float().mean(dim=(1, 2, 3)))
    assert check_scorer_spec(f"{MOD}:mean_above", {"threshold": 0.25}) == []
    assert "do not fit mean_above" in check_scorer_spec(f"{MOD}:mean_above", {"thresh": 0.25})[0]
    assert is_scoring_function(load_factory(f"{MOD}:make_from_three"), {}) is True  # three required, none given
    three = build_scorer(f"{MOD}:make_from_three", scale=2.0, offset=0.0, power=1.0)  # options fill them: factory
    assert three.name == "brightness" and torch.equal(three(media, ["p"] * 4, [{}] * 4), 2 * media.mean((1, 2, 3)))
    problems = check_scorer_spec(f"{MOD}:two_args", {})
    assert problems == [f"reward component '{MOD}:two_args': two_args(media, prompts) leaves 2 required arguments "
                        "(media, prompts) besides the options []: give a scorer class, a factory function (no "
                        "required arguments besides the options) or a scoring function f(media, prompts, metadata)"]
    with pytest.raises(ValueError, match="returned shape \\(4, 1\\); a scoring function returns one score per "
                                         "sample: \\[4\\]"):
        build_scorer(f"{MOD}:wrong_shape")(media, ["p"] * 4, [{}] * 4)
    assert check_scorer_spec(f"{MOD}:explodes_when_called", {}) == []  # checked by signature, never called
