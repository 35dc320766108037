"""Judge request throughput: the ``vlm_judge`` ledger path vs the same requests sent directly.

    python bench/bench_judge.py [--groups 40] [--k 4] [--size 256] [--frames 1] [--concurrency 1]

Starts ``flowforge serve judge --scorer bench_judge:MeanBrightness`` on loopback (a cheap scorer, so the server is
not the bottleneck) and measures, one arm after the other in this process:

* **direct**: the ``openai`` client posting prepared requests (data URLs already built), nothing else;
* **ledger, new**: ``vlm_judge`` on groups it has never seen: JPEG encoding, hashing, the permutation, the ledger
  lookup, the HTTP request, the durable ledger insert (fsync) and keeping the frames on disk;
* **ledger, answered**: the same groups again, every one served from the ledger (nothing sent).

Prints requests (groups) per second of each arm and the ratios to direct.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TOKEN_ENV = "FF_BENCH_JUDGE_TOKEN"


class MeanBrightness:
    """Mean pixel value per image: the cheapest content-dependent scorer."""

    name = "mean_brightness"
    needs_group = False

    def __call__(self, media, prompts, metadata):
        return media.float().mean(dim=(1, 2, 3))


def start_server(token_file: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flowforge.cli", "serve", "judge", "--scorer",
                             "bench_judge:MeanBrightness", "--model-name", "bench", "--port", "0", "--token-file",
                             str(token_file), "--num-threads", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        ready = [line for line in lines if line.startswith("serving ")]
        if ready:
            return proc, ready[0].rsplit(" at ", 1)[1].strip()
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("the judge server did not start")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=40)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--frames", type=int, default=1, help=">1: videos of this many frames")
    p.add_argument("--concurrency", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    import openai

    from flowforge.rewards.judge.client import VLMJudge

    tmp = Path(tempfile.mkdtemp(prefix="bench-judge-"))
    (tmp / "token").write_text("bench-token")
    os.environ[TOKEN_ENV] = "bench-token"
    proc, url = start_server(tmp / "token")
    try:
        g = torch.Generator().manual_seed(0)
        shape = (args.k, 3, args.size, args.size) if args.frames == 1 else (args.k, 3, args.frames, args.size,
                                                                             args.size)
        groups = [(torch.rand(shape, generator=g), [f"prompt {i}"] * args.k, [{}] * args.k)
                  for i in range(args.groups)]

        def judge(run: str) -> VLMJudge:
            return VLMJudge(model="bench", base_url=url + "/v1", api_key_env=TOKEN_ENV, run_dir=tmp / run,
                            frames=args.frames, max_concurrency=args.concurrency)

        prepared = [judge("prep")._prepare(*group).content for group in groups]
        client = openai.OpenAI(base_url=url + "/v1", api_key="bench-token", max_retries=0)
        client.chat.completions.create(model="bench", messages=[{"role": "user", "content": prepared[0]}])  # warm

        t0 = time.perf_counter()
        for content in prepared:
            client.chat.completions.create(model="bench", messages=[{"role": "user", "content": content}],
                                           temperature=0.0, max_tokens=512)
        direct = time.perf_counter() - t0
        ours = judge("run")
        t0 = time.perf_counter()
        ours.score_groups(groups)
        new = time.perf_counter() - t0
        sent = ours.pop_metrics()["requests_sent"]
        t0 = time.perf_counter()
        ours.score_groups(groups)
        answered = time.perf_counter() - t0
        served = ours.pop_metrics()["served_from_ledger"]
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    n = args.groups
    print(f"{n} groups of {args.k} x {args.frames} frame(s) at {args.size}px, concurrency {args.concurrency}")
    print(f"direct            {n / direct:8.1f} requests/s")
    print(f"ledger, new       {n / new:8.1f} requests/s ({int(sent)} sent), ratio to direct {direct / new:.3f}")
    print(f"ledger, answered  {n / answered:8.1f} groups/s ({int(served)} served), ratio to direct "
          f"{direct / answered:.3f}")


if __name__ == "__main__":
    main()
