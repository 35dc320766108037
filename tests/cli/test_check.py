"""``flowforge check``: OK or the problems, several configs at once, the resolved config only with --print."""

from pathlib import Path

from flowforge.cli import main
from flowforge.cli.check import split_configs

REPO = Path(__file__).resolve().parents[2]
GPU = sorted(str(p) for p in (REPO / "examples" / "gpu").glob("*.yaml"))


def test_configs_and_overrides_are_told_apart(tmp_path):
    named = tmp_path / "odd=name"  # an existing file is a config even with '=' in its name
    named.write_text("train: {steps: 1}\n")
    configs, overrides = split_configs(["a.yaml", str(named), "train.lr=1e-4", "b.yml", "train.steps"])
    assert configs == [Path("a.yaml"), named, Path("b.yml")] and overrides == ["train.lr=1e-4", "train.steps"]


def test_every_gpu_example_at_once(capsys):
    assert len(GPU) >= 10
    assert main(["check", "--portable", *GPU]) == 0
    out = capsys.readouterr().out.splitlines()
    notes = [line for line in out if ": audit: a random student passes " in line]  # a pipeline's audit size / power
    assert [n.split(": audit: ")[0] for n in notes] == [p for p in GPU if "stages" in Path(p).name]
    out = [line for line in out if line not in notes]
    assert out[-1] == f"OK: {len(GPU)} configs" and out[:-1] == [f"ok: {p}" for p in GPU]
    assert not any(line.startswith(("train:", "model:")) for line in out)  # no resolved config without --print


def test_one_bad_config_among_good_ones_is_named_and_counted(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {lrr: 1e-4}\n")
    good = str(REPO / "examples" / "digits" / "grpo.yaml")
    assert main(["check", good, str(bad), "train.steps=3"]) == 2
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert err[0].startswith(f"error: {bad}: ") and "unknown key 'train.lrr' (did you mean 'train.lr'?)" in err[0]
    assert err[-1] == "error: 1 of 2 configs have problems (above)" and len(err) == 2
    assert captured.out.splitlines() == [f"ok: {good}"]


def test_print_shows_the_resolved_config_with_the_overrides(capsys):
    assert main(["check", str(REPO / "examples" / "digits" / "grpo.yaml"), "train.steps=3", "--print"]) == 0
    out = capsys.readouterr().out
    assert "steps: 3" in out and out.rstrip().endswith("grpo.yaml")



def test_a_missing_prompt_file_fails_naming_the_absolute_path(tmp_path, monkeypatch, capsys):
    """A relative data.prompts that is not there: exit 2, one line naming the path tried and where relative paths
    start; under --portable (a config for another machine) only a warning."""
    config = REPO / "examples" / "digits" / "grpo.yaml"
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(config), "data.prompts=prompts/train.jsonl"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "data.prompts='prompts/train.jsonl'" in err[0]
    assert f"tried {tmp_path / 'prompts' / 'train.jsonl'}: relative paths are resolved against the working " \
           "directory" in err[0]
    assert main(["check", str(config), "--portable", "data.eval_prompts=nowhere.txt"]) == 0
    captured = capsys.readouterr()
    assert "warning: data.eval_prompts='nowhere.txt': no such file on this machine" in captured.err
    assert captured.out.splitlines() == [f"OK: {config}"]
