"""The CPU tests' invariants on a GPU, in bf16 where training runs in bf16: the first GRPO ratio is exactly 1, the
rollout engine's log-probs equal the trainer's bit for bit, FSDP2 over a one-rank NCCL group computes what the bare
module computes, and a checkpoint written from CUDA tensors restores them exactly.

All on the tiny SD3 model (``tiny_model_dir``), skipped without CUDA (``tests/gpu/conftest.py``).
"""

import copy
import socket

import pytest
import torch
import torch.distributed as dist

# flowforge and the CPU tests' helpers are imported inside the tests: without CUDA every test here is skipped at
# collection, and the collection then costs no model-library imports (bench/gpu_acceptance.py runs it everywhere)

pytestmark = pytest.mark.gpu

BF16 = ("model.dtype=bfloat16",)


@pytest.fixture
def make(tiny_model_dir, tmp_path, encode_cache_dir, device):
    from flowforge.train.trainer import Trainer
    from tests.train.test_trainer import tiny_cfg

    def build(name, *extra):
        cfg = tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, f"run.name={name}", f"run.device={device}", *extra)
        return Trainer(cfg, progress=False)
    return build


@pytest.mark.parametrize("trainable", ["lora", "full"])
def test_grpo_first_update_ratio_is_exactly_one_in_bf16(make, device, trainable):
    from tests.train.test_trainer import one_step, train_batch

    extra = ("lora.trainable=full", "train.lr=1e-4") if trainable == "full" else ()
    trainer = make(trainable, *BF16, *extra)
    assert trainer.device.type == device and next(trainer.adapter.transformer.parameters()).is_cuda == (
        device == "cuda")
    metrics = trainer.optimize(train_batch(*one_step(trainer)))
    assert float(metrics["train/first_update_ratio_dev"]) == 0.0
    # the second update ran on moved weights: its ratios are not all 1 (the check above is not vacuous)
    assert float(metrics["train/ratio_max"]) != 1.0 or float(metrics["train/ratio_min"]) != 1.0


def test_replayed_log_probs_equal_rollout_bitwise_in_bf16(make):
    from tests.train.test_trainer import assert_replay_equals_rollout

    assert_replay_equals_rollout(make("replay", *BF16))


def test_rollout_engine_workers_equal_the_trainer_in_bf16(make):
    """A worker process (its own model copy on the same device) rolls out step 0 bit for bit like the trainer, and
    the first update on its trajectory has ratio exactly 1."""
    from tests.rollout.test_engine import assert_same_trajectory
    from tests.train.test_trainer import one_step, train_batch

    local = make("local", *BF16)
    workers = make("workers", *BF16, "rollout.engine=workers")
    try:
        lb, wb = one_step(local, 0), one_step(workers, 0)
        assert torch.equal(lb[0].candidate_ids, wb[0].candidate_ids)
        assert wb[1].log_probs is not None
        assert_same_trajectory(lb[1], wb[1])
        assert float(workers.optimize(train_batch(*wb))["train/first_update_ratio_dev"]) == 0.0
    finally:
        workers.engine.close()


@pytest.fixture
def one_rank_group(device):
    """A process group of one rank (NCCL on CUDA, gloo on the CPU), destroyed afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _velocity_grads(adapter, module, batch):
    """The velocity of ``module`` (set as ``adapter.transformer``) on ``batch``'s first transition, and the gradients
    of its mean square over every trainable parameter (full tensors)."""
    traj, cond = batch.traj, batch.cond
    adapter.transformer = module
    x = traj.latents[:, 0]
    sigma = traj.sigmas[traj.trained_steps[0]].to(x.device).expand(len(x))
    v = adapter.velocity(x, sigma, cond, 1.0)
    v.square().mean().backward()
    grads = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.float().cpu()
    return v.detach().cpu(), grads


@pytest.mark.parametrize("param_dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_fsdp2_on_one_rank_matches_the_bare_module(make, one_rank_group, param_dtype, tol):
    """FSDP2 (``distributed.strategy=fsdp``'s wrap: ``fully_shard`` per block then the root) over a one-rank group
    gives the bare module's velocity and LoRA gradients: equal within float rounding in fp32, within bf16 rounding
    with ``param_dtype=bfloat16`` (the reference then runs a bf16 copy)."""
    from flowforge.runtime import distributed as dist_lib
    from tests.train.test_trainer import one_step, train_batch

    trainer = make(f"fsdp-{param_dtype}")
    batch = train_batch(*one_step(trainer))
    adapter = trainer.adapter
    bare = copy.deepcopy(adapter.transformer)
    if param_dtype == "bfloat16":
        bare = bare.to(torch.bfloat16)
    v_ref, g_ref = _velocity_grads(adapter, bare, batch)
    wrapped = copy.deepcopy(adapter.transformer)
    adapter.transformer = wrapped
    dist_lib.wrap(adapter, "fsdp", param_dtype=param_dtype, reduce_dtype="float32")
    v, grads = _velocity_grads(adapter, wrapped, batch)
    assert any(type(p).__name__ == "DTensor" for p in wrapped.parameters())  # really sharded by FSDP2
    torch.testing.assert_close(v, v_ref.float(), rtol=tol, atol=tol)
    assert grads.keys() == g_ref.keys() and grads
    for k in g_ref:
        torch.testing.assert_close(grads[k], g_ref[k], rtol=tol, atol=tol * float(g_ref[k].abs().max()), msg=k)


def test_checkpoint_round_trip_restores_cuda_state_exactly(make, device):
    """A run stopped after 1 step (checkpoint every step) resumes with the same live / old weights and AdamW state,
    on the device, bit for bit (bf16 base weights, fp32 LoRA)."""
    from tests.train.test_resume import _assert_same, _state

    extra = (*BF16, "train.algorithm=nft", "train.steps=3", "checkpoint.every=1", "train.lr_schedule=cosine")
    trained = make("ckpt", *extra)
    trained.train(stop_at=1)
    saved = _state(trained)
    del trained  # as in tests/train/test_resume.py: the run directory is released before the resume opens it
    resumed = make("ckpt", *extra, "train.resume=auto")
    assert resumed.step == 1
    state = _state(resumed)
    assert all(t.device.type == device for t in state[0]["live"].values())
    _assert_same(saved, state)
