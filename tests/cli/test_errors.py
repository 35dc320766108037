"""Every failure of the command line is one clear line: ``error: <what>: <why>; <fix>`` on stderr, exit 2, no
traceback (``--debug`` / ``FLOWFORGE_DEBUG=1`` show it). The catalogue below is one table: a case is one line
``(args, must_mention)``; ``{placeholders}`` in the args are paths from :func:`places`, and every case checks that the
run directory it may name is byte-identical afterwards.

Add a case: append ``pytest.param([...args], ["text the error must contain"], id="short-name")`` to ``CASES``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.test_export import tree_digest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "digits" / "grpo.yaml")
NEEDS_PREFLIGHT_FIX = pytest.mark.xfail(strict=True, reason="preflight treats an unreadable prompt file as absent "
                                        "(a warning, exit 0); the preflight owner's fix for issue 11 makes this pass: "
                                        "then drop this mark")


def run_cli(args, cwd, env=None, in_process=False):
    """Run ``python -m flowforge.cli ARGS`` in ``cwd``; returns ``(exit status, stdout, stderr)``. The child gets
    ``HF_HUB_OFFLINE=1`` and no ``FLOWFORGE_DEBUG`` unless ``env`` sets it.

    ``in_process=True`` calls :func:`flowforge.cli.main` in this process instead (no interpreter start-up, torch
    already imported: for long catalogues); an exception escaping ``main`` is returned as exit 1 with its traceback
    on stderr, exactly what the process would print. Log records go to pytest's handlers, not to the stderr text.
    """
    if in_process:
        return _run_in_process([str(a) for a in args], cwd, env or {})
    child_env = {k: v for k, v in os.environ.items() if k != "FLOWFORGE_DEBUG"}
    child_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
    proc = subprocess.run([sys.executable, "-m", "flowforge.cli", *map(str, args)], cwd=cwd, env=child_env,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def _run_in_process(args, cwd, env):
    import contextlib
    import io
    import traceback

    from flowforge.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.pop("FLOWFORGE_DEBUG", None)
    os.environ.update(env)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(args)
            except SystemExit as exc:  # argparse
                rc = exc.code if isinstance(exc.code, int) else 1
            except Exception:  # noqa: BLE001 - what the interpreter would print for an escaping exception
                traceback.print_exc()
                rc = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return rc, out.getvalue(), err.getvalue()


def assert_one_line_error(rc, stderr, must_mention=()):
    """Exit 2; stderr is exactly one non-empty line, starting ``error: ``, holding every string of
    ``must_mention`` (the field or file at fault), and no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert rc == 2, (rc, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for text in [must_mention] if isinstance(must_mention, str) else must_mention:
        assert text in lines[0], (text, lines[0])


def assert_usage_error(rc, stderr, must_mention=()):
    """argparse misuse: exit 2, a usage line and ``flowforge ...: error: ...`` last, no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in stderr, (rc, stderr)
    assert lines[0].startswith("usage: flowforge") and ": error: " in lines[-1], stderr
    for text in [must_mention] if isinstance(must_mention, str) else must_mention:
        assert text in lines[-1], (text, lines[-1])


@pytest.fixture(scope="module")
def places(cli_run, tiny_model_dir, tmp_path_factory):
    """The paths the ``{placeholders}`` name: ``run`` (a LoRA run) and ``run_parent``, ``base`` (its base model),
    ``cwd`` (empty; the CLI runs here), ``example`` (examples/digits/grpo.yaml), and ``tmp``, a scratch directory
    holding bad input files (garbage / non-mapping / binary YAML, a symlink loop, a non-export directory, ...)."""
    tmp = tmp_path_factory.mktemp("cli_errors")
    (tmp / "cwd").mkdir()
    (tmp / "garbage.yaml").write_text("train: {lr: [1e-4\nmodel: :\n")
    (tmp / "list.yaml").write_text("- train\n- model\n")
    (tmp / "binary.yaml").write_bytes(b"\xff\xfe\x00garbage\x00")
    (tmp / "unknown_key.yaml").write_text("train: {lrr: 1e-4}\n")
    (tmp / "wrong_type.yaml").write_text("train: {steps: many}\n")
    (tmp / "two_problems.yaml").write_text("train: {lrr: 1e-4, steps: many}\n")
    (tmp / "config_dir.yaml").mkdir()
    (tmp / "loop.jsonl").symlink_to(tmp / "loop.jsonl")
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "precious.txt").write_text("keep")
    (tmp / "a_file").write_text("keep")
    (tmp / "not_a_run").mkdir()
    return {"run": str(cli_run), "run_parent": str(cli_run.parent), "base": str(tiny_model_dir), "tmp": str(tmp),
            "cwd": str(tmp / "cwd"), "example": EXAMPLE}


CASES = [
    # --- config files (any config verb) ---
    pytest.param(["check", "{tmp}/missing.yaml"], ["missing.yaml", "No such file"], id="config-missing"),
    pytest.param(["train", "{tmp}/missing.yaml"], ["missing.yaml"], id="train-config-missing"),
    pytest.param(["sft", "{tmp}/missing.yaml"], ["missing.yaml"], id="sft-config-missing"),
    pytest.param(["check", "{tmp}/config_dir.yaml"], ["config_dir.yaml"], id="config-is-a-directory"),
    pytest.param(["check", "{tmp}/garbage.yaml"], ["garbage.yaml", "YAML"], id="config-garbage-yaml"),
    pytest.param(["check", "{tmp}/list.yaml"], ["list.yaml", "mapping"], id="config-not-a-mapping"),
    pytest.param(["check", "{tmp}/binary.yaml"], ["binary.yaml"], id="config-binary"),
    pytest.param(["check", "{tmp}/unknown_key.yaml"], ["lrr"], id="config-unknown-key"),
    pytest.param(["check", "{tmp}/wrong_type.yaml"], ["steps"], id="config-wrong-type"),
    pytest.param(["check", "{tmp}/two_problems.yaml"], ["lrr", "steps"], id="config-two-problems-one-line"),
    pytest.param(["check", "{example}", "train.lr"], ["train.lr"], id="override-without-value"),
    pytest.param(["check", "{example}", "nosection.x=1"], ["nosection"], id="override-unknown-section"),
    pytest.param(["check", "{example}", "train.algorithm=sgd"], ["sgd"], id="preflight-unknown-algorithm"),
    pytest.param(["compare", "{tmp}/missing.yaml"], ["missing.yaml"], id="compare-file-missing"),
    pytest.param(["report", "{tmp}/no_such_run"], ["no_such_run"], id="report-missing-run"),
    # --- prompt files given as data.prompts (issue 11: "/dev/null ... gives 'does not exist'") ---
    pytest.param(["check", "{example}", "data.prompts=/dev/null"], ["/dev/null", "data.prompts"],
                 id="prompts-dev-null", marks=NEEDS_PREFLIGHT_FIX),
    pytest.param(["check", "{example}", "data.prompts={tmp}/loop.jsonl"], ["loop.jsonl", "data.prompts"],
                 id="prompts-symlink-loop", marks=NEEDS_PREFLIGHT_FIX),
    pytest.param(["check", "{example}", "data.prompts={tmp}"], ["data.prompts"], id="prompts-directory"),
    # --- export: OUT would destroy data (issue 11 reproductions) ---
    pytest.param(["export", "{run}", "{run}", "--form", "adapter", "--overwrite"], ["run directory"],
                 id="export-out-is-run"),
    pytest.param(["export", "{run}", "{run}/checkpoints", "--form", "adapter", "--overwrite"], ["run directory"],
                 id="export-out-is-checkpoints"),
    pytest.param(["export", "{run}", "{run}/checkpoints/step_000001", "--form", "merged", "--overwrite"],
                 ["run directory"], id="export-out-is-checkpoint"),
    pytest.param(["export", "{run}", "{run_parent}", "--form", "adapter", "--overwrite"], ["contains the run"],
                 id="export-out-is-run-parent"),
    pytest.param(["export", "{run}", "{base}", "--form", "merged", "--overwrite"], ["base model directory"],
                 id="export-out-is-base"),
    pytest.param(["export", "{run}", ".", "--form", "adapter", "--overwrite"], ["current working directory"],
                 id="export-out-is-cwd"),
    pytest.param(["export", "{run}", "{tmp}/foreign", "--form", "adapter", "--overwrite"],
                 ["foreign", "flowforge_export.json"], id="export-out-not-an-export"),
    pytest.param(["export", "{run}", "{tmp}/a_file", "--form", "adapter"], ["a_file", "is a file"],
                 id="export-out-is-a-file"),
    # --- export: other arguments ---
    pytest.param(["export", "{tmp}/not_a_run", "{tmp}/o1", "--form", "adapter"], ["not_a_run", "config.yaml"],
                 id="export-not-a-run"),
    pytest.param(["export", "{run}", "{tmp}/o2", "--form", "adapter", "--step", "7"], ["--step 7", "committed"],
                 id="export-step-not-committed"),
    pytest.param(["export", "{run}", "{tmp}/o3", "--form", "adapter", "--weights", "ema"], ["'ema'", "--weights"],
                 id="export-weights-absent"),
    pytest.param(["export", "{run}", "{tmp}/o4", "--form", "merged", "--base", "{tmp}/no_base"],
                 ["no_base", "--base"], id="export-base-missing"),
    pytest.param(["export", "{run}", "{tmp}/o5", "--form", "merged", "--base", "{tmp}/foreign"],
                 ["foreign", "base model"], id="export-base-wrong"),
]


@pytest.mark.parametrize(("args", "must_mention"), CASES)
def test_bad_input_is_one_line(places, args, must_mention):
    args = [a.format(**places) for a in args]
    before = tree_digest(places["run"])
    rc, _, stderr = run_cli(args, places["cwd"])
    assert_one_line_error(rc, stderr, [m.format(**places) for m in must_mention])
    assert tree_digest(places["run"]) == before


USAGE_CASES = [
    pytest.param([], ["command"], id="no-verb"),
    pytest.param(["fly"], ["fly"], id="unknown-verb"),
    pytest.param(["check"], ["config"], id="check-without-config"),
    pytest.param(["export", "{run}", "{tmp}/u1"], ["--form"], id="export-without-form"),
    pytest.param(["export", "{run}", "{tmp}/u2", "--form", "fused"], ["fused"], id="export-bad-form"),
    pytest.param(["export", "{run}", "{tmp}/u3", "--form", "adapter", "--step", "two"], ["two"],
                 id="export-step-not-int"),
    pytest.param(["export", "{run}", "{tmp}/u4", "--form", "adapter", "--weights", "best"], ["best"],
                 id="export-bad-weights"),
]


@pytest.mark.parametrize(("args", "must_mention"), USAGE_CASES)
def test_command_line_misuse_is_a_usage_error(places, args, must_mention):
    rc, _, stderr = run_cli([a.format(**places) for a in args], places["cwd"])
    assert_usage_error(rc, stderr, must_mention)


@pytest.mark.parametrize("how", ["before-verb", "after-verb", "env"])
def test_debug_shows_the_traceback(places, how):
    missing = f"{places['tmp']}/missing.yaml"
    args = {"before-verb": ["--debug", "check", missing], "after-verb": ["check", missing, "--debug"],
            "env": ["check", missing]}[how]
    rc, _, stderr = run_cli(args, places["cwd"], env={"FLOWFORGE_DEBUG": "1"} if how == "env" else None)
    assert rc == 1 and "Traceback (most recent call last)" in stderr and "ConfigError" in stderr
    assert "missing.yaml" in stderr


def test_a_good_command_still_exits_zero(places):
    rc, stdout, stderr = run_cli(["check", EXAMPLE], places["cwd"])
    assert rc == 0 and "train:" in stdout and "Traceback" not in stderr


# ------------------------------------------------------------------------------------------------ in process
def test_internal_error_is_one_line_exit_1_and_debug_raises(monkeypatch, capsys):
    from flowforge import cli

    def boom(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cli.check, "run", boom)
    monkeypatch.delenv("FLOWFORGE_DEBUG", raising=False)
    assert cli.main(["check", EXAMPLE]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: internal error: RuntimeError: boom; second line (rerun with --debug for the traceback)"
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["--debug", "check", EXAMPLE])
    monkeypatch.setenv("FLOWFORGE_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["check", EXAMPLE])


@pytest.mark.parametrize("exc", [KeyError("lora"), TypeError("bad"), AttributeError("x")])
def test_other_exceptions_are_internal_errors(monkeypatch, capsys, exc):
    from flowforge import cli

    def raise_it(args):
        raise exc

    monkeypatch.setattr(cli.check, "run", raise_it)
    monkeypatch.delenv("FLOWFORGE_DEBUG", raising=False)
    assert cli.main(["check", EXAMPLE]) == 1
    assert capsys.readouterr().err.startswith(f"error: internal error: {type(exc).__name__}")


def test_user_error_prints_what_why_fix(monkeypatch, capsys):
    from flowforge import cli
    from flowforge.runtime.errors import UserError

    def raise_it(args):
        raise UserError("lora.rank", "must be >= 1, got 0", "set lora.rank=4")

    monkeypatch.setattr(cli.check, "run", raise_it)
    monkeypatch.delenv("FLOWFORGE_DEBUG", raising=False)
    assert cli.main(["check", EXAMPLE]) == 2
    assert capsys.readouterr().err == "error: lora.rank: must be >= 1, got 0; set lora.rank=4\n"


def test_user_error_parts_pickle_and_file_error():
    import json
    import pickle

    from flowforge.runtime.errors import UserError, file_error, one_line

    e = pickle.loads(pickle.dumps(UserError("a.json", "is garbage", "restore it")))
    assert (e.what, e.why, e.fix, str(e)) == ("a.json", "is garbage", "restore it", "a.json: is garbage; restore it")
    assert isinstance(e, ValueError) and str(UserError("x", "bad")) == "x: bad"
    with pytest.raises(json.JSONDecodeError) as info:
        json.loads("}")
    assert str(file_error("t.json", info.value, "fix")) == "t.json: is not valid JSON (Expecting value at line 1 " \
                                                           "column 1); fix"
    loop = OSError(40, "Too many levels of symbolic links", "p.jsonl")
    assert str(file_error("p.jsonl", loop)) == "p.jsonl: cannot be read (Too many levels of symbolic links)"
    assert one_line("invalid config (2 problems):\n  - a\n  - b") == "invalid config (2 problems): a; b"


def test_os_error_names_its_file(monkeypatch, capsys):
    from flowforge import cli

    def raise_it(args):
        raise PermissionError(13, "Permission denied", "/root/out")

    monkeypatch.setattr(cli.check, "run", raise_it)
    monkeypatch.delenv("FLOWFORGE_DEBUG", raising=False)
    assert cli.main(["check", EXAMPLE]) == 2
    assert capsys.readouterr().err == "error: /root/out: Permission denied; check the path and its permissions\n"


@pytest.mark.parametrize("case", ["config-missing", "config-two-problems-one-line", "export-out-is-run"])
def test_in_process_harness_agrees_with_the_process(places, case):
    (param,) = [p for p in CASES if p.id == case]
    args, must_mention = param.values
    args = [a.format(**places) for a in args]
    rc, _, stderr = run_cli(args, places["cwd"], in_process=True)
    assert_one_line_error(rc, stderr, must_mention)
    assert (rc, stderr) == run_cli(args, places["cwd"])[::2]
    rc, _, stderr = run_cli(["--debug", *args], places["cwd"], in_process=True)
    assert rc == 1 and "Traceback (most recent call last)" in stderr
