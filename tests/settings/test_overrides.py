"""Command-line overrides: a mapping merges into the file's, ``!{...}`` replaces it (the remote example of the rewards
guide, docs/guides/rewards.md)."""

import re
import shlex
from pathlib import Path

import pytest

from flowforge.config import ConfigError, load_config
from flowforge.train.preflight import preflight

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "examples" / "digits" / "grpo.yaml"


def readme_remote_example() -> list[str]:
    """The rewards guide's remote-reward ``flowforge train`` command line, continuation lines joined, as argv."""
    text = (REPO / "docs" / "guides" / "rewards.md").read_text()
    match = re.search(r"^flowforge train examples/digits/grpo\.yaml ['\"]reward\.weights=.*?(?<!\\)\n", text,
                      flags=re.M | re.S)
    assert match, "the rewards guide's remote-reward example not found"
    return shlex.split(match.group(0).replace("\\\n", " "))


def test_readme_remote_example_trains_on_the_remote_reward_alone():
    argv = readme_remote_example()
    assert argv[:3] == ["flowforge", "train", "examples/digits/grpo.yaml"]
    cfg = load_config(REPO / argv[2], argv[3:])
    assert cfg.reward.weights == {"remote": 1.0}  # the file's digit: 1.0 is gone
    assert cfg.reward.options["remote"]["components"] == ["digit"]
    preflight(cfg, this_machine=False)  # required components all have weights


def test_a_plain_mapping_merges_into_the_files():
    cfg = load_config(GRPO, ["reward.weights={remote: 1.0}"])
    assert cfg.reward.weights == {"digit": 1.0, "remote": 1.0}
    assert load_config(GRPO, ["reward.weights={digit: 0.5}"]).reward.weights == {"digit": 0.5}


def test_replace_a_whole_section_falls_back_to_the_defaults():
    cfg = load_config(GRPO, ["reward=!{weights: {jpeg_compressibility: 1.0}}"])
    assert cfg.reward.weights == {"jpeg_compressibility": 1.0} and cfg.reward.required == ()
    # a later key lands inside the replacement
    cfg = load_config(GRPO, ["reward.weights=!{remote: 1.0}", "reward.weights.jpeg_compressibility=0.5",
                             "reward.required=[]"])
    assert cfg.reward.weights == {"remote": 1.0, "jpeg_compressibility": 0.5}


@pytest.mark.parametrize("value, kind", [("![digit]", "list"), ("!1.0", "float"), ("!digit", "str"), ("!", "str")])
def test_replace_marker_before_a_non_mapping_is_one_problem(value, kind):
    with pytest.raises(ConfigError) as err:
        load_config(GRPO, [f"reward.weights={value}"])
    assert err.value.problems == [f"override 'reward.weights={value}': '!' (replace instead of merge) goes only "
                                  f"before a mapping '{{...}}', not a {kind}; other values always replace"]


def test_a_yaml_tag_is_not_the_replace_marker():
    assert load_config(None, ["run.name=!!str 123"]).run.name == "123"


def test_readme_remote_example_run_as_written_trains_on_the_remote_reward_alone(tiny_model_dir, encode_cache_dir,
                                                                                tmp_path, monkeypatch):
    """The rewards guide's command itself (its URL pointed at a real reward server on loopback, tiny-model overrides
    appended) trains 1 step: the only reward component is ``remote``, and the total is its mean (was: the file's
    ``digit`` too, the total twice the remote's)."""
    import json

    from flowforge.rewards.registry import build_scorer
    from tests.cli.harness import run_cli
    from tests.rewards import loopback

    argv = readme_remote_example()
    with loopback.reward_server({"digit": build_scorer("digit")}) as (url, server):
        args = [a.replace("http://127.0.0.1:8765", url) for a in argv[1:]]
        args[1] = str(REPO / args[1])
        args += [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}", "run.name=remote",
                 f"data.cache_dir={encode_cache_dir}", "data.prompts_per_step=2", "data.group_size=4",
                 "sampler.num_steps=4", "sampler.num_sde_steps=2", "train.micro_batch_size=4", "train.steps=1",
                 "eval.every=0", "eval.max_prompts=2", "eval.samples_per_prompt=2", "checkpoint.every=0",
                 "--no-progress"]
        rc, _, err = run_cli(args, tmp_path, env={"FLOWFORGE_REWARD_TOKEN": loopback.TOKEN}, in_process=True)
    assert rc == 0, err
    assert server.total >= 1  # the remote server scored the step
    row = json.loads((tmp_path / "remote" / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/digit_mean" not in row  # (digit_eval, the eval's monitor, is free and logged as before)
    assert row["reward/total_mean"] == pytest.approx(row["reward/remote_mean"])
