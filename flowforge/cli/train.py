"""``flowforge train CONFIG [section.key=value ...]``: online RL post-training (the main job)."""

from __future__ import annotations

import argparse

from flowforge.cli.common import add_config_args, load_config_file

HELP = "online RL post-training"
DESCRIPTION = """\
Online RL post-training: each step samples prompts x candidates with the policy, scores them
with the config's reward models, forms group-relative advantages and updates the policy
(train.algorithm: grpo, nft, awm, ...). The run directory runs/<run.name>/ gets the resolved
config, metrics.jsonl, held-out evals, sample grids, checkpoints and report.html."""
EPILOG = """\
examples:
  flowforge train examples/digits/nft.yaml
  flowforge train examples/digits/grpo.yaml train.steps=20 train.lr=1e-4 run.name=try1

resuming (train.resume):
  train.resume=auto        continue from the run's newest committed checkpoint (a run with no
                           checkpoint yet starts at step 0)
  train.resume=PATH        continue from that checkpoint directory (refused if not committed)
  A run directory that already holds a run is refused without train.resume; --overwrite moves
  it aside instead."""


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("train", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--overwrite", action="store_true",
                        help="move an existing run in the run directory aside to <name>.old-<n>, then start anew")
    return parser


def run(args: argparse.Namespace) -> int:
    cfg = load_config_file(args.config, args.overrides)  # config errors surface before torch is imported
    from flowforge.runtime.distributed import exit_now, shutdown
    from flowforge.train.trainer import Trainer

    try:
        trainer = Trainer(cfg, progress=not args.no_progress, overwrite=args.overwrite)
        run_dir = trainer.train()
        if trainer.dist.is_main:  # under torchrun one summary, not one per rank
            print(f"run directory: {run_dir}\nreport: {run_dir / 'report.html'}")
    finally:
        # leaving the process group to interpreter teardown can abort a finished rank (SIGABRT, gloo threads)
        shutdown()
    exit_now(0)  # under torchrun: a finished rank ends here, before C++ teardown can abort it
    return 0
