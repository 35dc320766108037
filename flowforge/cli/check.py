"""``flowforge check CONFIG [section.key=value ...]``: load + preflight without loading a model; prints the resolved
config (warnings on stderr)."""

from __future__ import annotations

import argparse
import sys

from flowforge.cli.common import add_config_args, load_config_file

HELP = "validate a config (load + preflight) without loading a model"


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("check", help=HELP)
    add_config_args(parser)
    parser.add_argument("--portable", action="store_true",
                        help="check the config only, not against this machine (device, model.path on disk, "
                             "memory): e.g. a GPU config on a laptop")
    return parser


def run(args: argparse.Namespace) -> int:
    from flowforge.config import dump_config

    cfg = load_config_file(args.config, args.overrides)
    from flowforge.train.preflight import preflight

    report = preflight(cfg, this_machine=not args.portable)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(dump_config(cfg), end="")
    return 0
