"""``distributed.offload``: the host AdamW equals torch's AdamW and shares its checkpoints; offload without FSDP is a
one-line error; on 2 gloo ranks under FSDP2, ``optimizer`` and ``params`` (FSDP's real ``CPUOffloadPolicy``, with
``pin_memory`` off: pinning needs an accelerator) train exactly as ``none`` does, and a checkpoint written with
offload resumes without it to the same weights.

On a CPU device the host *is* the device, so what these runs exercise is the offload code paths (FSDP's
``offload_to_cpu`` branches: shards placed with ``.cpu()``, the offload parameter check at lazy init, the copies
before all-gather and after reduce-scatter, the optimizer over host shards; the host AdamW's buffers, state layout and
copy-back; policy copies moved around their use), not the transfers between two memories, pinning, or FSDP's
asynchronous gradient copy (its event is recorded only with pinned memory).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from flowforge.runtime.offload import HostOffloadAdamW
from tests.test_distributed import _overrides, _run


def _adam_pair(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    twin.load_state_dict(model.state_dict())
    kw = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    return model, torch.optim.AdamW(model.parameters(), **kw), twin, HostOffloadAdamW(twin.parameters(), **kw)


def _steps(model, opt, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randn(4, 5, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_host_adamw_is_bit_identical_to_adamw_and_their_checkpoints_swap():
    model, adam, twin, host = _adam_pair()
    _steps(model, adam, 3)
    _steps(twin, host, 3)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    # the state dicts have the same layout and values: each optimizer resumes from the other's
    sd_adam, sd_host = adam.state_dict(), host.state_dict()
    assert sd_adam["param_groups"] == sd_host["param_groups"]
    for i, st in sd_adam["state"].items():
        for k, v in st.items():
            assert torch.equal(sd_host["state"][i][k], v), (i, k)
    model2, adam2, twin2, host2 = _adam_pair()
    model2.load_state_dict(twin.state_dict())
    twin2.load_state_dict(model.state_dict())
    adam2.load_state_dict(copy.deepcopy(sd_host))  # as read from a file: load_state_dict may alias the tensors
    host2.load_state_dict(copy.deepcopy(sd_adam))
    _steps(model, adam, 2, seed=7)
    _steps(model2, adam2, 2, seed=7)
    _steps(twin2, host2, 2, seed=7)
    for a, b, c in zip(model.parameters(), model2.parameters(), twin2.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert all(v.device.type == "cpu" for st in host2.state.values() for v in st.values())


def test_host_adamw_loads_its_states_straight_to_the_host_never_through_the_parameters_device():
    """A resume must not move the AdamW states to the parameters' device (the memory offload saves): parameters on
    the meta device stand in for the accelerator (was: torch's load cast every state to ``param.device``, then copied
    it back, here failing on a meta tensor; on a GPU, the whole state on the device). The states arrive bit for bit,
    in the parameters' dtype, ``step`` in its own."""
    model, adam, _, _ = _adam_pair()
    _steps(model, adam, 2)
    saved = copy.deepcopy(adam.state_dict())
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(torch.bfloat16)
    host = HostOffloadAdamW(meta.parameters(), lr=1e-2)
    host.load_state_dict(copy.deepcopy(saved))
    assert host.param_groups[0]["betas"] == (0.9, 0.99)
    for i, p in enumerate(meta.parameters()):
        st = host.state[p]
        assert set(st) == set(saved["state"][i])
        assert all(v.device.type == "cpu" for v in st.values())
        step = saved["state"][i]["step"]
        assert st["step"].dtype == step.dtype and torch.equal(st["step"], step)
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].dtype == torch.bfloat16 and torch.equal(st[k], saved["state"][i][k].to(torch.bfloat16))


def test_host_adamw_refuses_device_side_modes():
    with pytest.raises(ValueError, match="fused=True"):
        HostOffloadAdamW([torch.nn.Parameter(torch.zeros(2))], fused=True)


@pytest.mark.parametrize("world, strategy, got", [("1", "fsdp", "got 1 process"),
                                                  ("2", "ddp", "got distributed.strategy='ddp'")])
def test_offload_without_fsdp_on_two_ranks_is_one_line_naming_the_field(capsys, monkeypatch, world, strategy, got):
    from flowforge.cli import main

    monkeypatch.setenv("WORLD_SIZE", world)  # what torchrun sets: preflight checks against it
    assert main(["check", "examples/digits/nft.yaml", "distributed.offload=optimizer",
                 f"distributed.strategy={strategy}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0]
    assert "distributed.offload='optimizer' needs FSDP on >= 2 ranks" in err[0] and got in err[0]
    assert "allowed here: ['none']" in err[0]


def test_offload_value_outside_the_modes_lists_them(capsys):
    from flowforge.cli import main

    assert main(["check", "examples/digits/nft.yaml", "distributed.offload=cpu"]) == 2
    err = capsys.readouterr().err
    assert "distributed.offload='cpu' is not one of ['none', 'optimizer', 'params']" in err


# ---------------------------------------------------------------------------------------------- 2 gloo ranks
# full fine-tuning + DiffusionNFT: the old policy is a whole frozen copy (host-homed under offload, blended toward
# live after every batch), so the copies' placement is exercised beside the optimizer's
EXTRA = ("train.algorithm=nft", "lora.trainable=full", "forward.decay_rate=0.25", "distributed.strategy=fsdp",
         "checkpoint.every=1")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def no_offload(tiny_model_dir, tmp_path_factory, encode_cache_dir):
    out = tmp_path_factory.mktemp("no_offload")
    records = _run(out / "rec", 0, _overrides(tiny_model_dir, out, encode_cache_dir, "none", *EXTRA), 2)
    return records, _rows(out / "none")


def _assert_same(records, rows, ref):
    ref_records, ref_rows = ref
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2]
    for r, want in zip(rows, ref_rows):  # bit-identical on the CPU: the same AdamW kernels on the same values
        for key in ("train/loss", "train/grad_norm", "reward/total_mean"):
            assert r[key] == want[key], key
    for rank in (0, 1):
        assert records[rank]["live"].keys() == ref_records[0]["live"].keys()
        for k, v in ref_records[0]["live"].items():
            assert torch.equal(records[rank]["live"][k], v), k


@pytest.mark.distributed
@pytest.mark.slow  # 2-rank end-to-end runs (tens of seconds each): CI runs it after the default set
@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_offload_trains_as_no_offload_and_its_checkpoint_resumes_without(no_offload, tiny_model_dir, tmp_path,
                                                                          encode_cache_dir, offload):
    whole = _run(tmp_path / "whole", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "whole", *EXTRA,
                                                   f"distributed.offload={offload}"), 2)
    _assert_same(whole, _rows(tmp_path / "whole"), no_offload)
    # stop after step 1 (checkpoint written with offload), then resume step 2 without offload
    _run(tmp_path / "part", 1, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "part", *EXTRA,
                                          f"distributed.offload={offload}"), 2)
    assert (tmp_path / "part" / "checkpoints" / "step_000001" / "COMMITTED").is_file()
    resumed = _run(tmp_path / "res", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "part", *EXTRA,
                                                   "train.resume=auto"), 2)
    assert len(resumed[0]["candidate_ids"]) == len(no_offload[0][0]["candidate_ids"]) // 2  # it trained step 2 only
    _assert_same(resumed, _rows(tmp_path / "part"), no_offload)


@pytest.mark.distributed
@pytest.mark.slow  # four 2-rank end-to-end runs (about a minute each on 2 loaded cores)
def test_lora_under_cpu_offload_policy_trains_as_no_offload_and_resumes_without(tiny_model_dir, tmp_path,
                                                                                encode_cache_dir):
    """LoRA + DiffusionNFT under ``params``: the frozen base, the live adapter and the ``old`` adapter are FSDP shards
    under ``CPUOffloadPolicy`` (old blended shard by shard); step 1 runs with offload, step 2 resumes without it
    (the old adapter's sharded weights loaded back into shards): both steps and the weights equal the run without.
    The other way round, the no-offload run's step-1 checkpoint resumes under ``optimizer`` to the same step 2."""
    lora = ("train.algorithm=nft", "forward.decay_rate=0.25", "distributed.strategy=fsdp", "checkpoint.every=1")
    ref = _run(tmp_path / "ref", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "ref", *lora), 2)
    _run(tmp_path / "part", 1, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "part", *lora,
                                          "distributed.offload=params"), 2)
    resumed = _run(tmp_path / "res", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "part", *lora,
                                                   "train.resume=auto"), 2)
    assert any(".lora_A." in k for k in ref[0]["live"])
    ref_rows = _rows(tmp_path / "ref")
    _assert_same(resumed, _rows(tmp_path / "part"), (ref, ref_rows))
    step1 = tmp_path / "ref" / "checkpoints" / "step_000001"
    reverse = _run(tmp_path / "rev", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "rev", *lora,
                                                   "distributed.offload=optimizer", f"train.resume={step1}"), 2)
    rows = _rows(tmp_path / "rev")
    assert [r["step"] for r in rows] == [2]
    for key in ("train/loss", "train/grad_norm", "reward/total_mean"):
        assert rows[0][key] == ref_rows[1][key], key
    for k, v in ref[0]["live"].items():
        assert torch.equal(reverse[0]["live"][k], v) and torch.equal(reverse[1]["live"][k], v), k
