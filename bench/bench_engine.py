"""Rollout engine: samples/s of the local rollout vs 1 and 2 rollout workers, and weight-sync time per MB.

    python bench/bench_engine.py [--repeats 5]

All arms roll out the same step (the embedded default's M x K candidates, chunked like the micro-batches) with the
same weights; the worker arms are checked bit-identical to the local one before timing. The local arm runs in this
process with 2 threads, each worker with ``rollout.threads`` = 1; the arms are timed alternately in one run, so
drift on a shared machine hits all alike. Printed: samples/s per arm and its ratio to local; the weight sync in
ms per MiB of the run's trainable tensors (full mode: the embedded default trains the whole transformer) and of LoRA
tensors (adapter mode, a rank-8 LoRA on the same model), with the bucket size used.
"""

import argparse
import dataclasses
import shutil
import statistics
import tempfile
import time

import torch

from common import build, timed
from flowforge.demo.paths import resolve_demo_path
from flowforge.models import build_adapter
from flowforge.models import lora as lora_lib
from flowforge.rollout import rollout_chunked
from flowforge.rollout.engine import WorkerEngine
from flowforge.train.rollout_workers import worker_recipe


def _same(a, b) -> bool:
    return all((getattr(a, f) is None and getattr(b, f) is None) or torch.equal(getattr(a, f), getattr(b, f))
               for f in ("final", "latents", "next_latents", "log_probs"))


def _sync_ms_per_mb(engine, weights, repeats):
    times = []
    for v in range(repeats):
        stats = engine.sync(weights, 100 + v)
        times.append(stats["seconds"] * 1e3 / stats["mb"])
    return statistics.median(times), stats["mb"], stats["tensors"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    args = p.parse_args()
    out = tempfile.mkdtemp(prefix="flowforge-bench-engine-")  # a fresh run directory, removed at the end
    try:
        run(args, build([f"run.output_dir={out}"]))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run(args, tr) -> None:
    sb = tr.next_prompts()
    spec = tr.objective.rollout_spec(0)
    cond = tr.train_cond.index(sb.prompt_indices)
    ids = sb.candidate_ids.tolist()
    mb = tr.cfg.train.micro_batch_size
    kw = dict(latent_shape=tr.latent_shape, seed=tr.cfg.run.seed, batch_size=mb)
    recipe = worker_recipe(tr.cfg, tr.policy, "cpu")
    weights = tr.policy.named_weights("live")
    engines = {n: WorkerEngine(recipe, num_workers=n, bucket_mb=args.bucket_mb) for n in (1, 2)}
    t0 = time.perf_counter()
    for engine in engines.values():
        engine.sync(weights, 0)
    print(f"started {sum(engines)} workers and synced in {time.perf_counter() - t0:.1f} s")

    def local():
        return rollout_chunked(tr.adapter, cond, ids, tr.sigmas, spec, **kw)

    arms = {"local": local}
    for n, engine in engines.items():
        arms[f"{n} worker{'s' * (n > 1)}"] = (lambda e: lambda: e.rollout(cond, ids, tr.sigmas, spec, **kw)[0])(engine)
    reference = local()
    for name, fn in arms.items():
        assert name == "local" or _same(fn(), reference), f"{name}: not bit-identical to the local rollout"
    times = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, fn in arms.items():
            times[name] += timed(fn, 1)
    base = len(ids) / statistics.median(times["local"])
    print(f"rollout of {len(ids)} candidates ({len(tr.sigmas) - 1} steps, chunks of {mb}), median of "
          f"{args.repeats}; worker arms bit-identical to local")
    for name, t in times.items():
        rate = len(ids) / statistics.median(t)
        print(f"  {name:>9}: {rate:7.1f} samples/s  ratio to local {rate / base:.3f}")

    for n, engine in engines.items():
        ms, size, count = _sync_ms_per_mb(engine, weights, args.repeats)
        print(f"weight sync, {recipe.sync_mode} mode ({count} tensors, {size:.2f} MiB, buckets of {args.bucket_mb} "
              f"MiB, {n} worker{'s' * (n > 1)}): {ms:.1f} ms/MiB")
        engine.close()
    # the other mode: LoRA (rank 8 on the adapter's default targets) into a LoRA worker, adapter tensors only
    m = tr.cfg.model
    lora_model = build_adapter(m.adapter, resolve_demo_path(m.path), task=m.task, dtype=torch.float32, device="cpu")
    targets = tuple(lora_model.lora_targets)
    lora_lib.inject_lora(lora_model.transformer, 8, 8.0, targets)
    lora = {k: v.detach() for k, v in lora_lib.lora_parameters(lora_model.transformer, "default").items()}
    with WorkerEngine(dataclasses.replace(recipe, trainable="lora", lora_rank=8, lora_alpha=8.0,
                                          lora_targets=targets), num_workers=1, bucket_mb=args.bucket_mb) as engine:
        ms, size, count = _sync_ms_per_mb(engine, lora, args.repeats)
    print(f"weight sync, adapter mode ({count} LoRA tensors, {size:.3f} MiB, buckets of {args.bucket_mb} MiB, "
          f"1 worker): {ms:.1f} ms/MiB")


if __name__ == "__main__":
    main()
