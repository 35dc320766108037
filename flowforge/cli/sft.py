"""``flowforge sft CONFIG [section.key=value ...]``: flow-matching supervised fine-tuning (makes the demo base)."""

from __future__ import annotations

import argparse

from flowforge.cli.common import add_config_args, load_config_file

HELP = "flow-matching supervised fine-tuning"


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("sft", help=HELP)
    add_config_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    cfg = load_config_file(args.config, args.overrides)
    from flowforge.train.sft import run_sft_from_config

    run_sft_from_config(cfg, progress=not args.no_progress)
    return 0
