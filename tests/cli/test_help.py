"""Issue 43 item 8: the ``--help`` texts a new user reads first are plain text and say what they need."""

import pytest

from flowforge.cli import main


def _help(capsys, *verb: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*verb, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_is_plain_text_what_flowforge_is_and_the_verbs(capsys):
    text = _help(capsys)
    description = text.split("\n\n")[1]  # after the usage line
    assert description.startswith("flowforge post-trains diffusion / flow-matching")
    for rst in ("``", "::", "====", ":mod:", ":func:"):
        assert rst not in text, rst
    assert "flowforge train examples/digits/nft.yaml" in text
    for verb in ("train", "sft", "check", "compare", "report", "export", "sample", "serve", "data", "stages"):
        assert f"\n    {verb} " in text, verb  # each verb listed with its one-line help
    assert "exit 2" in text


def test_train_help_has_a_description_an_example_and_resume(capsys):
    text = _help(capsys, "train")
    assert "Online RL post-training" in text and "flowforge train examples/digits/nft.yaml" in text
    assert all(f"train.resume={v}" in text for v in ("auto", "must", "PATH")) and "--overwrite" in text


def test_export_form_and_report_run_dir_have_help(capsys):
    export = " ".join(_help(capsys, "export").split())  # argparse wraps lines
    assert "merged: the whole model with the trained weights folded in" in export
    assert "adapter: only what was trained" in export
    assert "run_dir the training run directory" in export
    report = " ".join(_help(capsys, "report").split())
    assert "run_dir a training run directory (runs/<run.name>, finished or not)" in report
