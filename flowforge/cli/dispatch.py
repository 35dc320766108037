"""``flowforge`` command line: parse, dispatch to one module per verb, and report failures in one line
(:func:`main`, re-exported by :mod:`flowforge.cli`; the one-line rendering is :mod:`flowforge.cli.errors`).

``flowforge --help`` shows :data:`DESCRIPTION` (what flowforge is, the verbs) and :data:`EPILOG` (how failures are
reported), plain text both, so the terminal shows them as written. Each verb's module has ``add_parser(subparsers)``
and ``run(args) -> exit status`` (:data:`VERBS`).

Failures, by exit status:

* 2: misuse of the command line (argparse: usage + ``flowforge: error: ...``), or bad input: ``UserError``,
  ``ConfigError``, ``PreflightError``, ``ExportError``, other ``ValueError`` / ``OSError``, a safetensors or pickle
  error from reading a file (one line ``error: <what>: <why>; <fix>``; a config's several problems joined by ``; ``);
* 1: ``export --verify`` found a wrong export (``error: export verification failed: ...``), or anything else, a bug
  (``error: internal error: <type>: <message> (rerun with --debug for the traceback)``);
* 130 / 143: stopped by SIGINT / SIGTERM (``train``, the RL stages of ``stages``): one line ``interrupted by
  SIGTERM: ...``; ``train``'s names the last committed checkpoint and the resume command (:mod:`flowforge.cli.train`).

``--debug`` (before or after the verb) or ``FLOWFORGE_DEBUG=1`` re-raises instead, so the traceback is shown.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from flowforge import __version__
from flowforge.cli import check, compare, data, export, plan, report, sample, serve, sft, stages, train
from flowforge.cli.common import TRAILING
from flowforge.cli.errors import error_message, is_user_error
from flowforge.runtime.interrupt import Interrupted
from flowforge.runtime.quiet import library_progress_bars_off

VERBS = {"train": train, "sft": sft, "check": check, "compare": compare, "report": report, "export": export,
         "sample": sample, "serve": serve, "data": data, "stages": stages, "plan": plan}
"""Verb -> its module (``add_parser(subparsers)``, ``run(args) -> exit status``), in ``--help`` order."""
DEBUG_ENV = "FLOWFORGE_DEBUG"
DESCRIPTION = """\
flowforge post-trains diffusion / flow-matching image and video generators with online
reinforcement learning (FlowGRPO, GRPO-Guard, DiffusionNFT, AWM, DGPO, Diffusion-DPO, CRD):
a stochastic sampler rolls out samples, reward models score them, the policy is updated.
It runs on a CPU with an embedded tiny text-to-digit model, and on GPUs with SD3.5, FLUX,
Qwen-Image, Wan and other diffusers models.

First run:  flowforge train examples/digits/nft.yaml
Then:       flowforge export runs/digits-nft exports/digits-nft --form merged --verify
            flowforge sample exports/digits-nft --prompt "a handwritten seven" --out seven.png

Each command below has its own help: flowforge <command> --help."""
"""``flowforge --help``'s text above the option list (plain text: the terminal shows it as written)."""
EPILOG = f"""\
Bad input is one line on stderr, "error: <what>: <why>; <fix>", exit 2; a failed
export --verify and internal errors exit 1. --debug (or {DEBUG_ENV}=1) shows the traceback."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowforge", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help=f"show tracebacks (also: {DEBUG_ENV}=1)")
    p.add_argument("--version", action="version", version=f"flowforge {__version__}")
    sub = p.add_subparsers(title="commands", dest="command", required=True, metavar="command")
    for module in VERBS.values():
        # SUPPRESS: a verb's parser leaves the attribute alone unless the flag follows the verb, so
        # `flowforge --debug VERB` is not reset to False by the sub-parser's default
        module.add_parser(sub).add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                            help=f"show tracebacks (also: {DEBUG_ENV}=1)")
    return p


def _debug_from_env() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``argv`` parsed; exits 2 with usage on misuse (argparse).

    Overrides may come anywhere after the config, before or after options (``check CFG --portable x=y``,
    ``train CFG --overwrite x=y``): argparse ends a ``*`` / ``+`` positional at the first option, so the words it
    leaves over are appended to the list the verb names as its trailing positionals
    (:data:`flowforge.cli.common.TRAILING`); a verb without one, or a left-over word that looks like an option,
    is refused as argparse would."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        dest = getattr(args, TRAILING, None)
        if dest is None or any(a.startswith("-") for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        getattr(args, dest).extend(extra)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status (table above)."""
    args = parse_args(argv)
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
