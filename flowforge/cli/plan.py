"""``flowforge plan CONFIG [--gpus N] [--gpu NAME] [--json] [section.key=value ...]``: the per-rank GPU memory plan
of a training config (:mod:`flowforge.tools.plan`): a table of items, the peak against the GPU's memory, "fits" or
"does not fit" with the three largest items and the one change that would make it fit.

The GPU name and the config (as a whole, with preflight's portable rules) are checked before any model is built;
a bad one is one ``error:`` line, exit 2. The plan builds the transformer on the meta device (sizes) and measures
activations on this machine's CPU at the model's real width and one or two blocks (tens of seconds to minutes).
"""

from __future__ import annotations

import argparse
import json

from flowforge.cli.common import add_config_args, load_config_file

HELP = "plan per-rank GPU memory of a config (fits / does not fit, and what would make it fit)"


def add_parser(sub) -> argparse.ArgumentParser:
    from flowforge.tools.plan.budget import GPUS

    parser = sub.add_parser("plan", help=HELP)
    add_config_args(parser)
    parser.add_argument("--gpus", type=int, default=1, help="ranks (GPUs) the run uses (default 1)")
    parser.add_argument("--gpu", default="h100-80gb", help=f"GPU model, one of: {', '.join(sorted(GPUS))}")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def run(args: argparse.Namespace) -> int:
    from flowforge.tools.plan.budget import check_gpu

    check_gpu(args.gpu)  # before the config: an unknown name answers at once
    if args.gpus < 1:
        raise ValueError(f"--gpus={args.gpus} must be >= 1")
    cfg = load_config_file(args.config, args.overrides)
    from flowforge.train.preflight import preflight

    preflight(cfg, world_size=args.gpus, this_machine=False)  # the config as a whole on --gpus ranks, first
    import torch

    from flowforge.tools.plan import plan_config, render

    torch.set_num_threads(max(1, torch.get_num_threads()))
    plan = plan_config(cfg, args.gpus, args.gpu)
    print(json.dumps(plan.as_dict(), indent=1) if args.json else render(plan))
    return 0
