"""How much of a pipeline teacher's order the student already knows before stage B: the agreement of the student's
initialisation with the teacher on the images stage A would judge first.

``--groups`` prompts of ``demo:train``, ``--k`` candidates each from the demo's base model (ODE sampler, seed 0, as
``bench/augment_labels.py``), marked by ``--config``'s teacher (``teacher.scorer`` with ``teacher.scorer_options``,
built as the pipeline's judge server builds it) and scored by the student before stage B
(:func:`flowforge.reward_model.students.create_student` of ``student``: ``demo:digit-tower`` in the digits demos).
Prints the mean within-group Spearman (:func:`flowforge.reward_model.evaluate.spearman`, the gate's; with its
standard error over the groups) of the teacher's marks against the
student's initialisation, against :class:`flowforge.orchestrate.demo.LegibilityScorer` (the digits demo's legibility
teacher) and against minus :class:`flowforge.demo.stroke.StrokeWidth` (the pen's independent judge: finer is
better); and the initialisation against legibility.

    python bench/tower_agreement.py [--config examples/stages/digits_pen.yaml] [--groups 40] [--k 8]
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/stages/digits_pen.yaml")
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    from flowforge.data.prompts import load_prompts
    from flowforge.demo.stroke import StrokeWidth
    from flowforge.orchestrate.config import load_pipeline
    from flowforge.orchestrate.demo import LegibilityScorer
    from flowforge.reward_model.evaluate import spearman
    from flowforge.reward_model.students import create_student
    from flowforge.rewards.registry import build_scorer
    from flowforge.tools.sample import sample
    from flowforge.tools.sample.load import load_for_sampling

    torch.set_num_threads(2)
    pcfg = load_pipeline(args.config)
    records = load_prompts("demo:train")[:args.groups]
    media = sample(load_for_sampling("demo:base", device="cpu"), records, num=args.k, seed=0)  # prompt-major
    prompts = [r.prompt for r in records for _ in range(args.k)]
    meta = [{} for _ in prompts]
    shape = (args.groups, args.k)
    teacher = build_scorer(pcfg.teacher.scorer, **pcfg.teacher.scorer_options)(media, prompts, meta).double()
    init = create_student(pcfg.student)
    init.eval()
    with torch.no_grad():
        tower = init.score_images(media, prompts).double()
    legibility = LegibilityScorer()(media, prompts, meta).double()
    width = StrokeWidth()(media, prompts, meta).double()

    def show(name: str, a: Tensor, b: Tensor) -> None:  # the gate's Spearman (average ranks), group by group
        rho = torch.tensor([spearman(x, y) for x, y in zip(a.view(shape), b.view(shape), strict=True)])
        print(f"{name:<50} {rho.mean():+.3f} +- {rho.std() / len(rho) ** 0.5:.3f}")

    print(f"teacher {pcfg.teacher.scorer} {dict(pcfg.teacher.scorer_options)}; {args.groups} groups x {args.k} "
          "from demo:base; mean within-group Spearman +- SE")
    show("teacher vs the student's initialisation", teacher, tower)
    show("teacher vs LegibilityScorer", teacher, legibility)
    show("teacher vs -StrokeWidth (finer is better)", teacher, -width)
    show("the student's initialisation vs LegibilityScorer", tower, legibility)


if __name__ == "__main__":
    main()
