"""Running the command line in tests: :func:`run_cli` (a subprocess, or in process with the same observable
result) and the assertions of the one-line error rule (:func:`assert_one_line_error`) and of argparse misuse."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "digits" / "grpo.yaml")
PIPELINE = str(REPO / "examples" / "stages" / "digits.yaml")
WORLD_EXAMPLE = str(REPO / "examples" / "worldmodel" / "nft.yaml")


def run_cli(args, cwd, env=None, in_process=False):
    """Run ``python -m flowforge.cli ARGS`` in ``cwd``; returns ``(exit status, stdout, stderr)``. The child gets
    ``HF_HUB_OFFLINE=1``, ``HF_HUB_DISABLE_PROGRESS_BARS=1`` (the bars of the libraries that load models) and no
    ``FLOWFORGE_DEBUG`` unless ``env`` sets them.

    ``in_process=True`` calls :func:`flowforge.cli.main` in this process instead (no interpreter start-up, torch
    already imported: for long catalogues); an exception escaping ``main`` is returned as exit 1 with its traceback
    on stderr, exactly what the process would print. Log records go to pytest's handlers, not to the stderr text.
    """
    if in_process:
        return _run_in_process([str(a) for a in args], cwd, env or {})
    child_env = {k: v for k, v in os.environ.items() if k != "FLOWFORGE_DEBUG"}
    # no Hugging Face progress bars (transformers draws one while loading the text encoder): stderr holds only
    # what flowforge says
    child_env.update({"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})})
    proc = subprocess.run([sys.executable, "-m", "flowforge.cli", *map(str, args)], cwd=cwd, env=child_env,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def _run_in_process(args, cwd, env):
    """:func:`flowforge.cli.main` in this process, seen as a fresh process would see it: no logging handlers on the
    root logger (pytest's are set aside, so ``main``'s own ``basicConfig`` writes to the captured stderr, as it would
    to the real one), Python's default warning filters printing to that stderr, no Hugging Face progress bars (as
    ``HF_HUB_DISABLE_PROGRESS_BARS=1`` gives the child), cwd and environment as given; all restored afterwards (the
    torch thread count too)."""
    import contextlib
    import io
    import logging
    import traceback
    import warnings

    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    from flowforge.cli import main

    import torch

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd, saved_threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    bars_were_off = are_progress_bars_disabled()
    transformers_bars_on = transformers_logging.is_progress_bar_enabled()  # read from the environment at import
    os.environ.pop("FLOWFORGE_DEBUG", None)
    os.environ.update({"HF_HUB_DISABLE_PROGRESS_BARS": "1", **env})
    os.chdir(cwd)
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    disable_progress_bars()
    transformers_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.resetwarnings()  # CPython's default filters (what a child process starts with)
            for action, category in (("ignore", DeprecationWarning), ("ignore", PendingDeprecationWarning),
                                     ("ignore", ImportWarning), ("ignore", ResourceWarning)):
                warnings.simplefilter(action, category)
            warnings.showwarning = _print_warning
            try:
                rc = main(args)
            except SystemExit as exc:  # argparse
                rc = exc.code if isinstance(exc.code, int) else 1
            except Exception:  # noqa: BLE001 - what the interpreter would print for an escaping exception
                traceback.print_exc()
                rc = 1
    finally:
        torch.set_num_threads(saved_threads)  # a config's run.num_threads must not carry over to the next call
        for handler in root.handlers[:]:  # what main's basicConfig added
            root.removeHandler(handler)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        if not bars_were_off:
            enable_progress_bars()
        if transformers_bars_on:
            transformers_logging.enable_progress_bar()
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return rc, out.getvalue(), err.getvalue()


def _print_warning(message, category, filename, lineno, file=None, line=None):
    """The interpreter's own warning printer, writing to the (captured) ``sys.stderr`` of the moment."""
    import warnings

    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


PROGRESS_LINE = re.compile(r"INFO flowforge(\.[\w.]+)?: ")
"""A start-up progress line of flowforge's own logger (``INFO flowforge: loading model ...``): the only kind of line
that may precede the error (it says which stage failed); warnings, library noise and tracebacks may not."""


def assert_one_line_error(rc, stderr, must_mention=()):
    """Exit 2; stderr holds exactly one error, a single line starting ``error: ``, last, holding every string of
    ``must_mention`` (the field or file at fault); no traceback, and nothing else but flowforge's INFO progress
    lines before it (:data:`PROGRESS_LINE`)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert rc == 2, (rc, stderr)
    assert lines and lines[-1].startswith("error: "), stderr
    assert all(PROGRESS_LINE.match(line) for line in lines[:-1]), stderr
    for text in [must_mention] if isinstance(must_mention, str) else must_mention:
        assert text in lines[-1], (text, lines[-1])


def assert_usage_error(rc, stderr, must_mention=()):
    """argparse misuse: exit 2, a usage line and ``flowforge ...: error: ...`` last, no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in stderr, (rc, stderr)
    assert lines[0].startswith("usage: flowforge") and ": error: " in lines[-1], stderr
    for text in [must_mention] if isinstance(must_mention, str) else must_mention:
        assert text in lines[-1], (text, lines[-1])

