"""``flowforge stages CONFIG [--stage A|B|C] [section.key=value ...]``: the three-stage pipeline
(:mod:`flowforge.orchestrate.stages`): teacher-judge RL (A) -> student reward model (B) -> student-reward RL (C).

Every stage is checked as a whole before anything loads (:func:`flowforge.orchestrate.config.check_pipeline`).
Rerunning the same command continues where a killed run stopped. Under ``torchrun --nproc_per_node N -m
flowforge.cli stages CONFIG`` stages A and C train on N ranks; rank 0 alone talks to the judges and writes the
ledgers and reports (:mod:`flowforge.orchestrate.stages`). ``--quick`` applies the config's ``stages.quick``
overrides (a short run in its own directory; the command line's overrides still win). ``--stage A`` does not need
stage B's gate to be reachable (its check is a warning). Exit status: 0 when the stages asked for are done;
3 when the pipeline stopped early (the quality gate failed, or an audit stopped stage C: the reason and the last good
checkpoint are printed and written to ``<pipeline>/summary.json``); 2 for bad input.
"""

from __future__ import annotations

import argparse
import os
import sys

from flowforge.cli.common import add_config_args

HELP = "three-stage pipeline: teacher-judge RL -> student reward model -> student-reward RL"
STOPPED_EARLY = 3


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("stages", help=HELP)
    add_config_args(parser, "pipeline config (YAML with a 'stages' section)")
    parser.add_argument("--stage", choices=["A", "B", "C"], default=None,
                        help="run one stage only (its predecessors must be done); default: A -> B -> C")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: apply the config's stages.quick overrides (examples/stages/digits.yaml: "
                             "each stage in minutes on 2 CPU cores)")
    return parser


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per judge request otherwise
    from flowforge.orchestrate.config import check_pipeline, load_pipeline, pipeline_dir
    from flowforge.runtime.errors import file_error

    try:
        pcfg = load_pipeline(args.config, args.overrides, quick=args.quick)
    except (UnicodeDecodeError, OSError) as exc:
        raise file_error(args.config, exc, "give a YAML pipeline config") from exc
    warnings = check_pipeline(pcfg, stage=args.stage)  # on every rank (each must refuse a bad config), said once
    for warning in warnings if os.environ.get("RANK", "0") == "0" else []:
        print(f"warning: {warning}", file=sys.stderr)
    from flowforge.orchestrate.stages import is_main, run_pipeline
    from flowforge.runtime.distributed import exit_now, shutdown

    try:
        outcome = run_pipeline(pcfg, stage=args.stage, progress=not args.no_progress, inputs={"config": args.config})
        main = is_main()
    finally:
        shutdown()  # under torchrun: leaving the group to interpreter teardown can abort a finished rank
    rc = 0 if outcome.status in ("done", "partial") else STOPPED_EARLY
    if main:  # under torchrun one summary, not one per rank
        directory = pipeline_dir(pcfg)
        print(f"pipeline directory: {directory}\nreport: {directory / 'report.html'}")
        if outcome.status == "partial":
            print(f"pipeline partly run: {outcome.reason}")
        if rc:
            print(f"pipeline stopped: {outcome.reason}", file=sys.stderr)
            if outcome.last_good:
                print(f"last good checkpoint: {outcome.last_good}", file=sys.stderr)
    exit_now(rc)  # under torchrun: a finished rank ends here, before C++ teardown can abort it
    return rc
