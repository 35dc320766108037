"""``flowforge check CONFIG [CONFIG ...] [section.key=value ...] [--portable] [--print] [--stage X] [--quick]``: load
+ preflight without loading a model; ends with ``OK`` or the problems. A pipeline config (a ``stages`` section) is
checked as a whole: both stage run configs and the pipeline's own rules
(:func:`flowforge.orchestrate.config.check_pipeline`), as ``flowforge stages`` would with the same ``--stage`` /
``--quick``.

Arguments that name an existing file, or end in ``.yaml`` / ``.yml``, are configs; the others (``section.key=value``)
are overrides applied to every config. One config that fails is one ``error:`` line (exit 2), as for every verb;
several configs are each checked, each failure is one ``error: CONFIG: ...`` line, and the last line counts them.
Warnings go to stderr; ``--print`` prints each resolved config on stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flowforge.cli.common import TRAILING
from flowforge.cli.errors import error_message, is_user_error

HELP = "validate configs (load + preflight) without loading a model; prints OK or the problems"


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("check", help=HELP)
    parser.set_defaults(**{TRAILING: "paths"})  # `check CFG --portable x=y`: x=y joins the configs and overrides
    parser.add_argument("paths", nargs="+", metavar="config",
                        help="YAML configs (one or more), and section.key=value overrides applied to each")
    parser.add_argument("--portable", action="store_true",
                        help="check the config only, not against this machine (device, model.path on disk, "
                             "memory): e.g. a GPU config on a laptop")
    parser.add_argument("--print", action="store_true", dest="print_config", help="print each resolved config")
    parser.add_argument("--stage", choices=["A", "B", "C"], default=None,
                        help="pipeline configs: check for `flowforge stages --stage X` (a later stage's gate or "
                             "audit thresholds are warnings)")
    parser.add_argument("--quick", action="store_true", help="pipeline configs: with their stages.quick overrides")
    return parser


def split_configs(paths: list[str]) -> tuple[list[Path], list[str]]:
    """``(configs, overrides)``: an argument is a config when it names an existing file or ends in ``.yaml`` /
    ``.yml``; else an override (a malformed one, e.g. ``train.lr`` without ``=value``, is refused by the loader)."""
    configs, overrides = [], []
    for arg in paths:
        is_config = Path(arg).is_file() or arg.endswith((".yaml", ".yml"))
        (configs if is_config else overrides).append(Path(arg) if is_config else arg)
    return configs, overrides


def run(args: argparse.Namespace) -> int:
    configs, overrides = split_configs(args.paths)
    if not configs:
        raise ValueError("check: name at least one config file (.yaml), then any section.key=value overrides")
    if len(configs) == 1:
        _check_one(configs[0], overrides, args, name_it=False)
        print(f"OK: {configs[0]}")
        return 0
    failed = 0
    for path in configs:
        try:
            _check_one(path, overrides, args, name_it=True)
        except Exception as exc:  # noqa: BLE001 - a bug still propagates (below); bad input is this config's line
            if args.debug or not is_user_error(exc):
                raise
            failed += 1
            print(f"error: {path}: {error_message(exc)}", file=sys.stderr)
        else:
            print(f"ok: {path}")
    if failed:
        print(f"error: {failed} of {len(configs)} configs have problems (above)", file=sys.stderr)
        return 2
    print(f"OK: {len(configs)} configs")
    return 0


def _check_one(path: Path, overrides: list[str], args: argparse.Namespace, *, name_it: bool) -> None:
    """Load + preflight ``path`` (a run or a pipeline config); warnings to stderr (prefixed with ``path`` when
    ``name_it``); the config to stdout with ``--print``. Raises what loading / preflight raise."""
    from flowforge.cli.common import load_config_file
    from flowforge.orchestrate.config import is_pipeline_file

    if is_pipeline_file(path):  # a three-stage pipeline: every stage checked as a whole
        from flowforge.orchestrate.config import check_pipeline, load_pipeline
        from flowforge.settings.schema import dump

        pcfg = load_pipeline(path, overrides, quick=args.quick)
        notes: list[str] = []
        warnings, text = check_pipeline(pcfg, this_machine=not args.portable, stage=args.stage, notes=notes), dump(pcfg)
        for line in notes:  # the audits' size and power
            print(f"{path}: {line}" if name_it else line, file=sys.stderr if args.print_config else sys.stdout)
    else:
        if args.stage or args.quick:
            raise ValueError(f"check: --stage / --quick apply to pipeline configs (a 'stages' section); {path} is a "
                             "run config")
        from flowforge.config import dump_config
        from flowforge.train.preflight import preflight

        cfg = load_config_file(path, overrides)
        warnings, text = preflight(cfg, this_machine=not args.portable).warnings, dump_config(cfg)
    for warning in warnings:
        print(f"warning: {path}: {warning}" if name_it else f"warning: {warning}", file=sys.stderr)
    if args.print_config:
        print(text, end="")
