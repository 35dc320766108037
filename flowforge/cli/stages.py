"""``flowforge stages CONFIG [--stage A|B|C | --arm teacher|proxy] [section.key=value ...]``: the three-stage pipeline
(:mod:`flowforge.orchestrate.stages`): teacher-judge RL (A) -> student reward model (B) -> student-reward RL (C).

Every stage is checked as a whole before anything loads (:func:`flowforge.orchestrate.config.check_pipeline`).
Rerunning the same command continues where a killed run stopped. Under ``torchrun --nproc_per_node N -m
flowforge.cli stages CONFIG`` stages A and C train on N ranks; rank 0 alone talks to the judges and writes the
ledgers and reports (:mod:`flowforge.orchestrate.stages`). ``--quick`` applies the config's ``stages.quick``
overrides (a short run in its own directory; the command line's overrides still win). ``--stage A`` does not need
stage B's gate to be reachable (its check is a warning). Exit status: 0 when the stages asked for are done;
3 when the pipeline stopped early (the quality gate failed, or an audit stopped stage C: the reason and the last good
checkpoint are printed and written to ``<pipeline>/summary.json``); 2 for bad input. ``--arm teacher|proxy``
runs a control arm (:mod:`flowforge.orchestrate.arms`): stage C with the teacher, or with ``stages.proxy_reward``,
instead of the student, so the student's gain can be read against what it replaces.
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
    parser.add_argument("--arm", choices=["teacher", "proxy"], default=None,
                        help="run a control arm beside the pipeline: stage C from A's last checkpoint with the teacher "
                             "(teacher) or stages.proxy_reward (proxy) as the reward instead of the student, in "
                             "<pipeline>/arms/<arm>/; prints every arm's held-out eval beside the base and A's hand-off")
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
    # on every rank (each must refuse a bad config), said once; an arm has no gate and no audits to check
    warnings = check_pipeline(pcfg, stage="arm" if args.arm is not None else args.stage)
    for warning in warnings if os.environ.get("RANK", "0") == "0" else []:
        print(f"warning: {warning}", file=sys.stderr)
    from flowforge.orchestrate.stages import is_main, run_pipeline
    from flowforge.runtime.distributed import exit_now, shutdown

    if args.arm is not None:
        if args.stage is not None:
            raise ValueError("--arm runs stage A (when not done) and the arm's own stage C: give --arm or --stage, "
                             "not both")
        from flowforge.orchestrate.arms import format_arm_table, run_arm_pipeline

        try:
            table = run_arm_pipeline(pcfg, args.arm, progress=not args.no_progress, inputs={"config": args.config})
            main = is_main()
        finally:
            shutdown()
        if main:
            print("held-out eval of each arm (gain over A's hand-off ± its paired SE in brackets):\n"
                  f"{format_arm_table(table)}\ntable: {pipeline_dir(pcfg) / 'arms' / 'arms.json'}")
        exit_now(0)
        return 0

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
