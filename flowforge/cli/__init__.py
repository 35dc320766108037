"""``flowforge`` command line: parse, dispatch to one module per verb, and report failures in one line.

::

    flowforge train CONFIG [section.key=value ...]   online RL post-training (the main job)
    flowforge sft CONFIG [section.key=value ...]     flow-matching supervised fine-tuning (makes the demo base)
    flowforge check CONFIG [CONFIG ...] [section.key=value ...] [--portable] [--print]
                                                     load + preflight only; OK or the problems (exit 2)
    flowforge compare FILE [section.key=value ...]   several algorithms / seeds, one budget, one plot + table
    flowforge report RUN_DIR                         (re)write RUN_DIR/report.html
    flowforge export RUN_DIR OUT --form merged|adapter [--step N] [--verify] [--base PATH] [--overwrite]
                                                     a diffusers transformer / LoRA from a run's checkpoint
    flowforge sample RUN_OR_EXPORT --prompt "..." [--num N] [--seed S] --out grid.png
                                                     images (PNG each + a labelled grid) from a run or an export
    flowforge serve reward --scorers A,B [--port N] [--token-file F | --no-auth]
                                                     reward scorers over HTTP (prints its URL when ready)
    flowforge stages CONFIG [--stage A|B|C]          teacher-judge RL -> student reward model -> student RL

Failures
--------
==================================================  ====  =========================================================
what went wrong                                     exit  stderr
==================================================  ====  =========================================================
misuse of the command line (argparse)               2     usage + ``flowforge: error: ...``
bad input: ``UserError``, ``ConfigError``,          2     one line ``error: <what>: <why>; <fix>`` (a config's
``PreflightError``, ``ExportError``, other                several problems joined by ``; ``)
``ValueError`` / ``OSError``, a safetensors or
pickle error from reading a file
``export --verify`` found a wrong export            1     one line ``error: export verification failed: ...``
anything else (a bug)                               1     one line ``error: internal error: <type>: <message> (rerun
                                                          with --debug for the traceback)``
stopped by SIGINT / SIGTERM (``train``, the RL      130 / one line ``interrupted by SIGTERM: ...``; ``train``'s
stages of ``stages``)                               143   names the last committed checkpoint and the resume
                                                          command (:mod:`flowforge.cli.train`)
==================================================  ====  =========================================================

``--debug`` (before or after the verb) or ``FLOWFORGE_DEBUG=1`` re-raises instead, so the traceback is shown.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pickle
import sys

from flowforge import __version__
from flowforge.cli import check, compare, data, export, report, sample, serve, sft, stages, train
from flowforge.runtime.errors import one_line
from flowforge.runtime.interrupt import Interrupted
from flowforge.runtime.quiet import library_progress_bars_off

VERBS = {"train": train, "sft": sft, "check": check, "compare": compare, "report": report, "export": export,
         "sample": sample, "serve": serve, "data": data, "stages": stages}
"""Verb -> its module (``add_parser(subparsers)``, ``run(args) -> exit status``), in ``--help`` order."""
DEBUG_ENV = "FLOWFORGE_DEBUG"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowforge", description=__doc__.split("\n\n")[0])
    p.add_argument("--debug", action="store_true", help=f"show tracebacks (also: {DEBUG_ENV}=1)")
    p.add_argument("--version", action="version", version=f"flowforge {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for module in VERBS.values():
        # SUPPRESS: a verb's parser leaves the attribute alone unless the flag follows the verb, so
        # `flowforge --debug VERB` is not reset to False by the sub-parser's default
        module.add_parser(sub).add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                            help=f"show tracebacks (also: {DEBUG_ENV}=1)")
    return p


def _debug_from_env() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def is_user_error(exc: BaseException) -> bool:
    """True for errors caused by the input (exit 2): ``ValueError`` (``UserError``, ``ConfigError``,
    ``ExportError``, ``json.JSONDecodeError`` included), ``OSError``, and the safetensors / pickle errors a damaged
    file raises. Everything else is a bug."""
    if isinstance(exc, (ValueError, OSError, pickle.UnpicklingError)):
        return True
    safetensors = sys.modules.get("safetensors")  # not imported: nothing can have raised its error
    return safetensors is not None and isinstance(exc, getattr(safetensors, "SafetensorError", ()))


def error_message(exc: BaseException) -> str:
    """``exc`` as one line (an ``OSError`` names its file)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        other = f" -> {exc.filename2}" if exc.filename2 is not None else ""
        return f"{exc.filename}{other}: {exc.strerror}; check the path and its permissions"
    return one_line(str(exc)) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status (table above)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides after an option (``stages CFG --no-progress run.name=x``): argparse ends a "*" positional
        if not isinstance(getattr(args, "overrides", None), list) or any(a.startswith("-") for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    args.debug = bool(getattr(args, "debug", False)) or _debug_from_env()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # one INFO line per HTTP request (judge, reward server) otherwise; httpx2 / httpcore2: the renamed httpx some
    # openai SDK releases ship (the judge client's requests log under that name)
    for noisy in ("httpx", "httpcore", "httpx2", "httpcore2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # --no-progress also means the libraries' own bars (MiniLM's "Loading weights" in every stage's log)
    bars_off = library_progress_bars_off() if getattr(args, "no_progress", False) else contextlib.nullcontext()
    try:
        with bars_off:
            return VERBS[args.command].run(args)
    except Interrupted as stop:  # a verb that says nothing more itself (``train`` does): one line, 128 + signal
        print(str(stop), file=sys.stderr)
        return stop.exit_code
    except Exception as exc:  # noqa: BLE001 - every failure ends in one line unless --debug asks for the traceback
        if args.debug:
            raise
        if is_user_error(exc):
            print(f"error: {error_message(exc)}", file=sys.stderr)
            return 2
        print(f"error: internal error: {type(exc).__name__}: {error_message(exc)} (rerun with --debug for the "
              "traceback)", file=sys.stderr)
        return 1
