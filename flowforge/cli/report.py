"""``flowforge report RUN_DIR [--smooth A]``: (re)write ``RUN_DIR/report.html`` from the run's logs."""

from __future__ import annotations

import argparse
from pathlib import Path

from flowforge.cli.common import finite_float

HELP = "write RUN_DIR/report.html from its logs"


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("report", help=HELP)
    parser.add_argument("run_dir", type=Path,
                        help="a training run directory (runs/<run.name>, finished or not); its report.html is "
                        "rewritten from metrics.jsonl, the eval sidecars and the sample grids")
    parser.add_argument("--smooth", type=finite_float, default=0.0, metavar="A",
                        help="moving-average weight in [0, 1) drawn over the training curves (default 0: raw)")
    return parser


def run(args: argparse.Namespace) -> int:
    from flowforge.report.run import write_report

    print(write_report(args.run_dir, smoothing=args.smooth))
    return 0
