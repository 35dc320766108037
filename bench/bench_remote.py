"""Remote-scorer overhead: a batch scored through ``flowforge serve reward`` vs the same scorer in process.

    python bench/bench_remote.py [--images 32] [--sizes 32,256] [--scorers digit,jpeg_compressibility]
                                 [--repeats 10] [--encoding auto]

Starts the server on loopback (a free port, a token) with ``--num-threads 1``, then for each image size and scorer
times, alternating the two arms (one warm-up each):

* **in process**: ``build_scorer(name)(media, prompts, metadata)``;
* **remote**: the ``remote`` scorer on the same batch (encoding, HTTP on loopback, decoding, the same scorer in the
  server, JSON back).

Off-grid float images go as float32 (``--encoding auto``, lossless); ``--encoding png`` rounds to bytes and sends
less. Prints the median times and the ratio remote / in process; the scores are checked to be equal first. Runs
on the CPU; timings are printed, never asserted.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleave, start_announced  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN_ENV = "FF_BENCH_REWARD_TOKEN"


def start_server(scorers: str, token_file: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "flowforge.cli", "serve", "reward", "--scorers", scorers, "--port", "0",
           "--token-file", str(token_file), "--num-threads", "1", "--max-body-mb", "512"]
    return start_announced(cmd, {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, ROOT, "reward server")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--sizes", default="32,256")
    parser.add_argument("--scorers", default="digit,jpeg_compressibility")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--encoding", default="auto", choices=("auto", "png", "float32"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # the server scores on one thread too: the comparison is per core

    from flowforge.rewards.registry import build_scorer
    from flowforge.rewards.scorers.remote import RemoteScorer

    names = [n for n in args.scorers.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "token"
        token_file.write_text("bench-token\n")
        os.environ[TOKEN_ENV] = "bench-token"
        proc, url = start_server(args.scorers, token_file)
        try:
            print(f"server {url}; {args.images} images per call, encoding {args.encoding}, median of {args.repeats}")
            for size in (int(s) for s in args.sizes.split(",")):
                media = torch.rand(args.images, 3, size, size, generator=torch.Generator().manual_seed(0))
                prompts = [f"the number {i % 10}" for i in range(args.images)]
                meta = [{"digit": i % 10} for i in range(args.images)]
                for name in names:
                    local = build_scorer(name)
                    remote = RemoteScorer(url, [name], token_env=TOKEN_ENV, batch_size=args.images,
                                          encoding=args.encoding, retries=0)
                    same = torch.equal(local(media, prompts, meta), remote(media, prompts, meta))
                    t_local, t_remote = interleave(lambda: local(media, prompts, meta),
                                                   lambda: remote(media, prompts, meta), args.repeats)
                    ml, mr = statistics.median(t_local), statistics.median(t_remote)
                    print(f"{name:>22} {size:>4}px: in process {ml * 1e3:8.1f} ms, remote {mr * 1e3:8.1f} ms, "
                          f"ratio {mr / ml:6.2f}, overhead {(mr - ml) * 1e3:7.1f} ms, identical scores: {same}")
                    remote.close()
        finally:
            proc.terminate()
            proc.wait(15)


if __name__ == "__main__":
    main()
