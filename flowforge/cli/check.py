"""``flowforge check CONFIG [section.key=value ...]``: load + preflight without loading a model; prints the resolved
config (warnings on stderr). A pipeline config (a ``stages`` section) is checked as a whole: both stage run configs
and the pipeline's own rules (:func:`flowforge.orchestrate.config.check_pipeline`)."""

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
    from flowforge.orchestrate.config import is_pipeline_file

    if is_pipeline_file(args.config):  # a three-stage pipeline: every stage checked as a whole
        return _check_pipeline(args)
    cfg = load_config_file(args.config, args.overrides)
    from flowforge.train.preflight import preflight

    report = preflight(cfg, this_machine=not args.portable)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(dump_config(cfg), end="")
    return 0


def _check_pipeline(args: argparse.Namespace) -> int:
    from flowforge.orchestrate.config import check_pipeline, load_pipeline
    from flowforge.settings.schema import dump

    pcfg = load_pipeline(args.config, args.overrides)
    for warning in check_pipeline(pcfg, this_machine=not args.portable):
        print(f"warning: {warning}", file=sys.stderr)
    print(dump(pcfg), end="")
    return 0
