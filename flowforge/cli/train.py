"""``flowforge train CONFIG [section.key=value ...]``: online RL post-training (the main job).

SIGINT (Ctrl-C) and SIGTERM (a cluster's preemption): the current step finishes, its checkpoint is committed, and
the command ends with one line on stderr naming that checkpoint and the command that continues the run, exit 130
(SIGINT) or 143 (SIGTERM); a second signal stops at once, saying how far back a resume goes
(:mod:`flowforge.runtime.interrupt`)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

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
  train.resume=must        as auto, but refused when there is nothing to resume (a mistyped run.name)
  train.resume=PATH        continue from that checkpoint directory (refused if not committed); into
                           the checkpoint's own run or a new run.name, never over another run
  SIGINT / SIGTERM finish the current step, commit its checkpoint and exit 130 / 143 with the
  command that continues the run.
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
    from flowforge.runtime.interrupt import Interrupted, StopSignals
    from flowforge.train.trainer import Trainer

    rc, trainer = 0, None
    try:
        with StopSignals() as signals:  # a signal during setup stops at once (nothing trained yet)
            trainer = Trainer(cfg, progress=not args.no_progress, overwrite=args.overwrite)
            run_dir = trainer.train(signals=signals)
        if trainer.dist.is_main:  # under torchrun one summary, not one per rank
            print(f"run directory: {run_dir}\nreport: {run_dir / 'report.html'}")
    except Interrupted as stop:
        if trainer is None or trainer.dist.is_main:
            print(interrupted_line(stop, Path(cfg.run.output_dir) / cfg.run.name, args, cfg.checkpoint.every,
                                   cfg.train.steps), file=sys.stderr)
        rc = stop.exit_code
    finally:
        # leaving the process group to interpreter teardown can abort a finished rank (SIGABRT, gloo threads)
        shutdown()
    exit_now(rc)  # under torchrun: a finished rank ends here, before C++ teardown can abort it
    return rc


def resume_command(args: argparse.Namespace, how: str = "train.resume=auto") -> str:
    """The command that continues this run: ``flowforge train CONFIG <the overrides, without train.resume> how``
    (``how`` ``"--overwrite"``: the command that starts it anew), shell-quoted."""
    kept = [o for o in args.overrides if not o.startswith("train.resume=")]
    flags = ["--no-progress"] if args.no_progress else []
    return shlex.join(["flowforge", "train", str(args.config), *kept, *flags, how])


def interrupted_line(stop, run_dir: Path, args: argparse.Namespace, every: int, steps: int) -> str:
    """One line for a run stopped by a signal: what happened, the last committed checkpoint (how far back a resume
    goes when the stop was not graceful) and the exact command that continues it."""
    from flowforge.runtime.interrupt import signal_name
    from flowforge.runtime.run_dir import committed_checkpoints
    from flowforge.train.run_lifecycle import refuse_lost_history

    name = signal_name(stop.signum)
    committed = committed_checkpoints(run_dir) if run_dir.is_dir() else []
    if stop.graceful:
        return (f"interrupted by {name}: finished step {stop.step} of {steps} and committed its checkpoint "
                f"{committed[-1]}; continue with: {resume_command(args)}")
    if committed:
        return (f"interrupted by {name}: stopped at once; a resume goes back to the last committed checkpoint "
                f"{committed[-1]}; continue with: {resume_command(args)}")
    try:  # logged steps without a checkpoint: resume=auto starts again from step 0 unless that would lose history
        refuse_lost_history(run_dir, every, steps)
    except ValueError:
        return (f"interrupted by {name}: stopped at once with no committed checkpoint (checkpoint.every={every}): "
                f"nothing to resume; start it anew with: {resume_command(args, '--overwrite')}")
    return (f"interrupted by {name}: stopped at once with no committed checkpoint: a resume starts again from step "
            f"0; continue with: {resume_command(args)}")
