"""``flowforge export RUN_DIR OUT --form merged|adapter``: a run's checkpoint as a diffusers transformer or a
world-model directory (merged), or a diffusers / peft LoRA or a module run's trained tensors (adapter). The safety
rules for ``OUT`` are :func:`flowforge.tools.export.export_run`'s."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "export a run's checkpoint as a merged model (diffusers / world model) or its adapter (LoRA / trained modules)"


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("export", help=HELP)
    parser.add_argument("run_dir", type=Path, help="the training run directory (runs/<run.name>)")
    parser.add_argument("out", type=Path, help="export directory (new or empty)")
    parser.add_argument("--form", required=True, choices=["merged", "adapter"],
                        help="merged: the whole model with the trained weights folded in (a diffusers transformer "
                        "directory; a world-model directory for world-model runs); adapter: only what was trained "
                        "(a diffusers / peft LoRA, or a module run's trained tensors), loaded on top of the base "
                        "model")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest committed)")
    parser.add_argument("--verify", action="store_true",
                        help="reload the export and compare velocities; exit 1 if off")
    parser.add_argument("--base", default=None, help="base model directory (default: model.path of the run's config)")
    parser.add_argument("--weights", default=None, choices=["live", "ema", "old"],
                        help="which checkpoint weights (default: the ones the run's held-out evals measured: ema when "
                        "the run kept an EMA, else live)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT when it holds a previous flowforge export (and nothing else)")
    return parser


def run(args: argparse.Namespace) -> int:
    from flowforge.tools.export import ExportVerificationError, export_run, read_export_meta

    try:
        out = export_run(args.run_dir, args.out, form=args.form, step=args.step, verify=args.verify,
                         base=args.base, weights=args.weights, overwrite=args.overwrite)
    except ExportVerificationError as exc:  # the export ran but is wrong: a failed check (1), not bad input (2)
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report = read_export_meta(out)["verify"]
    print(f"exported {args.form} to {out}" + (f"; verify: max abs diff {report['max_abs_diff']:.3g}, passed"
                                               if report else ""))
    return 0
