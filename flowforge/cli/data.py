"""``flowforge data prepare|curate|inspect``: build and check prompt files of the unified schema.

::

    flowforge data prepare --source pickapic|parquet|jsonl|lines --input PATH [--column C] [--prompt-field F]
                           [--task t2i] --output raw.jsonl [--overwrite]
    flowforge data curate --input raw.jsonl --out-dir D [--prefix P_] [--min-prompt-words 6] [--eval-size N]
                          [--eval-fraction F] [--eval-subset-sizes 64 256] [--no-check-media] [--overwrite]
    flowforge data inspect [--train T] [--eval E] [--decode-media]

``prepare`` and ``curate`` exit 0 after writing (2 on bad input). ``inspect`` exits 0 when clean and 1 after
listing every problem as ``file:line: problem`` on stdout. The rules are in :mod:`flowforge.data.tools`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flowforge.cli.common import finite_float

HELP = "prepare, curate and inspect prompt files (unified JSONL schema)"


def _debug_flag(parser: argparse.ArgumentParser) -> None:
    # the top-level parser adds --debug to `data` only; without this `flowforge data VERB ... --debug` is rejected
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def _add_prepare(verbs) -> None:
    # no argparse choices: they would import torch (through flowforge.data.prompts) for every verb's --help;
    # prepare() checks --source and --task and lists the allowed values
    p = verbs.add_parser("prepare", help="a raw prompt source -> one unified-schema JSONL file")
    p.add_argument("--source", required=True, help="pickapic | parquet | jsonl | lines")
    p.add_argument("--input", required=True, type=Path, metavar="PATH",
                   help="the raw file (parquet: a file or a directory)")
    p.add_argument("--column", default=None, metavar="C",
                   help="prompt column of a parquet source (pickapic: caption / prompt)")
    p.add_argument("--prompt-field", default=None, metavar="F", help="prompt field of a jsonl source (default: prompt)")
    p.add_argument("--task", default="t2i", help="metadata.task of every row: t2i | i2i | t2v | i2v (default t2i)")
    p.add_argument("--output", required=True, type=Path, metavar="PATH", help="the JSONL file to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    _debug_flag(p)


def _add_curate(verbs) -> None:
    p = verbs.add_parser("curate", help="filter, dedup and split a JSONL file into train / eval files")
    p.add_argument("--input", required=True, type=Path, metavar="PATH", help="a JSONL file of the unified schema")
    p.add_argument("--out-dir", required=True, type=Path, metavar="DIR", help="where the outputs go")
    p.add_argument("--prefix", default="", metavar="P",
                   help="file-name prefix: PREFIXtrain.jsonl, PREFIXeval.jsonl, ...")
    p.add_argument("--min-prompt-words", type=int, default=6, metavar="N",
                   help="drop shorter prompts (default 6; 0 keeps all)")
    p.add_argument("--eval-size", type=int, default=None, metavar="N",
                   help="eval records (default 2048; with --eval-fraction: the cap on the fraction)")
    p.add_argument("--eval-fraction", type=finite_float, default=None, metavar="F",
                   help="eval share of the kept records, in (0, 1)")
    p.add_argument("--eval-subset-sizes", type=int, nargs="*", default=[64, 256], metavar="N",
                   help="nested eval subsets PREFIXeval<N>.jsonl (default 64 256; none when given empty)")
    p.add_argument("--no-check-media", action="store_true", help="keep records whose media files are missing")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    _debug_flag(p)


def _add_inspect(verbs) -> None:
    p = verbs.add_parser("inspect", help="list every problem of train / eval prompt files (exit 1 if any)")
    p.add_argument("--train", type=Path, default=None, metavar="T", help="the training prompt file")
    p.add_argument("--eval", type=Path, default=None, metavar="E", help="the held-out prompt file")
    p.add_argument("--decode-media", action="store_true", help="decode every media file too")
    _debug_flag(p)


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("data", help=HELP, description=HELP)
    verbs = parser.add_subparsers(dest="data_command", required=True, metavar="{prepare,curate,inspect}")
    _add_prepare(verbs)
    _add_curate(verbs)
    _add_inspect(verbs)
    return parser


def _prepare(args: argparse.Namespace) -> int:
    from flowforge.data.tools.prepare import prepare

    done = prepare(args.source, args.input, args.output, task=args.task, column=args.column,
                   prompt_field=args.prompt_field, overwrite=args.overwrite)
    print(f"wrote {done.written} prompts to {done.output}" +
          (f" (skipped {done.skipped_empty} empty)" if done.skipped_empty else ""))
    return 0


def _curate(args: argparse.Namespace) -> int:
    from flowforge.data.tools.curate import CurateSettings, curate, stale_subsets

    settings = CurateSettings(prefix=args.prefix, min_prompt_words=args.min_prompt_words, eval_size=args.eval_size,
                              eval_fraction=args.eval_fraction, eval_subset_sizes=tuple(args.eval_subset_sizes),
                              check_media=not args.no_check_media)
    summary = curate(args.input, args.out_dir, settings, overwrite=args.overwrite)
    counts = ", ".join(f"{role} {n}" for role, n in summary["counts"].items())
    dropped = ", ".join(f"{n} {reason}" for reason, n in summary["dropped"].items())
    print(f"read {summary['records_read']}, kept {summary['kept']} ({counts}); dropped {dropped}; "
          f"wrote {args.out_dir}/{summary['files']['summary']}")
    stale = stale_subsets(args.out_dir, settings)
    if stale:
        print(f"note: {', '.join(stale)} in {args.out_dir} come from an earlier run (left in place)", file=sys.stderr)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from flowforge.data.tools.inspect import inspect_files

    report = inspect_files(args.train, args.eval, decode_media=args.decode_media)
    files = ", ".join(f"{path} ({n} record{'s' * (n != 1)})" for path, n in report.records.items())
    for problem in report.problems:
        print(problem)
    if report.problems:
        print(f"{len(report.problems)} problem{'s' * (len(report.problems) > 1)} in {files}")
        return 1
    decoded = "" if report.decoded is None else f"; {report.decoded} media file{'s' * (report.decoded != 1)} decoded"
    print(f"clean: {files}{decoded}")
    for path, counts in report.condition_images.items():  # image tasks: condition images per row
        print(f"{path}: condition images per row: " + ", ".join(f"{n}: {rows} row{'s' * (rows != 1)}"
                                                                for n, rows in counts.items()))
    return 0


def run(args: argparse.Namespace) -> int:
    return {"prepare": _prepare, "curate": _curate, "inspect": _inspect}[args.data_command](args)
