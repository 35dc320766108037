"""``flowforge compare FILE [section.key=value ...]``: several algorithms / seeds on one sample budget, one plot and
one table."""

from __future__ import annotations

import argparse

from flowforge.cli.common import add_config_args

HELP = "run several algorithms / seeds on one budget and plot them together"


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("compare", help=HELP)
    add_config_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from flowforge.tools.compare import load_compare, run_compare

    png = run_compare(load_compare(args.config, tuple(args.overrides)), progress=not args.no_progress)
    print(f"comparison: {png}\ntable: {png.with_suffix('.md')}")
    return 0
