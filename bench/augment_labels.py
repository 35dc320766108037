"""How far the student's training augmentation moves the demo teacher's marks: is it label-preserving?

The ``scalar_head`` student can train on randomly rotated / scaled / shifted copies of its frames
(``student.scalar_head.augment_*``), which is sound only if the teacher would give a distorted image the mark of the
original. This measures it where it matters, on the images stage A judges: ``--groups`` prompts of ``demo:train``,
``--k`` candidates each from the demo's base model (ODE sampler, seed 0), marked by the demo teacher
(``teacher.scorer`` of ``--config``, built as the pipeline builds it:
:class:`flowforge.orchestrate.demo.LegibilityScorer` in the shipped demo) as they are and after the student's
augmentation (the same function, :meth:`flowforge.reward_model.scalar_head.ScalarHeadStudent.augment`, at
``--rotate`` / ``--scale`` / ``--shift``, default 10 / 0.1 / 0.06, the shipped demo's settings; one draw per
candidate, ``--draws`` draws). Prints the mean absolute change of a mark and the share of the teacher-ordered pairs
of a group (marks differing by more than ``--margin``) whose order the augmentation flips.

    python bench/augment_labels.py [--config examples/stages/digits.yaml] [--groups 40] [--k 4] [--draws 4]
                                   [--margin 0.0] [--rotate 10] [--scale 0.1] [--shift 0.06]
"""

from __future__ import annotations

import argparse
import dataclasses
import types

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/stages/digits.yaml")
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--margin", type=float, default=0.0)
    parser.add_argument("--rotate", type=float, default=10.0)
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--shift", type=float, default=0.06)
    args = parser.parse_args()
    from flowforge.data.prompts import load_prompts
    from flowforge.orchestrate.config import load_pipeline
    from flowforge.reward_model.scalar_head import ScalarHeadStudent
    from flowforge.rewards.registry import build_scorer
    from flowforge.tools.sample import sample
    from flowforge.tools.sample.load import load_for_sampling

    torch.set_num_threads(1)
    pcfg = load_pipeline(args.config)
    options = dataclasses.replace(pcfg.student.scalar_head, augment_rotate=args.rotate, augment_scale=args.scale,
                                  augment_shift=args.shift)
    model = load_for_sampling("demo:base", device="cpu")
    records = load_prompts("demo:train")[:args.groups]
    media = sample(model, records, num=args.k, seed=0)  # [G * K, 3, H, W], prompt-major
    prompts = [r.prompt for r in records for _ in range(args.k)]
    meta = [{} for _ in prompts]
    teacher = build_scorer(pcfg.teacher.scorer, **pcfg.teacher.scorer_options)
    marks = teacher(media, prompts, meta).double().view(args.groups, args.k)
    shifts, flipped, ordered = [], 0, 0
    holder = types.SimpleNamespace(options=options)
    for draw in range(args.draws):
        torch.manual_seed(draw)
        moved = ScalarHeadStudent.augment(holder, media, [1] * media.shape[0])
        after = teacher(moved, prompts, meta).double().view(args.groups, args.k)
        shifts.append((after - marks).abs().flatten())
        diff, diff_after = marks[:, :, None] - marks[:, None, :], after[:, :, None] - after[:, None, :]
        pairs = diff > args.margin  # i above j for the teacher
        ordered += int(pairs.sum())
        flipped += int((pairs & (diff_after < 0)).sum())
    shift = torch.cat(shifts)
    se = shift.std() / shift.numel() ** 0.5
    share = flipped / max(ordered, 1)
    print(f"augmentation at rotate {options.augment_rotate} deg, scale {options.augment_scale}, shift "
          f"{options.augment_shift}: mean |mark change| {shift.mean():.4f} (SE {se:.4f}, {shift.numel()} marks); "
          f"teacher-ordered pairs flipped {flipped}/{ordered} = {share:.3f} ({args.groups} groups x {args.k} from "
          f"demo:base, {args.draws} draws)")


if __name__ == "__main__":
    main()
