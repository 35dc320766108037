"""Checkpoints: round trips, the COMMITTED marker is the commit point (also under a real SIGKILL), rotation,
resume resolution, the training contract, weights_only loading, model hashing, run-dir placement."""
from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flowforge.runtime.rng import restore_rng
from flowforge.train import checkpoint as ckpt
from flowforge.train.checkpoint.manager import check_contract

REPO = Path(__file__).resolve().parents[2]
STATE = {"step": 0, "optimizer_steps": 0, "sampler": {"epoch": 1, "cursor": 4, "steps": 3}}


def _save(run_dir, step, *, keep=10, protect=None, tensors=None, optimizer_state=None, **kw):
    tensors = tensors if tensors is not None else {"live": {"w": torch.full((3,), float(step))}}
    return ckpt.save_checkpoint(run_dir, step, tensors=tensors, optimizer_state=optimizer_state,
                                trainer_state={**STATE, "step": step}, keep=keep, protect=protect, **kw)


def _steps(run_dir) -> list[int]:
    return [int(p.name.split("_")[1]) for p in ckpt.committed_checkpoints(run_dir)]


def _trained_adamw(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(2):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _draws():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


# ------------------------------------------------------------------------------------------------ round trips
def test_round_trip_tensors_optimizer_state_and_rng(tmp_path):
    model, opt = _trained_adamw()
    base = torch.arange(12.0).reshape(3, 4)
    tensors = {
        "live": {k: v for k, v in model.state_dict().items()},
        "ema": {"t": base.t(), "row": base[1], "bf16": torch.randn(5).bfloat16()},  # non-contiguous, shared storage
    }
    trainer_state = {"step": 7, "optimizer_steps": 14, "policy_version": 3, "lr_step": 14,
                     "sampler": {"epoch": 0, "cursor": 4, "steps": 7}, "config_fingerprint": "abc",
                     "base_model_sha256": "d" * 64,
                     "lora": {"rank": 8, "alpha": 8.0, "targets": ["to_q"], "dropout": 0.0}}
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = ckpt.save_checkpoint(tmp_path, 7, tensors=tensors, optimizer_state=opt.state_dict(),
                                trainer_state=trainer_state, keep=3)
    expected_draws = _draws()  # what the run would draw next
    _draws(), _draws()  # the RNG moves on

    assert path == tmp_path / "checkpoints" / "step_000007"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000007\n"
    manifest = json.loads((path / "COMMITTED").read_text())
    assert manifest["step"] == 7 and sorted(manifest["files"]) == sorted(
        ["weights/ema.safetensors", "weights/live.safetensors", "optimizer.pt", "rng/rank_0.json",
         "rng/rank_0.safetensors", "trainer_state.json"])
    json.loads((path / "rng" / "rank_0.json").read_text())  # python/numpy RNG stored as JSON, not a pickle
    assert load_file(str(path / "rng" / "rank_0.safetensors"))["torch"].dtype == torch.uint8

    loaded = ckpt.load_checkpoint(path)
    assert loaded.step == 7 and loaded.path == path
    assert loaded.trainer_state == trainer_state
    assert set(loaded.tensors) == {"live", "ema"}
    for group, named in tensors.items():
        assert set(loaded.tensors[group]) == set(named)
        for name, t in named.items():
            assert loaded.tensors[group][name].dtype == t.dtype
            assert torch.equal(loaded.tensors[group][name], t)

    # the optimizer state (loaded weights_only) continues exactly like the original optimizer
    model2, _ = _trained_adamw(seed=99)
    model2.load_state_dict(loaded.tensors["live"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    opt2.load_state_dict(loaded.optimizer_state)
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.param_groups[0]["betas"] == (0.8, 0.95)
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).square().mean().backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)

    restore_rng(loaded.rng)
    assert _draws() == expected_draws


def test_no_optimizer_and_invalid_inputs_write_nothing(tmp_path):
    path = _save(tmp_path, 1)
    assert not (path / "optimizer.pt").exists() and ckpt.load_checkpoint(path).optimizer_state is None
    with pytest.raises(ValueError, match="keep must be >= 1"):
        _save(tmp_path, 2, keep=0)
    with pytest.raises(ValueError, match="not file-name safe"):
        _save(tmp_path, 2, tensors={"../evil": {}})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        ckpt.save_checkpoint(tmp_path, 2, tensors={}, optimizer_state=None, trainer_state={"x": float("nan")},
                             keep=3)
    with pytest.raises(ValueError, match="needs a barrier"):
        _save(tmp_path, 2, rank=1, world_size=2)
    assert not (tmp_path / "checkpoints" / "step_000002").exists()


# ------------------------------------------------------------------------------------------------ weights_only
class _Evil:
    """Unpickling this runs ``_touch(marker)``: what a malicious optimizer.pt could do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


def _touch(marker: str) -> None:
    Path(marker).write_text("code ran")


def test_optimizer_pickle_with_arbitrary_objects_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = _save(tmp_path / "run", 5, optimizer_state={"state": {}, "payload": _Evil(str(marker))})
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        ckpt.load_checkpoint(path)
    assert not marker.exists()


def test_damaged_committed_checkpoint_is_refused(tmp_path):
    path = _save(tmp_path, 3)
    with open(path / "weights" / "live.safetensors", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=r"damaged: weights/live.safetensors has 10 bytes"):
        ckpt.load_checkpoint(path)


# ------------------------------------------------------------------------------------------------ commit point
def test_marker_is_written_last_and_uncommitted_is_never_trusted(tmp_path, monkeypatch):
    _save(tmp_path, 30)
    present_at_commit = []

    def failing_marker(step_dir, manifest):
        present_at_commit.extend(sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*")
                                        if p.is_file()))
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.save, "_write_marker", failing_marker)
    model, opt = _trained_adamw()
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 40, optimizer_state=opt.state_dict())
    # every data file was in place when the marker was about to be written, and nothing else
    assert present_at_commit == ["optimizer.pt", "rng/rank_0.json", "rng/rank_0.safetensors",
                                 "trainer_state.json", "weights/live.safetensors"]
    step40 = tmp_path / "checkpoints" / "step_000040"
    assert step40.is_dir() and not ckpt.is_committed(step40)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000030\n"

    path, notes = ckpt.resolve_resume(tmp_path, "auto")
    assert path == tmp_path / "checkpoints" / "step_000030"
    assert notes == ["checkpoints/step_000040 has no COMMITTED marker (incomplete write); resuming from step_000030"]
    with pytest.raises(ValueError, match=r"step_000040 has no COMMITTED marker.*auto would fall back to .*step_000030"):
        ckpt.resolve_resume(tmp_path, str(step40))
    with pytest.raises(ValueError, match="no COMMITTED marker"):
        ckpt.load_checkpoint(step40)


def test_resolve_resume_none_missing_and_empty(tmp_path):
    assert ckpt.resolve_resume(tmp_path, None) == (None, [])
    path, notes = ckpt.resolve_resume(tmp_path, "auto")
    assert path is None and len(notes) == 1 and "starting from step 0" in notes[0]
    with pytest.raises(ValueError, match="does not exist"):
        ckpt.resolve_resume(tmp_path, str(tmp_path / "checkpoints" / "step_000099"))
    committed = _save(tmp_path, 5)
    assert ckpt.resolve_resume(tmp_path, str(committed)) == (committed, [])


_CHILD = r"""
import os, sys, time, torch
torch.set_num_threads(1)
from flowforge.runtime.rng import restore_rng
from flowforge.train import checkpoint as ckpt
run_dir, stage, target = sys.argv[1], sys.argv[2], sys.argv[3]
def hook(s, rel):
    if (s, rel) == (stage, target):
        print("STOPPED", flush=True)
        time.sleep(600)
ckpt.save._test_hook = hook
big = {"w": torch.randn(1 << 20), "b": torch.randn(1 << 18)}
ckpt.save_checkpoint(run_dir, 20, tensors={"live": big, "ema": big}, optimizer_state={"state": {}, "x": torch.ones(3)},
                     trainer_state={"step": 20}, keep=3)
print("FINISHED", flush=True)
"""


@pytest.mark.parametrize("stage,target,committed", [
    ("tmp", "weights/live.safetensors", False),   # a weight file written but not yet renamed
    ("renamed", "trainer_state.json", False),     # every data file in place, the marker not yet written
    ("renamed", "COMMITTED", True),               # committed; killed before `latest` and rotation
])
def test_sigkill_mid_save_never_leaves_a_trusted_partial_checkpoint(tmp_path, stage, target, committed):
    _save(tmp_path, 10)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), stage, target], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline().strip()
        assert line == "STOPPED", child.stderr.read()
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    step20 = tmp_path / "checkpoints" / "step_000020"
    assert step20.is_dir() and ckpt.is_committed(step20) == committed
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000010\n"  # never reached
    path, notes = ckpt.resolve_resume(tmp_path, "auto")
    if committed:
        assert path == step20 and notes == []
        assert ckpt.load_checkpoint(step20).trainer_state == {"step": 20}
    else:
        assert path == tmp_path / "checkpoints" / "step_000010"
        assert notes == ["checkpoints/step_000020 has no COMMITTED marker (incomplete write); "
                         "resuming from step_000010"]
        with pytest.raises(ValueError, match="no COMMITTED marker"):
            ckpt.resolve_resume(tmp_path, str(step20))
        # the resumed run saves step 20 again over the debris
        _save(tmp_path, 20)
        assert ckpt.load_checkpoint(step20).trainer_state["step"] == 20
        assert not [p for p in step20.rglob("*") if ".tmp-" in p.name]
    assert ckpt.load_checkpoint(tmp_path / "checkpoints" / "step_000010").trainer_state["step"] == 10


# ------------------------------------------------------------------------------------------------ rotation
def test_rotation_keeps_exactly_k_newest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert _steps(tmp_path) == [4, 5]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000004", "step_000005"]


def test_rotation_never_deletes_the_protected_checkpoint(tmp_path):
    protected = _save(tmp_path, 1, keep=2)
    for step in range(2, 6):
        _save(tmp_path, step, keep=2, protect=protected)
    assert _steps(tmp_path) == [1, 4, 5]
    for step in range(6, 8):  # keep=1: the newest and the protected one
        _save(tmp_path, step, keep=1, protect=protected)
    assert _steps(tmp_path) == [1, 7]


def test_rotation_removes_stale_uncommitted_dirs_older_than_newest(tmp_path):
    _save(tmp_path, 1)
    stale = tmp_path / "checkpoints" / "step_000002"
    (stale / "weights").mkdir(parents=True)
    (stale / "weights" / ".live.safetensors.tmp-123").write_bytes(b"partial")
    _save(tmp_path, 3)
    assert not stale.exists()
    assert _steps(tmp_path) == [1, 3]


def test_resuming_from_an_earlier_checkpoint_supersedes_the_abandoned_future(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step)
    resumed, _ = ckpt.resolve_resume(tmp_path, str(tmp_path / "checkpoints" / "step_000010"))
    _save(tmp_path, 20, protect=resumed, tensors={"live": {"w": torch.full((3,), -1.0)}})
    assert _steps(tmp_path) == [10, 20]
    assert torch.equal(ckpt.load_checkpoint(tmp_path / "checkpoints" / "step_000020").tensors["live"]["w"],
                       torch.full((3,), -1.0))
    step30 = tmp_path / "checkpoints" / "step_000030"
    assert (step30 / "SUPERSEDED").is_file() and (step30 / "weights" / "live.safetensors").is_file()
    path, notes = ckpt.resolve_resume(tmp_path, "auto")
    assert path == tmp_path / "checkpoints" / "step_000020"
    assert len(notes) == 1 and notes[0].startswith("checkpoints/step_000030 was superseded")
    with pytest.raises(ValueError, match="superseded"):
        ckpt.resolve_resume(tmp_path, str(step30))
    with pytest.raises(ValueError, match="resumed from"):
        _save(tmp_path, 10, protect=resumed)


# ------------------------------------------------------------------------------------------------ ranks
def test_two_ranks_each_write_their_rng_and_rank0_commits(tmp_path):
    barrier = threading.Barrier(2)
    errors = []

    def run(rank):
        try:
            ckpt.save_checkpoint(tmp_path, 4, tensors={"live": {"w": torch.ones(2)}}, optimizer_state=None,
                                 trainer_state={"step": 4}, keep=2, rank=rank, world_size=2, barrier=barrier.wait)
        except Exception as e:  # surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    path = tmp_path / "checkpoints" / "step_000004"
    manifest = json.loads((path / "COMMITTED").read_text())
    assert manifest["world_size"] == 2 and "rng/rank_1.safetensors" in manifest["files"]
    assert ckpt.load_checkpoint(path, rank=1).rng is not None
    assert ckpt.load_checkpoint(path, rank=2).rng is None  # resumed on more ranks than saved


# ------------------------------------------------------------------------------------------------ contract
LORA = {"rank": 8, "alpha": 8.0, "targets": ["to_q", "to_k"], "dropout": 0.0}


def test_contract_mismatch_lists_every_mismatch():
    saved = {"step": 3, "lora": LORA, "base_model_sha256": "aaa"}
    current = {"lora": {"rank": 16, "alpha": 16.0, "targets": ("to_k", "to_q"), "dropout": 0.1},
               "base_model_sha256": "bbb"}
    with pytest.raises(ValueError) as err:
        check_contract(saved, current)
    msg = str(err.value)
    assert msg.startswith("resume refused")
    assert msg.splitlines()[1:] == ["  lora.alpha: checkpoint 8.0, this run 16.0",
                                    "  lora.dropout: checkpoint 0.0, this run 0.1",
                                    "  lora.rank: checkpoint 8, this run 16",
                                    "  base_model_sha256: checkpoint aaa, this run bbb"]


def test_contract_equal_up_to_representation_passes_and_missing_keys_fail():
    current = {"lora": {"rank": 8.0, "alpha": 8, "targets": ("to_k", "to_q"), "dropout": 0}, "base_model_sha256": "a"}
    check_contract({"lora": LORA, "base_model_sha256": "a"}, current)
    with pytest.raises(ValueError, match=r"base_model_sha256: checkpoint \(missing\), this run a"):
        check_contract({"lora": LORA}, current)
    with pytest.raises(ValueError, match=r"lora.targets: checkpoint \['to_k', 'to_q'\], this run \['to_q'\]"):
        check_contract({"lora": LORA}, {"lora": {**LORA, "targets": ["to_q"]}}, keys=("lora",))


# ------------------------------------------------------------------------------------------------ Stateful + manager
class _Bank:
    """A policy bank in miniature (Stateful): one trainable linear layer as ``live``, a frozen ``old`` copy, AdamW and
    a LambdaLR schedule, in the state-dict layout of ``flowforge.policy.Policy``."""

    def __init__(self, seed: int):
        self.model, self.optimizer = _trained_adamw(seed)
        self.old = {k: v.clone() + 1 for k, v in self.model.state_dict().items()}
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda n: 1.0 / (n + 1))
        self.optimizer.step()  # no gradients: moves nothing, orders the schedule step after an optimizer step
        self.scheduler.step()
        self.optimizer_steps = 2 + seed

    def state_dict(self):
        return {"weights": {"live": {k: v.clone() for k, v in self.model.state_dict().items()},
                            "old": {k: v.clone() for k, v in self.old.items()}},
                "scheduler": self.scheduler.state_dict(), "optimizer_steps": self.optimizer_steps,
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["weights"]["live"])
        self.old = {k: v.clone() for k, v in state["weights"]["old"].items()}
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = state["optimizer_steps"]


def _manager(run_dir, seed, *, step=0, lora_rank=4):
    from flowforge.data.prompts import KRepeatSampler
    from flowforge.runtime.distributed import DistInfo
    from flowforge.train.checkpoint.manager import CheckpointManager, TrainerState

    contract = {"lora": {"trainable": "lora", "rank": lora_rank, "alpha": 8.0, "targets": ["to_q"], "dropout": 0.0},
                "base_model_sha256": "abc"}
    record = TrainerState(step=step, contract=contract, config_fingerprint="f0")
    sampler = KRepeatSampler(10, 3, 2, seed=5)
    bank = _Bank(seed)
    return CheckpointManager(run_dir, policy=bank, record=record, sampler=sampler, keep=2, dist=DistInfo()), bank


def test_bank_sampler_and_record_are_stateful():
    from torch.distributed.checkpoint.stateful import Stateful

    from flowforge.data.prompts import KRepeatSampler
    from flowforge.policy import Policy
    from flowforge.train.checkpoint.manager import TrainerState

    for cls in (Policy, KRepeatSampler, TrainerState):
        assert callable(getattr(cls, "state_dict", None)) and callable(getattr(cls, "load_state_dict", None)), cls
    assert isinstance(KRepeatSampler(10, 3, 2, seed=5), Stateful)
    assert isinstance(TrainerState(step=0, contract={}, config_fingerprint=""), Stateful)


def test_sampler_state_round_trip_continues_the_same_batches():
    from flowforge.data.prompts import KRepeatSampler

    a = KRepeatSampler(10, 3, 2, seed=5)
    for _ in range(4):  # past an epoch boundary (10 // 3 = 3 steps per epoch)
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # as stored in trainer_state.json
    b = KRepeatSampler(10, 3, 2, seed=5, num_replicas=2, rank=1)  # another world size may resume it
    b.load_state_dict(state)
    for _ in range(3):
        x, y = a.next_batch(), b.next_batch()
        assert torch.equal(x.prompt_indices, y.prompt_indices) and torch.equal(x.candidate_ids, y.candidate_ids)
        assert (x.step, x.epoch) == (y.step, y.epoch)
    with pytest.raises(ValueError, match="seed"):
        KRepeatSampler(10, 3, 2, seed=6).load_state_dict(state)


def test_trainer_state_round_trip_and_contract_refusal():
    from flowforge.train.checkpoint.manager import TrainerState

    contract = {"lora": {"trainable": "full", "dropout": 0.0}, "base_model_sha256": "abc"}
    a = TrainerState(step=7, contract=contract, config_fingerprint="f1")
    state = json.loads(json.dumps(a.state_dict()))
    assert state == {"step": 7, "config_fingerprint": "f1", **contract}
    b = TrainerState(step=0, contract=contract, config_fingerprint="f2")  # a changed config only warns
    b.load_state_dict(state)
    assert b.step == 7
    c = TrainerState(step=0, contract={**contract, "base_model_sha256": "xyz"}, config_fingerprint="f1")
    with pytest.raises(ValueError, match="base_model_sha256: checkpoint abc, this run xyz"):
        c.load_state_dict(state)
    assert c.step == 0  # refused before anything was taken


def test_manager_writes_the_checkpoint_format_and_restores_every_stateful(tmp_path):
    saver, bank = _manager(tmp_path, seed=0, step=3)
    saver.sampler.next_batch()
    sampler_state = saver.sampler.state_dict()
    want = bank.state_dict()
    path = saver.save()
    assert path.name == "step_000003" and ckpt.is_committed(path)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000003\n"
    assert sorted(p.name for p in (path / "weights").iterdir()) == ["live.safetensors", "old.safetensors"]
    assert set(torch.load(path / "optimizer.pt", weights_only=True)) == {"scheduler", "optimizer"}
    state = json.loads((path / "trainer_state.json").read_text())
    assert state == {"step": 3, "config_fingerprint": "f0", "lora": saver.record.contract["lora"],
                     "base_model_sha256": "abc", "optimizer_steps": 2, "policy_version": 2, "lr_schedule_step": 1,
                     "sampler": sampler_state}

    loader, other = _manager(tmp_path, seed=1)
    assert loader.restore("auto") == path and loader.resumed_from == path
    assert loader.record.step == 3 and loader.sampler.state_dict() == sampler_state
    got = other.state_dict()
    for name in ("live", "old"):
        for k, v in want["weights"][name].items():
            assert torch.equal(got["weights"][name][k], v), (name, k)
    assert got["optimizer_steps"] == 2 and got["scheduler"] == want["scheduler"]
    for i, s in want["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][i][k]), torch.as_tensor(v)), (i, k)

    fresh, _ = _manager(tmp_path / "empty", seed=1)
    assert fresh.restore("auto") is None and fresh.record.step == 0
    refused, kept = _manager(tmp_path, seed=1, lora_rank=8)
    before = kept.state_dict()["weights"]["live"]
    with pytest.raises(ValueError, match="lora.rank: checkpoint 4, this run 8"):
        refused.restore("auto")
    assert all(torch.equal(kept.state_dict()["weights"]["live"][k], v) for k, v in before.items())


def test_a_manifest_of_the_wrong_shape_is_named(tmp_path):
    """A manifest whose ``files`` is not a mapping, or that lists a sha256 for a file it does not list, is refused
    naming COMMITTED (not an internal AttributeError / OSError)."""
    path = _save(tmp_path, 1)
    good = json.loads((path / "COMMITTED").read_text())
    for bad in ({**good, "files": list(good["files"])}, {**good, "sha256": {**good.get("sha256", {}), "x.bin": "0"}}):
        (path / "COMMITTED").write_text(json.dumps(bad))
        with pytest.raises(ckpt.UserError, match="COMMITTED: is not a valid checkpoint manifest"):
            ckpt.load_checkpoint(path)
