"""A slow judge at full concurrency and hidden behind the rollout: training steps of the main job judged by
``vlm_judge`` against a loopback judge server with a fixed per-request latency.

    python bench/bench_overlap.py [--latencies 0.2,2] [--steps 4] [--concurrency 4]

Starts flowforge's judge server (:func:`flowforge.serve.judge_server.build_app` under uvicorn, a free port, a bearer
token) in a subprocess whose backend sleeps ``latency`` seconds per request, then answers with a cheap
content-dependent score (mean brightness) -- a paid VLM's latency without its cost. For each latency, the main job
(``examples/digits/nft.yaml``: 4 prompts x 8 candidates, 10 sampling steps, the demo base; reward: its ``digit``
plus the judge, required)
trains ``--steps`` steps in three arms, one after the other:

* **sequential**: ``max_concurrency: 1``, scored after the rollout (what training did before);
* **concurrent**: ``max_concurrency: C``, every group of the step in flight at once, after the rollout;
* **concurrent + overlapped**: ``C`` and ``reward.overlap: true``: each group is sent as soon as its candidates are
  rolled out and decoded, while the rollout of the next groups goes on.

The first step of each arm's run is a warm-up (``--rounds N`` runs every arm N times, in turn); the others' stage
times (``time/*`` in ``metrics.jsonl``) give, as medians: ``step`` (all stages) and ``roll+score`` (stages
``sample`` + ``reward``), compared with

* the floor ``max(rollout, ceil(G / C) x latency)`` (``G`` = 4 groups, ``rollout`` = the sequential arm's
  ``sample`` stage), and for a whole step that floor plus the stages that never overlap scoring (prompts, advantage,
  optimize; the sequential arm's);
* the bound: the least ``roll+score`` possible when a group can be sent only once its candidates exist (at
  ``rollout x (g + 1) / G`` streamed, at ``rollout`` otherwise), each request taking ``latency`` on one of ``C``
  workers. Streamed, the last group still exists only when the rollout ends, so with ``C >= G`` the bound is
  ``rollout + latency``: above the floor by ``min(rollout, latency)``, a ratio of at least
  ``1 + min(rollout, latency) / max(rollout, latency)`` (0.9 s of rollout: 1.22 at 200 ms, 1.45 at 2 s).

Also per arm: ``sample`` (its own ``sample`` stage: streamed, the rollout plus each chunk's decode and hand-off, and
slowed by the scoring that runs beside it on the same cores) and ``judge`` (the client's mean seconds per request,
``reward/vlm_judge_latency_s``: the server's sleep plus the HTTP round trip and the server's decoding), the two
parts of ``roll+score`` above the bound.

Prints a table with the ratios to the floors. Run it on a quiet machine (``cpu python bench/bench_overlap.py``): the
rollout is CPU time, the latency is a sleep in another process.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import start_announced  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN_ENV = "FF_BENCH_OVERLAP_TOKEN"
GROUPS = 4  # the main job's data.prompts_per_step


class LatencyBackend:
    """A judge backend that sleeps ``latency`` seconds, then scores the group by mean brightness (outside the
    scorer's lock, so concurrent requests wait concurrently, as at a paid API)."""

    def __init__(self, latency: float) -> None:
        from flowforge.serve.judge_backends import ScorerBackend

        class Brightness:
            name, needs_group = "brightness", False

            def __call__(self, media, prompts, metadata):
                return media.float().mean(dim=(1, 2, 3))

        self.latency, self.model_id = latency, "bench"
        self.inner = ScorerBackend(Brightness(), self.model_id)

    def complete(self, messages, **kwargs):
        time.sleep(self.latency)
        return self.inner.complete(messages, **kwargs)


def serve(latency: float, token_file: str) -> None:
    """The server process: flowforge's judge app over :class:`LatencyBackend`."""
    from flowforge.serve.common import resolve_token, serve_app
    from flowforge.serve.judge_server import build_app

    serve_app(build_app(LatencyBackend(latency), resolve_token(token_file, False, "127.0.0.1")), "127.0.0.1", 0,
              "judge")


def start_server(latency: float, token_file: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return start_announced([sys.executable, str(Path(__file__).resolve()), "--serve", str(latency), "--token-file",
                            str(token_file)], env, ROOT, "judge server")


def run_arm(url: str, out: Path, name: str, concurrency: int, overlap: bool, steps: int) -> list[dict]:
    from flowforge.config import load_config
    from flowforge.train.trainer import Trainer

    judge = (f"reward.options={{vlm_judge: {{model: bench, base_url: '{url}/v1', api_key_env: {TOKEN_ENV}, "
             f"frames: 1, max_side: 32, max_concurrency: {concurrency}, timeout_s: 120.0}}}}")
    cfg = load_config(str(ROOT / "examples/digits/nft.yaml"), [
        f"run.output_dir={out}", f"run.name={name}", "run.num_threads=1", f"train.steps={steps}",
        "reward.weights={vlm_judge: 1.0}", "reward.required=[vlm_judge]", judge,
        f"reward.overlap={str(overlap).lower()}",
        "eval.every=0", "eval.max_prompts=1", "eval.samples_per_prompt=2", "eval.scorers=[]", "checkpoint.every=0",
        f"data.cache_dir={out / 'cache'}"])
    run_dir = Trainer(cfg, progress=False).train()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]


def summarise(rows: list[dict]) -> dict[str, float]:
    def med(fn):
        return statistics.median(fn(r) for r in rows)

    stages = lambda r: {k: v for k, v in r.items() if k.startswith("time/") and k != "time/reward_wait"}  # noqa
    return {"step": med(lambda r: sum(stages(r).values())),
            "rollout_score": med(lambda r: r["time/sample"] + r["time/reward"]),
            "rollout": med(lambda r: r["time/sample"]),
            "rest": med(lambda r: sum(v for k, v in stages(r).items() if k not in ("time/sample", "time/reward"))),
            "wait": med(lambda r: r["time/reward_wait"]), "overlap": med(lambda r: r["perf/reward_overlap"]),
            "judge": med(lambda r: r["reward/vlm_judge_latency_s"]),
            "mfu": med(lambda r: r["perf/mfu"])}


def schedule_bound(rollout: float, latency: float, concurrency: int, overlap: bool) -> float:
    """The least rollout+score time possible: group ``g`` exists at ``rollout * (g + 1) / G`` when streamed (at
    ``rollout`` otherwise) and takes ``latency`` on one of ``concurrency`` workers, first come first served."""
    free = [0.0] * concurrency
    for g in range(GROUPS):
        ready = rollout * (g + 1) / GROUPS if overlap else rollout
        worker = min(range(concurrency), key=free.__getitem__)
        free[worker] = max(ready, free[worker]) + latency
    return max(free)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latencies", default="0.2,2")
    p.add_argument("--steps", type=int, default=4, help="steps per arm, the first a warm-up")
    p.add_argument("--concurrency", default=str(GROUPS), help="comma-separated max_concurrency values")
    p.add_argument("--rounds", type=int, default=1, help="run every arm this many times, in turn (a shared machine's "
                   "drift then hits every arm alike); medians over all rounds' steps")
    p.add_argument("--serve", type=float, help=argparse.SUPPRESS)
    p.add_argument("--token-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve is not None:
        return serve(args.serve, args.token_file)
    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-overlap-"))
    (tmp / "token").write_text("bench-token")
    os.environ[TOKEN_ENV] = "bench-token"
    arms = [("sequential", 1, False)] + [(name, int(c), overlap) for c in args.concurrency.split(",")
                                         for name, overlap in (("concurrent", False), ("concurrent+overlapped", True))]
    table = []
    try:
        for latency in (float(x) for x in args.latencies.split(",")):
            proc, url = start_server(latency, tmp / "token")
            try:
                rows: dict[int, list[dict]] = {i: [] for i in range(len(arms))}
                for k in range(args.rounds):
                    for i, (name, conc, overlap) in enumerate(arms):
                        rows[i] += run_arm(url, tmp, f"{name}-{conc}-{latency}-{k}", conc, overlap, args.steps)
                results = [(name, conc, overlap, summarise(rows[i])) for i, (name, conc, overlap) in enumerate(arms)]
            finally:
                proc.terminate()
                proc.wait()
            rollout, rest = results[0][3]["rollout"], results[0][3]["rest"]  # the sequential arm's: no scoring beside
            for name, conc, overlap, r in results:
                floor = max(rollout, math.ceil(GROUPS / conc) * latency)
                table.append((latency, name, conc, r, floor, schedule_bound(rollout, latency, conc, overlap), rest))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"main job (examples/digits/nft.yaml, reward digit + vlm_judge), G={GROUPS} groups x 8 per step; medians of "
          f"{args.steps - 1} steps per arm after a warm-up, {args.rounds} round(s); rollout and rest from the "
          "sequential arm")
    print("floor = max(rollout, ceil(G/C) x latency); bound = the least rollout+score when a group can only be sent "
          "once rolled out; step floor = floor + rest (prompts, advantage, optimize)")
    print(f"{'latency':>8} {'arm':<22} {'C':>2} {'roll+score':>10} {'floor':>6} {'ratio':>6} {'bound':>6} {'ratio':>6} "
          f"{'step':>6} {'step floor':>10} {'ratio':>6} {'sample':>6} {'judge':>6} {'wait':>6} {'hidden':>6} "
          f"{'MFU':>6}")
    for latency, name, conc, r, floor, bound, rest in table:
        print(f"{latency:>7.1f}s {name:<22} {conc:>2} {r['rollout_score']:>9.2f}s {floor:>5.2f}s "
              f"{r['rollout_score'] / floor:>6.3f} {bound:>5.2f}s {r['rollout_score'] / bound:>6.3f} "
              f"{r['step']:>5.2f}s {floor + rest:>9.2f}s {r['step'] / (floor + rest):>6.3f} {r['rollout']:>5.2f}s "
              f"{r['judge']:>5.3f}s {r['wait']:>5.2f}s "
              f"{r['overlap']:>6.2f} {r['mfu']:>6.1%}")


if __name__ == "__main__":
    main()
