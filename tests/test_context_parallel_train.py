"""GRPO on tiny Wan 2.1 with context parallelism (Ulysses 2 on 2 gloo ranks under torchrun) against one process: the
first ratio is exactly 1, the losses, rewards and weights are the single process's, both ranks of the context group
train the same candidates, and a checkpoint written under context parallelism resumes on one process without it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def brightness(media, prompts, metadata):
    """A reward continuous in the pixels (``[B]`` mean of ``media`` ``[B, 3, H, W]``): JPEG sizes jump with a
    float's last bit, so runs equal to 1e-7 could still be ranked differently by them."""
    return media.float().mean(dim=(1, 2, 3))


@pytest.fixture(scope="module")
def wan_setup(tmp_path_factory):
    """A saved tiny Wan 2.1 pipeline and t2v prompt files."""
    import diffusers

    from tests.train.test_families_loop import _components

    root = tmp_path_factory.mktemp("cp_train")
    diffusers.WanPipeline(**_components("wan")).save_pretrained(str(root / "wan"))
    words = ["a red cat", "two dogs under a tree", "a blue car on a road", "a small boat on the sea",
             "a white bird in the sky", "an old house"]
    for split, chosen in (("train", words[:4]), ("eval", words[4:])):
        (root / f"{split}.jsonl").write_text("".join(
            json.dumps({"prompt": p, "metadata": {"task": "t2v", "sample_id": f"{split}{i}"}}) + "\n"
            for i, p in enumerate(chosen)))
    return root


def _overrides(root, name, *extra):
    # 32 x 32 x 5 frames: latent [4, 2, 4, 4], 8 tokens after Wan's 1 x 2 x 2 patches (4 per rank)
    return [f"model.path={root / 'wan'}", "model.adapter=wan", "model.task=t2v", "model.height=32", "model.width=32",
            "model.frames=5", f"run.output_dir={root / 'runs'}", f"run.name={name}", f"data.cache_dir={root / 'cache'}",
            f"data.prompts={root / 'train.jsonl'}", f"data.eval_prompts={root / 'eval.jsonl'}",
            "data.prompts_per_step=2", "data.group_size=2", "sampler.num_steps=4", "sampler.num_sde_steps=2",
            "sampler.schedule=wan", "sampler.guidance_scale=5.0", "train.algorithm=grpo", "train.micro_batch_size=2",
            "train.num_updates_per_batch=2", "train.steps=2", "train.lr=1e-2", "grpo.clip_low=1e-3",
            "eval.every=0", "eval.max_prompts=2", "reward.weights={'tests.test_context_parallel_train:brightness': 1.0}",
            "run.num_threads=1", "checkpoint.every=1",
            # Adam divides each step by |gradient|: on the LoRA A weights, whose gradient is ~0 at step 2 (B was 0 at
            # step 1), 1e-7 of summation-order noise became 1e-2 relative with the default eps; this eps keeps the
            # steps' comparison about the gradients
            "train.adam_eps=1e-4", *extra]


def _run(out, stop_at, overrides, nproc):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(WORKER)] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(WORKER)]
    proc = subprocess.run(cmd + [str(out), str(stop_at), *overrides], env=env, capture_output=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(nproc)]


def _rows(root, name):
    return [json.loads(line) for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # three small training runs, one on 2 ranks (about a minute on 2 loaded cores)
def test_grpo_under_ulysses_matches_one_process_and_resumes_without_it(wan_setup, tmp_path):
    root = wan_setup
    one = _run(tmp_path / "one", 0, _overrides(root, "one"), 1)
    two = _run(tmp_path / "cp", 0, _overrides(root, "cp", "distributed.context_parallel.ulysses=2"), 2)
    # both ranks of the context group trained the same candidates, with the single process's advantages
    for rec in two:
        assert torch.equal(rec["candidate_ids"], one[0]["candidate_ids"])
        torch.testing.assert_close(rec["advantages"], one[0]["advantages"], rtol=1e-5, atol=1e-6)
    rows, ref = _rows(root, "cp"), _rows(root, "one")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/first_update_ratio_dev"] == 0.0
    for r, want in zip(rows, ref):
        for key in ("train/loss", "reward/total_mean", "train/grad_norm"):
            assert r[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    diff = max(float((two[0]["live"][k] - v).abs().max()) for k, v in one[0]["live"].items())
    assert diff < 1e-6, diff  # measured 3.7e-7
    for k, v in one[0]["live"].items():
        torch.testing.assert_close(two[0]["live"][k], v, rtol=1e-5, atol=1e-6)
        assert torch.equal(two[1]["live"][k], two[0]["live"][k])
    # a checkpoint written under context parallelism (step 1) resumes on one process without it
    _run(tmp_path / "part", 1, _overrides(root, "part", "distributed.context_parallel.ulysses=2"), 2)
    resumed = _run(tmp_path / "res", 0, _overrides(root, "part", "train.resume=auto"), 1)
    assert [r["step"] for r in _rows(root, "part")] == [1, 2]
    # it trained step 2 only (the single process's step-2 candidates): it resumed, it did not start over
    assert torch.equal(resumed[0]["candidate_ids"], one[0]["candidate_ids"][4:])
    assert _rows(root, "part")[-1]["train/loss"] == pytest.approx(ref[-1]["train/loss"], rel=1e-5, abs=1e-7)
    for k, v in one[0]["live"].items():
        torch.testing.assert_close(resumed[0]["live"][k], v, rtol=1e-5, atol=1e-6)
