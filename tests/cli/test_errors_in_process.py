"""The command line's failure rule checked in process (:func:`flowforge.cli.main` called directly, a verb's ``run``
replaced): internal errors are one line with exit 1 (``--debug`` re-raises), user errors one line ``what: why; fix``
with exit 2; and the one-line assertion of :mod:`tests.cli.harness` itself rejects what it should."""

import pytest

from tests.cli.harness import EXAMPLE, assert_one_line_error


def test_the_one_line_rule_admits_only_progress_lines_before_the_error():
    assert_one_line_error(2, "INFO flowforge: loading model m (sd3) ...\nerror: bad m\n", ["m"])
    for stderr in ("WARNING flowforge: odd\nerror: bad\n", "error: one\nerror: two\n", "INFO httpx: GET\nerror: x\n",
                   "error: bad\nINFO flowforge: after\n", "Traceback (most recent call last):\nerror: x\n", ""):
        with pytest.raises(AssertionError):
            assert_one_line_error(2, stderr)


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
