"""Bounded-staleness async training (``train.max_staleness: 1``) against on-policy, both with rollout workers.

    python bench/async_staleness.py [--steps 10] [--staleness 1]

Two arms, one after the other in this process, on the embedded default's FlowGRPO recipe
(``examples/digits/grpo.yaml``) at one thread split: the trainer on ``run.num_threads=1``, one rollout worker on
``rollout.threads=1``; eval only at the start and the end, no checkpoint before the end.

* on-policy (``max_staleness=0``): each step waits for its rollout, then updates. ``rollout`` = ``time/sample``,
  ``update`` = the rest of the step, ``step`` = their sum;
* async (``max_staleness=s``): the next step's rollout runs in the worker while this step scores and updates.
  ``rollout`` = ``time/rollout`` (the rollout's own seconds in the worker thread, weight sync included), ``update`` =
  the step minus its wait for the rollout and the submission of the next, ``step`` = the whole step.

A step's time is ``B / perf/samples_per_s`` (the trainer's stage timer: prompts, sample, reward, advantage,
optimize); medians over the steps after the first (on-policy: worker start-up) and, async, over its stale steps.
Printed: the medians, the async step over ``max(rollout, update)`` of the same run (1.0 = perfect overlap), over
``max`` of the on-policy arm's rollout and update (on 2 cores the overlapped rollout and update share the CPU, so
they slow each other: the on-policy components are the uncontended ones), and over the on-policy step; and each
arm's final DigitEval with its standard error (``sqrt(p (1 - p) / n)`` over the n held-out images) and their
difference in units of the combined SE.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def run_arm(out: str, steps: int, staleness: int) -> tuple[list[dict], dict, float, int]:
    from flowforge.config import load_config
    from flowforge.train.trainer import Trainer

    cfg = load_config("examples/digits/grpo.yaml", [
        f"run.output_dir={out}", f"run.name=s{staleness}", "run.num_threads=1", "rollout.engine=workers",
        "rollout.num_workers=1", "rollout.threads=1", f"train.steps={steps}", "eval.every=0", "checkpoint.every=0",
        f"train.max_staleness={staleness}"])
    t0 = time.perf_counter()
    trainer = Trainer(cfg, progress=False)
    images = len(trainer.eval_prompts) * cfg.eval.samples_per_prompt  # eval.max_prompts unset: every held-out one
    run_dir = Path(trainer.train())
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    return rows, evals[-1], wall, images


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--staleness", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = tempfile.mkdtemp(prefix="flowforge-bench-async-")  # fresh run directories, removed at the end
    batch = 4 * 8  # examples/digits/grpo.yaml: 4 prompts x 8 candidates
    try:
        on_rows, on_eval, on_wall, n = run_arm(out, args.steps, 0)
        as_rows, as_eval, as_wall, _ = run_arm(out, args.steps, args.staleness)
    finally:
        shutil.rmtree(out, ignore_errors=True)

    def med(values):
        return statistics.median(values)

    step = lambda r: batch / r["perf/samples_per_s"]  # noqa: E731
    on = on_rows[1:]
    on_roll, on_step = med([r["time/sample"] for r in on]), med([step(r) for r in on])
    on_upd = med([step(r) - r["time/sample"] for r in on])
    stale = [r for r in as_rows if r["train/staleness"] > 0]
    as_step, as_roll = med([step(r) for r in stale]), med([r["time/rollout"] for r in stale])
    as_upd = med([step(r) - r["time/sample"] - r.get("time/prompts", 0.0) for r in stale])
    print(f"FlowGRPO digits, {batch} samples/step, {args.steps} steps per arm, trainer 1 thread + 1 worker of 1 "
          f"thread; medians in s (on-policy: steps 2..{args.steps}; async: its {len(stale)} stale steps)")
    print(f"  on-policy      : rollout {on_roll:.3f}  update {on_upd:.3f}  step {on_step:.3f}  (arm {on_wall:.0f} s)")
    print(f"  async s={args.staleness}      : rollout {as_roll:.3f}  update {as_upd:.3f}  step {as_step:.3f}  "
          f"(arm {as_wall:.0f} s; staleness {[int(r['train/staleness']) for r in as_rows]})")
    print(f"  async step / max(its rollout, its update)          : {as_step / max(as_roll, as_upd):.3f}")
    print(f"  async step / max(on-policy rollout, update)        : {as_step / max(on_roll, on_upd):.3f}")
    print(f"  async step / on-policy step (rollout + update)     : {as_step / on_step:.3f}")
    for name, e in (("on-policy", on_eval), (f"async s={args.staleness}", as_eval)):
        pe = e["eval/digit_eval"]
        print(f"  final DigitEval {name:>11}: {pe:.3f} +- {math.sqrt(pe * (1 - pe) / n):.3f} (n={n})")
    p0, p1 = on_eval["eval/digit_eval"], as_eval["eval/digit_eval"]
    se = math.sqrt(p0 * (1 - p0) / n + p1 * (1 - p1) / n)
    print(f"  difference async - on-policy: {p1 - p0:+.3f} = {(p1 - p0) / se if se else 0.0:+.2f} SE")


if __name__ == "__main__":
    main()
