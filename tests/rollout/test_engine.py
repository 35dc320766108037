"""The worker rollout engine against the local one: same bits, exact first ratio, verified sync, recovery.

Workers are real spawned processes building the tiny SD3 model from its directory; each spawn costs seconds, so the
engines are shared per module and the failure tests run on one engine in a fixed order of independent checks.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from flowforge.rollout import rollout_chunked
from flowforge.rollout.engine import WeightSyncError, WorkerEngine, WorkerLostError, iter_buckets, make_manifest
from flowforge.train.rollout_workers import worker_recipe
from flowforge.train.trainer import Trainer
from tests.train.test_trainer import one_step, tiny_cfg, train_batch

TRAJ_FIELDS = ("sigmas", "final", "latents", "next_latents", "log_probs", "means")


def assert_same_trajectory(a, b):
    assert a.trained_steps == b.trained_steps
    for name in TRAJ_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name


def make_trainer(tiny_model_dir, out, cache, name, *extra):
    return Trainer(tiny_cfg(tiny_model_dir, out, cache, f"run.name={name}", *extra), progress=False)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("engine")


@pytest.mark.slow  # 15-30 s of training on 2 cores: CI runs it in the slow set (the default run stays near 10 min)
def test_lora_workers_match_local_step_by_step_and_the_first_ratio_is_one(tiny_model_dir, out_dir,
                                                                          encode_cache_dir):
    """2 workers, GRPO on LoRA: step 0's trajectory and log-probs equal the local rollout's bit for bit, the first
    update's ratio is exactly 1 on the worker trajectory, and after the optimizer round (weights synced as version 1)
    step 1 matches again -- also after a worker was killed with SIGKILL in between (rebuilt from the committed
    weights, retried)."""
    local = make_trainer(tiny_model_dir, out_dir, encode_cache_dir, "local")
    workers = make_trainer(tiny_model_dir, out_dir, encode_cache_dir, "workers", "rollout.engine=workers",
                           "rollout.num_workers=2")
    try:
        for step in range(2):
            if step == 1:
                os.kill(workers.engine.engine.pids()[1], signal.SIGKILL)
            lb, wb = one_step(local, step), one_step(workers, step)
            assert torch.equal(lb[0].candidate_ids, wb[0].candidate_ids)
            assert_same_trajectory(lb[1], wb[1])
            assert wb[1].log_probs is not None and wb[1].latents is not None
            lm, wm = local.optimize(train_batch(*lb)), workers.optimize(train_batch(*wb))
            assert float(wm["train/first_update_ratio_dev"]) == 0.0
            assert float(wm["train/loss"]) == float(lm["train/loss"])
            m = workers.engine.metrics()
            assert m["train/policy_version"] == step
            assert m["train/weight_sync_tensors"] == len(workers.policy.named_weights("live"))
            assert m["train/weight_sync_mb"] > 0 and m["time/weight_sync"] > 0
        assert m["train/worker_restarts"] == 1 and m["train/weight_sync_failures"] == 1
        for k, v in local.policy.named_weights("live").items():
            assert torch.equal(v, workers.policy.named_weights("live")[k]), k
    finally:
        workers.engine.close()


def test_full_finetune_off_policy_workers_match_local(tiny_model_dir, out_dir, encode_cache_dir):
    """Full fine-tuning (every tensor synced) with DiffusionNFT, which samples with the old policy: the worker's
    samples equal the local ones at step 0 and after the old policy moved."""
    extra = ("lora.trainable=full", "train.lr=1e-4", "train.algorithm=nft", "forward.decay_rate=0.5")
    local = make_trainer(tiny_model_dir, out_dir, encode_cache_dir, "nft-local", *extra)
    workers = make_trainer(tiny_model_dir, out_dir, encode_cache_dir, "nft-workers", *extra,
                           "rollout.engine=workers")
    assert workers.objective.sampling_policy == "old" and not workers.engine.on_policy
    try:
        for step in range(2):
            lb, wb = one_step(local, step), one_step(workers, step)
            assert_same_trajectory(lb[1], wb[1])
            local.optimize(train_batch(*lb))
            workers.optimize(train_batch(*wb))
        m = workers.engine.metrics()
        assert m["train/weight_sync_tensors"] == len(workers.adapter.transformer.state_dict())
    finally:
        workers.engine.close()


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir, out_dir, encode_cache_dir):
    """A local LoRA trainer (the reference and the source of weights) and a 1-worker engine built from its recipe."""
    trainer = make_trainer(tiny_model_dir, out_dir, encode_cache_dir, "engine-ref")
    engine = WorkerEngine(worker_recipe(trainer.cfg, trainer.policy, "cpu"), num_workers=1, bucket_mb=0.01)
    yield trainer, engine
    engine.close()


def _moved_weights(trainer, scale):
    """LoRA weights with every tensor moved (B is 0 at init, so a rollout would not show the difference)."""
    g = torch.Generator().manual_seed(int(scale * 100))
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in trainer.policy.named_weights("live").items()}


def _local_rollout(trainer, weights, cond, ids, spec):
    saved = trainer.policy.named_weights("live")
    trainer.policy.load_named_weights("live", weights)
    try:
        return rollout_chunked(trainer.adapter, cond, ids, trainer.sigmas, spec, latent_shape=trainer.latent_shape,
                               seed=trainer.cfg.run.seed, batch_size=2)
    finally:
        trainer.policy.load_named_weights("live", saved)


def _batch(trainer):
    sb = trainer.next_prompts()
    return trainer.train_cond.index(sb.prompt_indices), sb.candidate_ids.tolist(), trainer.objective.rollout_spec(0)


def _engine_rollout(trainer, engine, cond, ids, spec):
    return engine.rollout(cond, ids, trainer.sigmas, spec, latent_shape=trainer.latent_shape,
                          seed=trainer.cfg.run.seed, batch_size=2)


def test_failed_syncs_are_refused_rolled_back_and_retried(lora_engine):
    trainer, engine = lora_engine
    cond, ids, spec = _batch(trainer)
    with pytest.raises(WeightSyncError, match="no committed policy version"):
        _engine_rollout(trainer, engine, cond, ids, spec)
    good = _moved_weights(trainer, 0.05)
    engine.sync(good, 1)
    assert engine.version == 1 and engine.failures == 0
    worker = engine.workers[0]

    # manifest mismatch: a tensor too many (refused at the manifest; the worker keeps version 1)
    extra = {**good, "blocks.extra.lora_A.weight": torch.zeros(2, 2)}
    with pytest.raises(WeightSyncError, match="not in the worker"):
        engine.sync(extra, 2)
    # a full sync into a worker holding LoRA layers is refused, never skipped
    full = dict(trainer.adapter.transformer.state_dict())
    with pytest.raises(WeightSyncError, match="full weight sync of version 2 refused: the worker holds LoRA"):
        engine.sync(full, 2, mode="full")
    assert engine.version == 1 and engine.failures == 2
    assert worker.submit("info").result()["version"] == 1

    # truncated bucket and a manifest whose checksum the bytes do not match, streamed straight to the worker
    moved = _moved_weights(trainer, 0.1)
    manifest = make_manifest(moved, version=2, mode="adapter", bucket_bytes=engine.bucket_bytes)
    buckets = list(iter_buckets(moved, manifest))
    assert len(buckets) > 2
    lying = make_manifest(good, version=2, mode="adapter", bucket_bytes=engine.bucket_bytes)
    for man, stream, expected in ((manifest, [*buckets[:-1], buckets[-1][:-3]], "truncated"),
                                  (lying, buckets, "does not match the manifest's")):
        worker.submit("sync_begin", man).result()
        for i, data in enumerate(stream):
            worker.cast("sync_bucket", i, data)
        with pytest.raises(WeightSyncError, match=expected):
            worker.submit("sync_verify").result()
        with pytest.raises(WeightSyncError, match="commit without a verified sync"):
            worker.submit("sync_commit").result()
        assert worker.submit("info").result()["version"] == 1

    # still version 1's weights: the rollout equals the local one under them
    traj, version = _engine_rollout(trainer, engine, cond, ids, spec)
    assert version == 1
    assert_same_trajectory(traj, _local_rollout(trainer, good, cond, ids, spec))
    # the retry of version 2 goes through and is what the worker rolls out with
    engine.sync(moved, 2)
    traj, version = _engine_rollout(trainer, engine, cond, ids, spec)
    assert version == 2
    assert_same_trajectory(traj, _local_rollout(trainer, moved, cond, ids, spec))


def test_killed_worker_raises_then_is_rebuilt_from_the_committed_weights(lora_engine):
    trainer, engine = lora_engine
    cond, ids, spec = _batch(trainer)
    weights = _moved_weights(trainer, 0.2)
    engine.sync(weights, 7)
    old_pid = engine.pids()[0]
    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(WorkerLostError, match=f"rollout worker 0 \\(pid {old_pid}\\) ended: killed by SIGKILL"):
        _engine_rollout(trainer, engine, cond, ids, spec)
    assert engine.rebuild() == 1
    assert engine.pids()[0] != old_pid and engine.version == 7
    traj, version = _engine_rollout(trainer, engine, cond, ids, spec)
    assert version == 7
    assert_same_trajectory(traj, _local_rollout(trainer, weights, cond, ids, spec))
    assert engine.workers[0].submit("info").result()["threads"] == 1


KILLED_RUN = """
import os, signal, sys
from flowforge.config import load_config
from flowforge.train import checkpoint
from flowforge.train.trainer import Trainer

seen = []
def die(stage, relpath):  # step 3's checkpoint half written: kill -9 the trainer (its workers are left behind)
    if stage == "tmp" and str(relpath).startswith("weights"):
        seen.append(relpath)
        if len(seen) == 3:
            print("worker pids", *trainer.engine.engine.pids(), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save._test_hook = die
trainer = Trainer(load_config(sys.argv[1]), progress=False)
trainer.train()
"""


def _gone(pid, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow  # a multi-process end-to-end run (tens of seconds): CI runs it after the default set
def test_resume_after_kill_9_with_workers_equals_the_uninterrupted_run(tiny_model_dir, out_dir, encode_cache_dir):
    """A workers run killed with SIGKILL while writing step 3's checkpoint leaves no worker behind; resumed from
    step 2 (fresh workers built from the committed weights) it ends with the weights, optimizer state and metrics of
    an uninterrupted run (a local one: the engines agree bit for bit)."""
    from flowforge.config import dump_config
    from flowforge.train import checkpoint as ckpt
    from tests.train.test_resume import _assert_same, _rows, _state

    extra = ("train.steps=3", "checkpoint.every=1", "eval.every=0", "train.lr_schedule=cosine")
    whole = make_trainer(tiny_model_dir, out_dir, encode_cache_dir, "whole", *extra)
    whole.train()
    cfg = tiny_cfg(tiny_model_dir, out_dir, encode_cache_dir, "run.name=killed", *extra, "rollout.engine=workers")
    (out_dir / "killed.yaml").write_text(dump_config(cfg))
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN, str(out_dir / "killed.yaml")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split("worker pids", 1)[1].split()]
    assert pids and all(_gone(pid) for pid in pids)  # orphaned workers see the pipe close and exit
    run_dir = out_dir / "killed"
    assert ckpt.resolve_resume(run_dir, "auto")[0].name == "step_000002"
    resumed = Trainer(tiny_cfg(tiny_model_dir, out_dir, encode_cache_dir, "run.name=killed", *extra,
                               "rollout.engine=workers", "train.resume=auto"), progress=False)
    assert resumed.step == 2
    resumed.train()
    assert not resumed.engine.engine.started  # stopped at the end of train()
    _assert_same(_state(whole), _state(resumed))
    expected = _rows(whole.run_dir)
    got = sorted({r["step"]: r for r in _rows(run_dir)}.values(), key=lambda r: r["step"])  # resumed step 3 wins
    assert [r["train/policy_version"] for r in got] == [0, 1, 2]
    assert [{k: r[k] for k in e} for e, r in zip(expected, got)] == expected
