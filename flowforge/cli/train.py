"""``flowforge train CONFIG [section.key=value ...]``: online RL post-training (the main job)."""

from __future__ import annotations

import argparse

from flowforge.cli.common import add_config_args, load_config_file

HELP = "online RL post-training"


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("train", help=HELP)
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
