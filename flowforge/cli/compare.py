"""``flowforge compare FILE [section.key=value ...]``: several algorithms / seeds on one sample budget, one plot and
one table."""

from __future__ import annotations

import argparse

from flowforge.cli.common import add_config_args

HELP = "run several algorithms / seeds on one budget and plot them together"
SCHEMA = """compare file (YAML; examples/digits/compare.yaml):
  base: grpo.yaml            required  the run config every arm starts from (path relative to this file),
                                       unless every arm names its own config
  arms:                      required  arm name -> list of section.key=value overrides applied to the base,
    grpo: []                           or {config: FILE, overrides: [...]}: the arm's own run config
    nft: [train.algorithm=nft, forward.sigma_mode=full_schedule, train.lr=3e-4]
    awm: {config: awm.yaml}            (examples/digits/rank.yaml: every shipped recipe as shipped)
  budget_samples: 4800       required  training samples per run: train.steps = budget_samples //
                                       (data.prompts_per_step * data.group_size) of that arm
  target: {metric: eval/digit_eval, values: [0.8, 0.9]}
                             optional  samples and seconds until the metric first reaches each value (these
                                       defaults; `value: 0.9` for one); per arm: median and range over seeds
  seeds: [0, 1]              optional  one run per (arm, seed); run.seed is set to the seed (default [0])
  diversity_metric: eval/diversity
                             optional  the table's "diversity at the end" (and its ratio to step 0's)
  output_dir: runs/compare   optional  runs go to <output_dir>/<arm>-s<seed>/ (one after another); writes
                                       compare.png (main panel: metric vs samples; also vs wall time),
                                       compare.csv and compare.md there

overrides on the command line (section.key=value) apply to every arm, after the arm's own."""


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("compare", help=HELP, description=HELP, epilog=SCHEMA,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser, what="compare file (schema below)")
    return parser


def run(args: argparse.Namespace) -> int:
    from flowforge.tools.compare import load_compare, run_compare

    png = run_compare(load_compare(args.config, tuple(args.overrides)), progress=not args.no_progress)
    print(f"comparison: {png}\ntable: {png.with_suffix('.md')}")
    return 0
