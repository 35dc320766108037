"""The world_model adapter: contract, slot 0 in the rollout loop, actions in the Conditioning, parameter modes,
provenance and source protection, save / load."""

import hashlib
import pathlib

import pytest
import torch
from tests.models.world_model.wm_helpers import FRAMES, PROMPTS, make_adapter

from flowforge.models import build_adapter
from flowforge.models.base import FlowModel, ImageConditioned
from flowforge.models.world_model import provenance as prov
from flowforge.models.world_model.adapter import WEIGHTS_NAME, load_world_model
from flowforge.rollout.loop import RolloutSpec, replay_log_prob, rollout


def test_contract_encode_and_latent_shape(adapter):
    assert isinstance(adapter, FlowModel) and isinstance(adapter, ImageConditioned)
    cond = adapter.encode(PROMPTS)
    assert cond.prompt_embeds.shape == (2, FRAMES, 3) and cond.mask.shape == (2, FRAMES)
    assert cond.prompt_embeds[0, 0].tolist() == [0.0, 1.0, 0.0]  # LEFT
    assert not bool(cond.negative.prompt_embeds.any())  # the null actions of CFG
    assert adapter.latent_shape(32, 32, FRAMES) == (1, FRAMES, 32, 32)
    with pytest.raises(ValueError, match="allowed"):
        adapter.encode(["LEFT JUMP"])
    with pytest.raises(ValueError, match="same positive number"):
        adapter.encode(["LEFT", "LEFT RIGHT"])
    with pytest.raises(ValueError, match="32x32"):
        adapter.latent_shape(64, 64, FRAMES)
    with pytest.raises(ValueError, match="at most"):
        adapter.latent_shape(32, 32, 9)


def test_velocity_cfg_and_slot_zero(adapter, batch):
    x, sigma, cond = batch
    with torch.no_grad():
        v = adapter.velocity(x, sigma, cond, 1.0)
        v_u = adapter.velocity(x, sigma, cond.negative.__class__(prompt_embeds=cond.negative.prompt_embeds,
                                                                  image=cond.image), 1.0)
        v_g = adapter.velocity(x, sigma, cond, 3.0)
    assert bool((v[:, :, 0] == 0).all()) and bool((v_g[:, :, 0] == 0).all())
    assert torch.allclose(v_g, v_u + 3.0 * (v - v_u), atol=1e-5)
    decoded = adapter.decode(x)
    assert decoded.shape == (2, 3, FRAMES, 32, 32) and float(decoded.min()) >= 0.0


def test_rollout_pins_slot_zero_and_first_replay_ratio_is_one(adapter, batch):
    _, _, cond = batch
    spec = RolloutSpec(kind="sde", noise_level=0.7, trained_steps=(0, 2))
    sigmas = torch.linspace(1.0, 0.0, 5)
    traj = rollout(adapter, cond, [11, 12], sigmas, spec, latent_shape=(1, FRAMES, 32, 32), seed=0)
    assert torch.equal(traj.final[:, :, :1], cond.image)  # bit-equal to the condition frame
    assert torch.equal(traj.latents[:, :, :, :1], cond.image[:, None].expand(-1, 2, -1, -1, -1, -1))
    for slot in range(2):
        replayed = replay_log_prob(adapter, traj, slot, cond, spec)
        assert torch.equal(replayed.log_prob, traj.log_probs[:, slot])


def test_slot_zero_never_receives_gradient(adapter, batch):
    x, sigma, cond = batch
    v = adapter.velocity(x, sigma, cond, 1.0)
    params = list(adapter.transformer.parameters())
    grads = torch.autograd.grad(v[:, :, :1].sum(), params, allow_unused=True, retain_graph=True)
    assert all(g is None or not bool(g.any()) for g in grads)  # the velocity on slot 0 is the constant 0
    grads = torch.autograd.grad(v[adapter.generated_index].pow(2).mean(), params, allow_unused=True)
    assert any(g is not None and bool(g.any()) for g in grads)


def _lora_hosts(model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def test_module_mode_trains_exactly_the_named_modules():
    adapter = make_adapter()
    trainable = adapter.apply_parameter_mode()
    assert trainable and all(n.startswith("latent_state_rollout.transition.") for n in trainable)
    expected = {f"latent_state_rollout.transition.{n}"
                for n, _ in adapter.transformer.latent_state_rollout.transition.named_parameters()}
    assert set(trainable) == expected == set(adapter.module_parameters())
    frozen = [n for n, p in adapter.transformer.named_parameters() if not p.requires_grad]
    assert any(n.startswith("latent_state_rollout.initializer.") for n in frozen)
    assert any(n.startswith("latent_state_rollout.out_proj.") for n in frozen)
    with pytest.raises(ValueError, match="not modules"):
        make_adapter(trainable_modules=["latent_state_rollout.transitions"])
    with pytest.raises(ValueError, match="allowed"):
        make_adapter(parameter_mode="full")


def test_lora_mode_touches_only_coupling_qkvo_in_every_block():
    adapter = make_adapter(parameter_mode="lora")
    trainable = adapter.apply_parameter_mode()
    blocks = len(adapter.blocks())
    expected = {f"blocks.{i}.coupling.{n}" for i in range(blocks) for n in ("q", "k", "v", "out")}
    assert set(adapter.lora_targets) == expected
    assert _lora_hosts(adapter.transformer) == expected  # no self / cross / state / tokenizer attention
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0] for n in trainable} == expected
    assert len(trainable) == 2 * len(expected)
    a = adapter.transformer.blocks[0].coupling.q.lora_A["default"]
    assert a.weight.shape[0] == 8  # rank 8 by default (alpha 16)


def test_module_plus_lora_mode_is_the_union():
    adapter = make_adapter(parameter_mode="module+lora")
    trainable = adapter.apply_parameter_mode()
    module = {n for n in trainable if n.startswith("latent_state_rollout.transition.")}
    lora = {n for n in trainable if ".lora_" in n}
    assert module and lora and module | lora == set(trainable)


def test_save_load_round_trip_with_provenance(adapter, batch, tmp_path):
    x, sigma, cond = batch
    src = adapter.save_pretrained(tmp_path / "src")
    weights = src / WEIGHTS_NAME
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    loaded = build_adapter("world_model", str(src), task="i2v", dtype=torch.float32, device="cpu")
    assert {r.status for r in loaded.provenance} == {"loaded"}
    assert len(loaded.provenance) == len(adapter.transformer.state_dict())
    (source,) = loaded.sources
    assert source.sha256 == digest and source.size == weights.stat().st_size
    assert source.mtime_ns == weights.stat().st_mtime_ns
    with torch.no_grad():
        assert torch.equal(loaded.velocity(x, sigma, cond, 1.0), adapter.velocity(x, sigma, cond, 1.0))
    assert "blocks" in loaded.provenance_table() and digest in loaded.provenance_table()
    with pytest.raises(ValueError, match="overlaps the source"):
        loaded.save_pretrained(src / "out")
    with pytest.raises(ValueError, match="overlaps the source"):
        loaded.save_pretrained(tmp_path)
    loaded.save_pretrained(tmp_path / "elsewhere")
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest  # the source's bytes are unchanged
    with pytest.raises(ValueError, match="i2v"):
        load_world_model(src, task="t2v")


def _rewrite(directory, drop_prefix=None, extra=None):
    from safetensors.torch import load_file, save_file

    path = directory / WEIGHTS_NAME
    state = load_file(str(path))
    if drop_prefix:
        state = {k: v for k, v in state.items() if not k.startswith(drop_prefix)}
    state.update(extra or {})
    save_file(state, str(path))


def test_provenance_refuses_a_checkpoint_missing_a_module(adapter, tmp_path):
    src = adapter.save_pretrained(tmp_path / "src")
    _rewrite(src, drop_prefix="latent_state_rollout.transition.")
    with pytest.raises(prov.ProvenanceError, match="missing") as err:
        load_world_model(src)
    assert "latent_state_rollout.transition.delta.weight" in str(err.value)
    loaded = load_world_model(src, allow_init=["latent_state_rollout.transition"])
    statuses = {r.name: r.status for r in loaded.provenance}
    assert statuses["latent_state_rollout.transition.delta.weight"] == "initialised"
    assert statuses["blocks.0.coupling.q.weight"] == "loaded"
    _rewrite(src, extra={"blocks.9.coupling.q.weight": torch.zeros(2, 2)})
    with pytest.raises(prov.ProvenanceError, match="unexpected"):
        load_world_model(src, allow_init=["latent_state_rollout.transition"])


def _closed_copy(tmp_path):
    """demo:world's files with every coupling gate set to 0: the base made before, whose gates stayed ~0 in SFT."""
    import shutil

    from safetensors.torch import load_file, save_file

    from flowforge.demo.paths import resolve_demo_path

    src, dst = resolve_demo_path("demo:world"), tmp_path / "closed"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / WEIGHTS_NAME))
    for name in [n for n in tensors if n.endswith("coupling.gate")]:
        tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(dst / WEIGHTS_NAME))
    return dst


def test_leverage_warnings_with_the_shipped_gates(tmp_path):
    """demo:world's gates (0.019 and 0.013 in blocks 0 and 1, 1e-4 and 4e-4 in 2 and 3) are above the warning
    floor: nothing is warned. With every gate at 0, B-only and coupling-LoRA are warned, training the gates or
    opening them is not; check_loaded_model logs and returns the warning before anything is written."""
    from flowforge.config import load_config
    from flowforge.demo.paths import resolve_demo_path
    from flowforge.models import build_adapter
    from flowforge.train.preflight.loaded import check_loaded_model

    b_only = ["latent_state_rollout.transition"]
    shipped = build_adapter("world_model", str(resolve_demo_path("demo:world")), task="i2v")
    assert shipped.leverage_warnings("module", b_only) == [] and shipped.leverage_warnings("lora", None) == []
    closed = build_adapter("world_model", str(_closed_copy(tmp_path)), task="i2v")
    assert "barely change the video" in closed.leverage_warnings("module", b_only)[0]
    assert "LoRA on the coupling" in closed.leverage_warnings("lora", None)[0]
    assert closed.leverage_warnings("module+lora", b_only)
    assert closed.leverage_warnings("module", [*b_only, "blocks.0.coupling"]) == []  # a gate is trained
    assert closed.leverage_warnings("module", ["blocks.1"]) == []
    assert closed.leverage_warnings("module", [*b_only, "blocks.0.coupling.q"])  # q alone leaves the gate shut
    assert closed.leverage_warnings("full", None) == []
    example = pathlib.Path(__file__).resolve().parents[3] / "examples" / "worldmodel" / "nft.yaml"
    cfg = load_config(example, ["lora.modules=[latent_state_rollout.transition]"])
    assert len(check_loaded_model(cfg, closed)) == 1 and check_loaded_model(cfg, shipped) == []
    assert check_loaded_model(load_config(example, []), closed) == []  # the example trains the gates
    with torch.no_grad():
        for block in closed.transformer.blocks:
            block.coupling.gate.fill_(0.5)
    assert closed.leverage_warnings("module", b_only) == []


@pytest.mark.parametrize(("overrides", "warned"), [
    (["lora.modules=[latent_state_rollout.transition]"], "['latent_state_rollout.transition']"),  # B-only
    (["lora.trainable=lora", "lora.modules=null", "lora.rank=8", "lora.alpha=16"], "LoRA on the coupling"),
    ([], None)])  # the example trains the gates
def test_flowforge_check_warns_from_the_weights_file(tmp_path, caplog, overrides, warned):
    """`flowforge check` (no model built) reads the gates from the weights file and warns as the loaded model does
    (a closed-gate copy of demo:world; demo:world itself is not warned); at train start the loaded check does not
    log the same warning a second time."""
    from flowforge.config import load_config
    from flowforge.demo.paths import resolve_demo_path
    from flowforge.models.world_model.adapter import read_coupling_gates
    from flowforge.train.preflight import preflight
    from flowforge.train.preflight.loaded import check_loaded_model
    from tests.cli.harness import run_cli

    example = pathlib.Path(__file__).resolve().parents[3] / "examples" / "worldmodel" / "nft.yaml"
    closed = _closed_copy(tmp_path)
    for path, expect in ((closed, warned), (resolve_demo_path("demo:world"), None)):
        rc, stdout, stderr = run_cli(["check", example, f"model.path={path}", *overrides], tmp_path)
        assert rc == 0 and stdout == f"OK: {example}\n", stderr
        assert ("barely change the video" in stderr) == (expect is not None) and (expect or "") in stderr
    model = build_adapter("world_model", str(closed), task="i2v")
    gates = read_coupling_gates(closed)
    assert gates == [float(b.coupling.gate.detach().abs()) for b in model.transformer.blocks] == [0.0] * 4
    assert max(read_coupling_gates(resolve_demo_path("demo:world"))) > 1e-2
    cfg = load_config(example, [f"model.path={closed}", *overrides])
    static = preflight(cfg).warnings
    with caplog.at_level("WARNING"):
        loaded = check_loaded_model(cfg, model, already=static)
    assert [w for w in static if "barely change" in w] == loaded  # the same words from the file and the model
    assert "barely change" not in caplog.text
