"""Your own reward through the command line: a plain function in a module next to the config, run from another
folder (the console script does not put the working directory on sys.path; flowforge adds it and the config's
folder), and the shipped example (examples/digits/own_reward.yaml + my_rewards.py) passes check from anywhere."""

import json
import sys
from pathlib import Path

from flowforge.cli import main

REPO = Path(__file__).resolve().parents[2]

MODULE = '''
import torch


def ink(media, prompts, metadata):
    """[B, 3, H, W] in [0, 1] -> [B] fraction of bright pixels, as a list (what TRL reward functions return)."""
    return [float((m.mean(dim=0) > 0.5).float().mean()) for m in media]
'''


def test_a_plain_function_next_to_the_config_trains_one_step_from_another_folder(
        tmp_path, monkeypatch, tiny_model_dir, encode_cache_dir, capsys):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "my_rewards.py").write_text(MODULE)
    (project / "cfg.yaml").write_text("reward:\n  weights: {digit: 1.0}\n  required: [digit]\n")
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(elsewhere))])
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    rc = main(["train", str(project / "cfg.yaml"), "--no-progress", 'reward.weights=!{"my_rewards:ink": 1.0}',
               "reward.required=[]", f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'runs'}",
               "run.name=own", f"data.cache_dir={encode_cache_dir}", "data.prompts_per_step=2", "data.group_size=2",
               "sampler.num_steps=3", "sampler.num_sde_steps=1", "train.micro_batch_size=2", "train.steps=1",
               "eval.every=0", "eval.max_prompts=2", "eval.scorers=[]", "checkpoint.every=0"])
    assert rc == 0, capsys.readouterr().err
    (row,) = [json.loads(line) for line in (tmp_path / "runs" / "own" / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= row["reward/my_rewards:ink_mean"] <= 1.0
    assert row["reward/total_mean"] == row["reward/my_rewards:ink_mean"]  # the only component: replaced, not merged
    assert "reward/digit_mean" not in row


def test_the_shipped_example_checks_from_any_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    example = REPO / "examples" / "digits" / "own_reward.yaml"
    assert main(["check", str(example)]) == 0, capsys.readouterr().err
    import my_rewards
    import torch

    media = torch.zeros(2, 3, 32, 32)
    media[0, :, :8] = 1.0  # a quarter of the pixels are ink: beyond the target, full score
    assert torch.equal(my_rewards.ink(media, ["a", "b"], [{}, {}]), torch.tensor([1.0, 0.0]))
