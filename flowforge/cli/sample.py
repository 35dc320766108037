"""``flowforge sample SOURCE --prompt "..." [--prompt-file F] [--num N] [--seed S] [--guidance G] [--steps T]
[--negative-prompt TEXT] [--config CFG] --out grid.png``: images from a trained run (its newest committed checkpoint),
an export, or a base model before training (``demo:base``, ``demo:world``, a model directory or Hub id with
``--config``), with the run's sampler and text encoder (:mod:`flowforge.tools.sample`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from flowforge.cli.common import check_device, finite_float

HELP = "generate images with a run's, an export's or a base model; writes each PNG and a labelled grid"


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("sample", help=HELP, description=HELP + ". Deterministic for a seed: image j of prompt p "
                            "starts from the noise of candidate p*N+j (the held-out eval's rule).")
    parser.add_argument("source", metavar="SOURCE",
                        help="a run directory (newest committed checkpoint: EMA weights when it kept an EMA, else "
                        "live), a flowforge export, or a "
                        "base model: demo:base, demo:world, or a model directory / Hub id with --config")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompt-file", type=Path, default=None,
                        help="one prompt per line, a .jsonl prompt file or a packaged set such as "
                        "demo:world-eval (i2i / i2v need metadata.image)")
    parser.add_argument("--num", type=int, default=4, help="images per prompt (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    parser.add_argument("--guidance", type=finite_float, default=None,
                        help="guidance scale (default: the run's sampler)")
    parser.add_argument("--steps", type=int, default=None, help="sampling steps (default: the run's sampler)")
    parser.add_argument("--negative-prompt", default=None, metavar="TEXT",
                        help="CFG's unconditional prompt, used when the guidance scale is not 1 (default: the "
                        "config's sampler.negative_prompt, else the model's own)")
    parser.add_argument("--config", type=Path, default=None,
                        help="a base model's settings: a training config (model and sampler sections; model.path "
                        "replaced by SOURCE); not for runs and exports")
    parser.add_argument("--out", type=Path, required=True,
                        help="the labelled grid (.png); each image goes to <stem>_<i>.png beside it")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: the run's, if available)")
    parser.add_argument("--base", default=None, help="the base model directory, when it moved")
    parser.add_argument("--batch-size", type=int, default=8, help="images per forward (default 8)")
    return parser


def run(args: argparse.Namespace) -> int:
    check_device(args.device)  # before any model loads
    from flowforge.tools.sample import run_sample

    result = run_sample(args.source, args.out, prompts=args.prompt, prompt_file=args.prompt_file, num=args.num,
                        seed=args.seed, guidance=args.guidance, steps=args.steps, device=args.device, base=args.base,
                        batch_size=args.batch_size, config=args.config, negative_prompt=args.negative_prompt)
    print(f"grid: {result.grid}\nimages: {len(result.images)} ({result.images[0].name} ...)")
    return 0
