"""torchrun with 2 processes on gloo: DDP and FSDP2 match the single-process run; DCP checkpoints resume; two
"nodes" (two torchrun launches joined by c10d rendezvous on loopback) match it too."""

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def _overrides(model_dir, out_dir, cache_dir, name, *extra):
    return [f"model.path={model_dir}", f"run.output_dir={out_dir}", f"run.name={name}", f"data.cache_dir={cache_dir}",
            "data.prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "sampler.num_sde_steps=2",
            "train.micro_batch_size=2", "train.num_updates_per_batch=1", "train.allow_unit_ratio=true",
            "train.steps=2", "train.lr=1e-3", "eval.every=0", "eval.max_prompts=2", "eval.samples_per_prompt=2",
            "run.num_threads=1", *extra]


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _run(out, stop_at, overrides, nproc):
    env = _env()
    if nproc == 1:
        cmd = [sys.executable, str(WORKER)]
    else:  # torchrun's module through this interpreter: works without an activated venv (no `torchrun` on PATH)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(WORKER)]
    proc = subprocess.run(cmd + [str(out), str(stop_at), *overrides], env=env, capture_output=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(nproc)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_nodes(out, overrides, nnodes=2):
    """Launch ``nnodes`` separate torchrun agents of one process each, as on ``nnodes`` machines, joined by c10d
    rendezvous on loopback (the commands docs/scaling.md gives users); returns every rank's record."""
    endpoint, rdzv_id = f"127.0.0.1:{_free_port()}", uuid.uuid4().hex[:12]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                               f"--node_rank={node}", "--nproc_per_node=1", "--rdzv_backend=c10d",
                               f"--rdzv_endpoint={endpoint}", f"--rdzv_id={rdzv_id}", str(WORKER), str(out), "0",
                               *overrides], env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for node in range(nnodes)]
    try:
        outputs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, (p, (_, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node}: {err.decode()[-3000:]}"
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(nnodes)]


def _by_candidate(records):
    ids = torch.cat([r["candidate_ids"] for r in records])
    adv = torch.cat([r["advantages"] for r in records])
    return dict(zip(ids.tolist(), adv.tolist()))


def _losses(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tiny_model_dir, tmp_path_factory, encode_cache_dir):
    out = tmp_path_factory.mktemp("single")
    records = _run(out / "rec", 0, _overrides(tiny_model_dir, out, encode_cache_dir, "one",
                                              "train.algorithm=nft"), 1)
    return records, _losses(out / "one")


@pytest.mark.slow  # a multi-process end-to-end run (tens of seconds): CI runs it after the default set
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_match_single_process(single, tiny_model_dir, tmp_path, encode_cache_dir, strategy):
    ref_records, ref_rows = single
    records = _run(tmp_path / "rec", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "two",
                                                   "train.algorithm=nft", f"distributed.strategy={strategy}"), 2)
    _assert_matches_single(records, ref_records, _losses(tmp_path / "two"), ref_rows)


def _assert_matches_single(records, ref_records, rows, ref_rows):
    """Two ranks' ``records`` / metric ``rows`` against the single process's: the same candidates with the same
    advantages, no noise shared across ranks, the same global metrics and the same weights on both ranks."""
    # every candidate trained with the same advantage as in the single-process run
    got, want = _by_candidate(records), _by_candidate(ref_records)
    assert got.keys() == want.keys() and len(got) == 16
    for cid in want:
        assert got[cid] == pytest.approx(want[cid], rel=1e-4, abs=1e-5)
    # candidates on different ranks (including the same group's) never share noise
    a, b = records[0]["finals"].flatten(1), records[1]["finals"].flatten(1)
    assert torch.cdist(a, b).min() > 1e-3
    assert not set(records[0]["candidate_ids"].tolist()) & set(records[1]["candidate_ids"].tolist())
    # same loss and gradient norm (global means) and the same weights afterwards
    assert len(rows) == len(ref_rows) == 2
    for key in ("train/loss", "train/grad_norm", "reward/total_mean"):
        for r, ref in zip(rows, ref_rows):
            assert r[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), key
    for k, v in ref_records[0]["live"].items():
        torch.testing.assert_close(records[0]["live"][k], v, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(records[1]["live"][k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # two torchrun agents and an end-to-end run (tens of seconds): CI runs it after the default set
def test_two_nodes_by_c10d_rendezvous_match_single_process(single, tiny_model_dir, tmp_path, encode_cache_dir):
    """Two torchrun launches (``--nnodes 2 --node_rank 0|1 --nproc_per_node 1``, c10d rendezvous on 127.0.0.1), as
    users start two machines (torchrun ignores ``--node_rank`` under c10d: the rendezvous assigns the ranks): the
    same candidates, advantages, metrics and weights as the single process."""
    ref_records, ref_rows = single
    records = _run_nodes(tmp_path / "rec", _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "nodes",
                                                      "train.algorithm=nft", "distributed.strategy=ddp"))
    _assert_matches_single(records, ref_records, _losses(tmp_path / "nodes"), ref_rows)


@pytest.mark.slow  # a multi-process end-to-end run (tens of seconds): CI runs it after the default set
def test_full_fine_tuning_nft_under_fsdp_matches_ddp(tiny_model_dir, tmp_path, encode_cache_dir):
    """DiffusionNFT with full fine-tuning keeps a whole old-policy copy on every rank while FSDP shards live: the
    old <- decay * old + (1 - decay) * live blend gathers live, and both strategies end with the same weights."""
    extra = ("train.algorithm=nft", "lora.trainable=full", "forward.decay_rate=0.25")
    runs = {s: _run(tmp_path / s, 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, s, *extra,
                                                f"distributed.strategy={s}"), 2) for s in ("ddp", "fsdp")}
    for k, v in runs["ddp"][0]["live"].items():
        torch.testing.assert_close(runs["fsdp"][0]["live"][k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # a multi-process end-to-end run (tens of seconds): CI runs it after the default set
def test_fsdp_dcp_checkpoint_written_by_two_ranks_resumes(tiny_model_dir, tmp_path, encode_cache_dir):
    extra = ["train.algorithm=grpo", "distributed.strategy=fsdp", "checkpoint.every=1", "train.steps=2"]
    full = _run(tmp_path / "full", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "full", *extra), 2)
    _run(tmp_path / "part", 1, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "part", *extra), 2)
    step1 = tmp_path / "part" / "checkpoints" / "step_000001"
    assert (step1 / "COMMITTED").is_file()
    assert (step1 / "dcp" / ".metadata").is_file() and len(list((step1 / "dcp").glob("*.distcp"))) == 2
    resumed = _run(tmp_path / "res", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "part", *extra,
                                                   "train.resume=auto"), 2)
    for k, v in full[0]["live"].items():
        assert torch.equal(resumed[0]["live"][k], v), k
    assert _losses(tmp_path / "part")[-1]["train/loss"] == _losses(tmp_path / "full")[-1]["train/loss"]


@pytest.mark.slow  # a multi-process end-to-end run (tens of seconds): CI runs it after the default set
def test_nft_guard_pads_the_rank_that_skipped_and_matches_single_process(tiny_model_dir, tmp_path,
                                                                          encode_cache_dir):
    """With ``nft.guard`` a rank can keep fewer rows than another: at step 2 the guard skips rank 1's only group
    while rank 0 trains its own, so rank 1 backpropagates zero-weight padding (same forwards / backwards, no hang)
    and the result equals the single-process run, where the skipped group is simply dropped."""
    # the case needs a group whose reward spread falls under the threshold at step 2: pinned to the demo's first 180
    # prompts (its first 18 phrasings), so that phrasings appended to demo:train do not move which groups are drawn
    from flowforge.demo.prompts import prompt_file

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(prompt_file("train").read_text().splitlines(keepends=True)[:180]))
    extra = ("train.algorithm=nft", "nft.guard=true", "nft.guard_min_spread=0.0005", f"data.prompts={prompts}")
    ref = _run(tmp_path / "ref", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "one", *extra), 1)
    ref_rows = _losses(tmp_path / "one")
    assert [r["train/guard_skipped_groups"] for r in ref_rows] == [0.0, 1.0]  # the case under test happens
    records = _run(tmp_path / "rec", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "two", *extra,
                                                   "distributed.strategy=ddp"), 2)
    rows = _losses(tmp_path / "two")
    assert [r["step"] for r in rows] == [1, 2]
    for r, want in zip(rows, ref_rows):  # metrics are reduced over every rank's trained rows / summed counts
        for key in ("train/loss", "train/r_mean", "train/guard_skipped_groups", "train/grad_norm"):
            assert r[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
    for k, v in ref[0]["live"].items():
        torch.testing.assert_close(records[0]["live"][k], v, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(records[1]["live"][k], v, rtol=1e-4, atol=1e-6)


def _reduce_worker(rank, init_file, out_dir):
    import math

    import torch.distributed as dist

    from flowforge.runtime import distributed as dist_lib

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    info = dist_lib.DistInfo(rank=rank, world_size=2)
    # diversity-like value missing on rank 1, a value on both ranks, a value missing everywhere
    got = dist_lib.mean_across_ranks({"a": 1.0 if rank == 0 else math.nan, "b": 2.0 * rank, "c": math.nan}, info)
    try:
        dist_lib.mean_across_ranks({"x": 1.0} if rank == 0 else {"y": 1.0}, info)
        mismatch = ""
    except RuntimeError as exc:
        mismatch = str(exc)
    dist.destroy_process_group()
    torch.save({"got": got, "mismatch": mismatch}, f"{out_dir}/r{rank}.pt")


def test_mean_across_ranks_skips_nan_and_refuses_different_keys(tmp_path):
    import math

    import torch.multiprocessing as mp

    mp.spawn(_reduce_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        out = torch.load(tmp_path / f"r{rank}.pt", weights_only=False)
        assert out["got"]["a"] == 1.0 and out["got"]["b"] == 1.0 and math.isnan(out["got"]["c"])
        assert "ranks hold different metric keys" in out["mismatch"] and "'x'" in out["mismatch"]
