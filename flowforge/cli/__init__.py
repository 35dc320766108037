"""``flowforge`` command line: parse, load the config, call. Nothing else lives here.

::

    flowforge train CONFIG [section.key=value ...]   online RL post-training (the main job)
    flowforge sft CONFIG [section.key=value ...]     flow-matching supervised fine-tuning (makes the demo base)
    flowforge check CONFIG [section.key=value ...]   load + preflight only; prints warnings, exits 2 on errors
    flowforge compare FILE [section.key=value ...]   several algorithms / seeds, one budget, one plot + table
    flowforge export RUN OUT --form merged|adapter   a checkpoint as a diffusers transformer or a LoRA
    flowforge report RUN_DIR                         (re)write RUN_DIR/report.html
    flowforge export RUN_DIR OUT --form merged|adapter [--step N] [--verify] [--base PATH]
                                                     a diffusers transformer / LoRA from a run's checkpoint
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from flowforge.config import ConfigError, dump_config, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowforge", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("train", "online RL post-training"), ("sft", "flow-matching supervised fine-tuning"),
                        ("check", "validate a config (load + preflight) without loading a model"),
                        ("compare", "run several algorithms / seeds on one budget and plot them together")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("config", type=Path, help="YAML config")
        sp.add_argument("overrides", nargs="*", help="section.key=value (values are YAML literals)")
        sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    rp = sub.add_parser("report", help="write RUN_DIR/report.html from its logs")
    rp.add_argument("run_dir", type=Path)
    ep = sub.add_parser("export", help="export a run's checkpoint as a diffusers transformer (merged) or LoRA")
    ep.add_argument("run_dir", type=Path)
    ep.add_argument("out", type=Path, help="export directory (new or empty)")
    ep.add_argument("--form", required=True, choices=["merged", "adapter"])
    ep.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest committed)")
    ep.add_argument("--verify", action="store_true", help="reload the export and compare velocities; exit 1 if off")
    ep.add_argument("--base", default=None, help="base model directory (default: model.path of the run's config)")
    ep.add_argument("--weights", default="live", choices=["live", "ema", "old"])
    ep.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "report":
            from flowforge.train.report import write_report

            print(write_report(args.run_dir))
            return 0
        if args.command == "export":
            from flowforge.tools.export import ExportError, ExportVerificationError, export_run, read_export_meta

            try:
                out = export_run(args.run_dir, args.out, form=args.form, step=args.step, verify=args.verify,
                                 base=args.base, weights=args.weights, overwrite=args.overwrite)
            except ExportError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            except ExportVerificationError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            report = read_export_meta(out)["verify"]
            print(f"exported {args.form} to {out}" + (f"; verify: max abs diff {report['max_abs_diff']:.3g}, passed"
                                                       if report else ""))
            return 0
        if args.command == "compare":
            from flowforge.tools.compare import load_compare, run_compare

            png = run_compare(load_compare(args.config, tuple(args.overrides)), progress=not args.no_progress)
            print(f"comparison: {png}\ntable: {png.with_suffix('.md')}")
            return 0
        cfg = load_config(args.config, args.overrides)
        if args.command == "check":
            from flowforge.train.preflight import preflight

            report = preflight(cfg)
            for w in report.warnings:
                print(f"warning: {w}", file=sys.stderr)
            print(dump_config(cfg), end="")
            return 0
        if args.command == "sft":
            from flowforge.train.sft import run_sft_from_config

            run_sft_from_config(cfg, progress=not args.no_progress)
            return 0
        from flowforge.train.trainer import Trainer

        run_dir = Trainer(cfg, progress=not args.no_progress).train()
        print(f"run directory: {run_dir}\nreport: {run_dir / 'report.html'}")
        return 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

