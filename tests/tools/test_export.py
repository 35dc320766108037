"""Export: a real LoRA run (rank 4, alpha 8) exported as adapter and merged, reloaded through diffusers / peft, gives
the trained model's outputs; full fine-tune and pipeline-directory layouts; missing / wrong base; the CLI. Safety:
OUT never destroys data (protected directories, the ownership marker, --overwrite), damaged checkpoint files are
named, and tensors that do not match the run's contract are refused."""

import shutil
import warnings

import pytest
import torch

from flowforge.runtime.run_dir import sha256_of_path
from flowforge.train import checkpoint as ckpt
from flowforge.cli import main
from flowforge.config import dump_config
from flowforge.tools.export import ExportError, export_run, read_export_meta
from flowforge.models import lora as lora_lib
from flowforge.models.base import Conditioning
from flowforge.models.sd3.adapter import SD3Adapter
from tests.train.test_trainer import tiny_cfg

RANK, ALPHA = 4, 8


def probe(transformer, seed=7):
    """Velocities of ``transformer`` on inputs independent of the ones export's verify uses."""
    g = torch.Generator().manual_seed(seed)
    c = transformer.config
    x = torch.randn(3, c.in_channels, c.sample_size, c.sample_size, generator=g)
    cond = Conditioning(prompt_embeds=torch.randn(3, 5, c.joint_attention_dim, generator=g),
                        pooled=torch.randn(3, c.pooled_projection_dim, generator=g))
    with torch.no_grad():
        return SD3Adapter(transformer.eval()).velocity(x, torch.tensor([0.1, 0.5, 0.95]), cond, 1.0)


def fresh(path):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(str(path), local_files_only=True).eval()


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, encode_cache_dir, tmp_path_factory):
    """A 2-step GRPO LoRA run (rank 4, alpha 8, checkpoint every step) and the trained policy's probe velocities,
    taken from the trainer's own in-memory model right after training."""
    from flowforge.train.trainer import Trainer

    out = tmp_path_factory.mktemp("export_runs")
    trainer = Trainer(tiny_cfg(tiny_model_dir, out, encode_cache_dir, f"lora.rank={RANK}", f"lora.alpha={ALPHA}",
                               "checkpoint.every=1", "train.lr=1e-2", "run.name=lora"), progress=False)
    run_dir = trainer.train()
    with trainer.policy.using("live"):
        trained = probe(trainer.adapter.transformer)
    with trainer.policy.using("ref"):
        base = probe(trainer.adapter.transformer)
    assert (trained - base).abs().max() > 1e-3  # training moved the model: the comparisons below are not vacuous
    return run_dir, trained, base


def test_adapter_export_loads_through_diffusers_and_peft(lora_run, tiny_model_dir, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    run_dir, trained, base = lora_run
    out = export_run(run_dir, tmp_path / "lora", form="adapter", verify=True)
    report = read_export_meta(out)["verify"]
    assert report["passed"] and report["max_abs_diff"] <= 1e-5 and report["base_diff"] > 1e-3
    assert read_export_meta(out)["step"] == 2 and read_export_meta(out)["lora"]["alpha"] == ALPHA

    # the pipeline's load_lora_weights on a fresh base reproduces the trained policy; alpha 8 (scale 2) honoured
    pipe = StableDiffusion3Pipeline(transformer=fresh(tiny_model_dir), scheduler=FlowMatchEulerDiscreteScheduler(),
                                    vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                    tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)
    pipe.load_lora_weights(str(out))
    (config,) = pipe.transformer.peft_config.values()
    assert (config.r, config.lora_alpha) == (RANK, ALPHA)
    v = probe(pipe.transformer)
    assert (v - trained).abs().max() <= 1e-5
    assert (v - base).abs().max() > 1e-3  # not a no-op

    # the model-level loader, and plain peft from adapter_config.json
    t = fresh(tiny_model_dir)
    t.load_lora_adapter(str(out), prefix="transformer", use_safetensors=True)
    assert (probe(t) - trained).abs().max() <= 1e-5
    state = {k.removeprefix("transformer."): v for k, v in load_file(str(out / "pytorch_lora_weights.safetensors"))
             .items()}
    t = inject_adapter_in_model(LoraConfig.from_pretrained(str(out)), fresh(tiny_model_dir))
    set_peft_model_state_dict(t, state)
    assert (probe(t) - trained).abs().max() <= 1e-5
    # flowforge's checkpoint keys are peft's get_peft_model_state_dict keys
    assert sorted(get_peft_model_state_dict(t)) == sorted(state)


def test_merged_export_reloads_with_from_pretrained(lora_run, tiny_model_dir, tmp_path):
    run_dir, trained, base = lora_run
    out = export_run(run_dir, tmp_path / "merged", form="merged", verify=True)
    report = read_export_meta(out)["verify"]
    assert report["passed"] and report["max_abs_diff"] <= 1e-4 * max(1.0, report["max_abs_trained"])
    # a MiniLM demo base becomes a diffusers pipeline directory: the merged transformer is in transformer/
    assert {"config.json", "diffusion_pytorch_model.safetensors", "flowforge.json"} <= {
        p.name for p in (out / "transformer").iterdir()}
    assert (out / "transformer" / "flowforge.json").read_text() == (tiny_model_dir / "flowforge.json").read_text()
    t = fresh(out / "transformer")
    assert not any("lora" in k for k in t.state_dict())
    v = probe(t)
    assert (v - trained).abs().max() <= 1e-4 * max(1.0, float(trained.abs().max()))
    assert (v - base).abs().max() > 1e-3


def test_step_selection_and_refusals(lora_run, tmp_path):
    run_dir, _, _ = lora_run
    out = export_run(run_dir, tmp_path / "s1", form="adapter", step=1)
    assert read_export_meta(out)["step"] == 1 and read_export_meta(out)["verify"] is None
    with pytest.raises(ExportError, match="not a committed checkpoint"):
        export_run(run_dir, tmp_path / "s9", form="adapter", step=9)
    with pytest.raises(ExportError, match="not empty"):
        export_run(run_dir, out, form="adapter")
    with pytest.raises(ExportError, match="allowed"):
        export_run(run_dir, tmp_path / "x", form="fused")
    with pytest.raises(ExportError, match="no 'ema' weights"):
        export_run(run_dir, tmp_path / "x", form="adapter", weights="ema")
    assert not (tmp_path / "x").exists()


def _copy_run_with_base(run_dir, dest, base_path):
    from flowforge.config import load_config

    shutil.copytree(run_dir, dest)
    cfg = load_config(dest / "config.yaml", [f"model.path={base_path}"])
    (dest / "config.yaml").write_text(dump_config(cfg))
    return dest


def test_merged_export_without_base_says_how_to_pass_it(lora_run, tiny_model_dir, tmp_path):
    from flowforge.config import load_config

    run_dir, trained, _ = lora_run
    moved = _copy_run_with_base(run_dir, tmp_path / "moved", tmp_path / "gone")
    assert load_config(moved / "config.yaml").model.path == str(tmp_path / "gone")
    with pytest.raises(ExportError, match=r"needs the base model.*--base PATH"):
        export_run(moved, tmp_path / "m", form="merged")
    assert not (tmp_path / "m").exists()
    # the adapter needs no base (only --verify does)
    export_run(moved, tmp_path / "a", form="adapter")
    with pytest.raises(ExportError, match="needs the base model"):
        export_run(moved, tmp_path / "a2", form="adapter", verify=True)
    # --base supplies it; a different base is refused by its sha256
    out = export_run(moved, tmp_path / "m", form="merged", base=tiny_model_dir, verify=True)
    assert (probe(fresh(out / "transformer")) - trained).abs().max() <= 1e-4 * max(1.0, float(trained.abs().max()))
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    (other / "flowforge.json").write_text("{}")
    with pytest.raises(ExportError, match="not the model the run was trained from"):
        export_run(moved, tmp_path / "m2", form="merged", base=other)
    assert main(["export", str(moved), str(tmp_path / "m3"), "--form", "merged"]) == 2


def test_cli_export(lora_run, tmp_path, capsys):
    run_dir, trained, _ = lora_run
    assert main(["export", str(run_dir), str(tmp_path / "c"), "--form", "adapter", "--verify", "--step", "2"]) == 0
    assert "passed" in capsys.readouterr().out
    assert main(["export", str(run_dir), str(tmp_path / "m"), "--form", "merged"]) == 0
    v = probe(fresh(tmp_path / "m" / "transformer"))
    assert (v - trained).abs().max() <= 1e-4 * max(1.0, float(trained.abs().max()))


def test_failed_verification_writes_nothing(lora_run, tmp_path, monkeypatch):
    from flowforge.tools import export

    run_dir, _, _ = lora_run
    monkeypatch.setitem(export.TOLERANCES, "merged", -1.0)  # any difference, even 0, now fails
    with pytest.raises(export.ExportVerificationError, match="verification failed"):
        export_run(run_dir, tmp_path / "m", form="merged", verify=True)
    assert main(["export", str(run_dir), str(tmp_path / "m"), "--form", "merged", "--verify"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ crafted runs
def _crafted_run(tmp_path, base_dir, cache_dir, tensors, lora, sharded_writer=None, optimizer_state=None,
                 name="run"):
    """A run directory without training: config.yaml + one committed checkpoint with the given live weights."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    cfg = tiny_cfg(base_dir, tmp_path, cache_dir)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    ckpt.save_checkpoint(run_dir, 1, tensors={"live": tensors} if tensors else {}, optimizer_state=optimizer_state,
                         keep=1, trainer_state={"step": 1, "lora": lora,
                                                "base_model_sha256": sha256_of_path(base_dir)},
                         sharded_writer=sharded_writer)
    return run_dir


LORA_TARGETS = ["attn.to_q", "attn.to_v"]


def crafted_lora_run(tmp_path, base_dir, cache_dir, name="run"):
    """A LoRA run without training (rank 4, alpha 8 on ``LORA_TARGETS``, seeded random A and B so the adapter is
    not a no-op, an optimizer state) whose checkpoint is step 1; used by the export safety tests here and in
    tests/cli."""
    t = fresh(base_dir)
    lora_lib.inject_lora(t, RANK, ALPHA, LORA_TARGETS)
    g = torch.Generator().manual_seed(11)
    lora_lib.load_lora_state_dict(t, {k: 0.1 * torch.randn(v.shape, generator=g)
                                      for k, v in lora_lib.lora_state_dict(t).items()})
    return _crafted_run(tmp_path, base_dir, cache_dir, lora_lib.lora_state_dict(t),
                        {"trainable": "lora", "dropout": 0.0, "rank": RANK, "alpha": float(ALPHA),
                         "targets": LORA_TARGETS}, optimizer_state={"state": {0: {"exp_avg": torch.zeros(3)}}},
                        name=name)


def tree_digest(root):
    """sha256 over every path (relative), file content and symlink target under ``root``: equal before and after
    means nothing under ``root`` changed."""
    import hashlib
    import os

    h = hashlib.sha256()
    for top, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(top, name)
            h.update(os.path.relpath(path, root).encode() + b"\0")
            if os.path.islink(path):
                h.update(b"L" + os.readlink(path).encode())
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    h.update(b"F" + f.read())
    return h.hexdigest()


def test_sharded_lora_checkpoint_exports(tiny_model_dir, encode_cache_dir, tmp_path):
    """An FSDP run keeps its live weights in the checkpoint's dcp/ directory (get_model_state_dict keys, adapter
    name included): export reads them in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    t = fresh(tiny_model_dir)
    targets = ["attn.to_q", "attn.add_k_proj"]
    lora_lib.inject_lora(t, RANK, ALPHA, targets)
    g = torch.Generator().manual_seed(5)
    lora_lib.load_lora_state_dict(t, {k: 0.1 * torch.randn(v.shape, generator=g)
                                      for k, v in lora_lib.lora_state_dict(t).items()})
    expected = probe(t)
    model_state = get_model_state_dict(t, options=StateDictOptions(ignore_frozen_params=True))
    assert all(".default." in k for k in model_state if "lora_" in k)  # (plus the pos_embed buffer)

    def writer(directory):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": model_state, "optim": {"step": torch.zeros(())}}, checkpoint_id=str(directory),
                     no_dist=True)

    run_dir = _crafted_run(tmp_path, tiny_model_dir, encode_cache_dir, None,
                           {"trainable": "lora", "dropout": 0.0, "rank": RANK, "alpha": float(ALPHA),
                            "targets": targets}, sharded_writer=writer)
    out = export_run(run_dir, tmp_path / "a", form="adapter", verify=True)
    t2 = fresh(tiny_model_dir)
    t2.load_lora_adapter(str(out), prefix="transformer", use_safetensors=True)
    assert (probe(t2) - expected).abs().max() <= 1e-5


def test_full_finetune_exports_merged_only(tiny_model_dir, encode_cache_dir, tmp_path, caplog):
    t = fresh(tiny_model_dir)
    with torch.no_grad():
        for p in t.parameters():
            p.add_(0.01 * torch.randn_like(p))
    expected = probe(t)
    run_dir = _crafted_run(tmp_path, tiny_model_dir, encode_cache_dir, t.state_dict(),
                           {"trainable": "full", "dropout": 0.0})
    with pytest.raises(ExportError, match="--form merged"):
        export_run(run_dir, tmp_path / "a", form="adapter")
    caplog.set_level("INFO", logger="flowforge")  # issue 43 item 8: verify's n/a is explained in its line
    out = export_run(run_dir, tmp_path / "m", form="merged", verify=True)
    assert read_export_meta(out)["verify"]["max_abs_diff"] <= 1e-5
    assert torch.equal(probe(fresh(out / "transformer")), expected)
    assert "v_base| = n/a (not measured for lora.trainable='full': the trained weights replace the" in caplog.text


def test_merged_export_of_pipeline_base_copies_components(tiny_model_dir, encode_cache_dir, tmp_path):
    pipe_dir = tmp_path / "pipe"
    shutil.copytree(tiny_model_dir, pipe_dir / "transformer")
    (pipe_dir / "scheduler").mkdir()
    (pipe_dir / "scheduler" / "scheduler_config.json").write_text('{"_class_name": "FlowMatchEulerDiscreteScheduler"}')
    (pipe_dir / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    t = fresh(pipe_dir / "transformer")
    targets = ["attn.to_q", "attn.to_v"]
    lora_lib.inject_lora(t, RANK, ALPHA, targets)
    g = torch.Generator().manual_seed(3)
    lora_lib.load_lora_state_dict(t, {k: 0.1 * torch.randn(v.shape, generator=g)
                                      for k, v in lora_lib.lora_state_dict(t).items()})
    expected = probe(t)
    run_dir = _crafted_run(tmp_path, pipe_dir, encode_cache_dir, lora_lib.lora_state_dict(t),
                           {"trainable": "lora", "dropout": 0.0, "rank": RANK, "alpha": float(ALPHA),
                            "targets": targets})
    out = export_run(run_dir, tmp_path / "out", form="merged", verify=True)
    assert (out / "model_index.json").is_file() and (out / "scheduler" / "scheduler_config.json").is_file()
    assert (out / "transformer" / "flowforge.json").is_file()
    assert (probe(fresh(out / "transformer")) - expected).abs().max() <= 1e-4 * max(1.0, float(expected.abs().max()))


# ------------------------------------------------------------------------------------------------ safety (issue 11)
@pytest.fixture
def lora_crafted(tiny_model_dir, encode_cache_dir, tmp_path):
    return crafted_lora_run(tmp_path, tiny_model_dir, encode_cache_dir)


@pytest.mark.parametrize("where", ["run", "checkpoints", "step", "weights", "parent", "base", "cwd", "cwd_parent"])
def test_out_that_would_destroy_data_is_refused(lora_crafted, tiny_model_dir, tmp_path, monkeypatch, where):
    run_dir = lora_crafted
    step_dir = run_dir / "checkpoints" / "step_000001"
    cwd = tmp_path / "work" / "here"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    out = {"run": run_dir, "checkpoints": run_dir / "checkpoints", "step": step_dir, "weights": step_dir / "weights",
           "parent": tmp_path, "base": tiny_model_dir, "cwd": cwd, "cwd_parent": cwd.parent}[where]
    before, base_before = tree_digest(tmp_path), tree_digest(tiny_model_dir)
    for form in ("adapter", "merged"):
        with pytest.raises(ExportError, match="export directory") as info:
            export_run(run_dir, out, form=form, overwrite=True)
        assert "\n" not in str(info.value)
    assert tree_digest(tmp_path) == before and tree_digest(tiny_model_dir) == base_before


def test_out_inside_any_run_directory_or_a_symlink_is_refused(lora_crafted, tiny_model_dir, encode_cache_dir,
                                                              tmp_path):
    other = crafted_lora_run(tmp_path, tiny_model_dir, encode_cache_dir, name="other")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "file").write_text("keep me")
    before = tree_digest(tmp_path)
    for out, why in ((other, "is the run directory"), (other / "exports" / "x", "lies inside the run directory"),
                     (tmp_path / "link", "symbolic link"), (tmp_path / "file", "is a file")):
        with pytest.raises(ExportError, match=why):
            export_run(lora_crafted, out, form="adapter", overwrite=True)
    assert tree_digest(tmp_path) == before


def test_overwrite_replaces_only_a_previous_export(lora_crafted, tmp_path):
    out = export_run(lora_crafted, tmp_path / "exp" / "m", form="merged")
    meta = read_export_meta(out)
    assert meta["files"] == sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert "transformer/diffusion_pytorch_model.safetensors" in meta["files"]
    assert "flowforge_export.json" in meta["files"]
    with pytest.raises(ExportError, match="--overwrite"):
        export_run(lora_crafted, out, form="adapter")
    # an adapter export replaces the merged one: the merged files are gone, the adapter's are there
    export_run(lora_crafted, out, form="adapter", overwrite=True)
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == sorted(read_export_meta(out)["files"]) and "pytorch_lora_weights.safetensors" in names
    assert "transformer/diffusion_pytorch_model.safetensors" not in names  # the merged export's (a demo-style base
    # travels as base/transformer/ in the adapter export)
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["m"]  # no temp or aside directory left


def test_overwrite_refuses_an_export_directory_holding_anything_else(lora_crafted, tmp_path):
    out = export_run(lora_crafted, tmp_path / "a", form="adapter")
    for foreign in ("notes.txt", "sub/notes.txt", "emptydir"):
        target = out / foreign
        if foreign == "emptydir":
            target.mkdir()
        else:
            target.parent.mkdir(exist_ok=True)
            target.write_text("mine")
        before = tree_digest(out)
        with pytest.raises(ExportError, match="did not write"):
            export_run(lora_crafted, out, form="adapter", overwrite=True)
        assert tree_digest(out) == before
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        if foreign.startswith("sub/"):
            (out / "sub").rmdir()
    export_run(lora_crafted, out, form="adapter", overwrite=True)  # clean again: replaced


@pytest.mark.parametrize("marker", ['{"form": "adapter"}', '{"files": ["../victim.txt"]}', "garbage"])
def test_overwrite_refuses_a_marker_without_a_safe_file_list(lora_crafted, tmp_path, marker):
    out = tmp_path / "old"
    out.mkdir()
    (out / "flowforge_export.json").write_text(marker)
    (tmp_path / "victim.txt").write_text("keep")
    before = tree_digest(tmp_path)
    with pytest.raises(ExportError, match="flowforge_export.json"):
        export_run(lora_crafted, out, form="adapter", overwrite=True)
    assert tree_digest(tmp_path) == before


def test_non_empty_out_without_marker_is_refused_even_with_overwrite(lora_crafted, tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "precious.bin").write_bytes(b"\1\2")
    with pytest.raises(ExportError, match="not a flowforge export"):
        export_run(lora_crafted, out, form="adapter", overwrite=True)
    assert (out / "precious.bin").read_bytes() == b"\1\2"


def test_failed_export_leaves_a_previous_export_as_it_was(lora_crafted, tmp_path, monkeypatch):
    from flowforge.tools import export

    out = export_run(lora_crafted, tmp_path / "m", form="merged")
    before = tree_digest(tmp_path)
    monkeypatch.setitem(export.TOLERANCES, "merged", -1.0)
    with pytest.raises(export.ExportVerificationError):
        export_run(lora_crafted, out, form="merged", verify=True, overwrite=True)
    assert tree_digest(tmp_path) == before


def _rename_key(weights_file, old, new):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights_file))
    tensors[new] = tensors.pop(old)
    save_file(tensors, str(weights_file))


def _refresh_manifest(step_dir):
    """Rewrite the manifest's sizes after a deliberate edit (so only the edit itself is wrong)."""
    import json

    manifest = json.loads((step_dir / "COMMITTED").read_text())
    manifest["files"] = {rel: (step_dir / rel).stat().st_size for rel in manifest["files"]}
    if "sha256" in manifest:  # checkpoints record per-file sha256 digests too
        from flowforge.train.checkpoint import sha256_file

        manifest["sha256"] = {rel: sha256_file(step_dir / rel) for rel in manifest["sha256"]}
    (step_dir / "COMMITTED").write_text(json.dumps(manifest))


@pytest.mark.parametrize("rename", ["module", "suffix", "drop_b"])
def test_checkpoint_with_a_foreign_tensor_key_is_refused(lora_crafted, tmp_path, rename):
    from safetensors.torch import load_file, save_file

    step_dir = lora_crafted / "checkpoints" / "step_000001"
    weights = step_dir / "weights" / "live.safetensors"
    key = "transformer_blocks.0.attn.to_q.lora_A.weight"
    if rename == "drop_b":
        tensors = load_file(str(weights))
        del tensors["transformer_blocks.0.attn.to_q.lora_B.weight"]
        save_file(tensors, str(weights))
        bad = "transformer_blocks.0.attn.to_q.lora_B.weight"
    else:
        bad = {"module": key.replace("to_q", "to_qq"), "suffix": key + "_renamed"}[rename]
        _rename_key(weights, key, bad)
    _refresh_manifest(step_dir)
    for form in ("adapter", "merged"):
        with pytest.raises(ExportError, match="live.safetensors") as info:
            export_run(lora_crafted, tmp_path / form, form=form)
        assert repr(bad) in str(info.value) and not (tmp_path / form).exists()
    # without a local base the LoRA keys' form, targets and pairs are still checked
    moved = _copy_run_with_base(lora_crafted, tmp_path / "moved", tmp_path / "gone")
    with pytest.raises(ExportError, match="live.safetensors"):
        export_run(moved, tmp_path / "a2", form="adapter")


def test_wrong_rank_or_a_foreign_full_finetune_key_is_refused(tiny_model_dir, encode_cache_dir, tmp_path):
    t = fresh(tiny_model_dir)
    lora_lib.inject_lora(t, 2, ALPHA, LORA_TARGETS)  # rank 2 weights under a rank-4 contract
    rank2 = _crafted_run(tmp_path, tiny_model_dir, encode_cache_dir, lora_lib.lora_state_dict(t),
                         {"trainable": "lora", "dropout": 0.0, "rank": RANK, "alpha": float(ALPHA),
                          "targets": LORA_TARGETS}, name="rank2")
    with pytest.raises(ExportError, match="not a rank-4"):
        export_run(rank2, tmp_path / "a", form="adapter")
    state = fresh(tiny_model_dir).state_dict()
    key = sorted(state)[0]
    state[key + "_x"] = state.pop(key)
    full = _crafted_run(tmp_path, tiny_model_dir, encode_cache_dir, state, {"trainable": "full", "dropout": 0.0})
    with pytest.raises(ExportError, match=repr(key + "_x")):
        export_run(full, tmp_path / "m", form="merged")
    assert not (tmp_path / "a").exists() and not (tmp_path / "m").exists()


@pytest.mark.parametrize("damage", ["safetensors_header", "optimizer_zeroed", "trainer_state_garbage",
                                    "manifest_checksum"])
def test_damaged_checkpoint_file_is_named(lora_crafted, tmp_path, damage):
    import json

    step_dir = lora_crafted / "checkpoints" / "step_000001"
    if damage == "manifest_checksum":  # the hook for checkpoint checksums (a manifest with per-file sha256)
        manifest = json.loads((step_dir / "COMMITTED").read_text())
        manifest["sha256"] = {"weights/live.safetensors": "0" * 64}
        (step_dir / "COMMITTED").write_text(json.dumps(manifest))
        name, why = "live.safetensors", "sha256"
    else:
        name, why = {"safetensors_header": ("weights/live.safetensors", "SafetensorError"),
                     "optimizer_zeroed": ("optimizer.pt", "not a torch.save archive"),
                     "trainer_state_garbage": ("trainer_state.json", "not valid JSON")}[damage]
        f = step_dir / name
        data = bytearray(f.read_bytes())
        if damage == "safetensors_header":
            data[8:24] = b"#" * 16  # the JSON header (after its 8-byte length) becomes garbage; size unchanged
        else:
            data[:] = b"\0" * len(data) if damage == "optimizer_zeroed" else b"}" * len(data)
        f.write_bytes(bytes(data))
        # checksums that agree with the damage (as after a copy tool rewrote the manifest): the reader must name it
        _refresh_manifest(step_dir)
    before = tree_digest(lora_crafted)
    with pytest.raises(ExportError, match=why) as info:
        export_run(lora_crafted, tmp_path / "out", form="adapter")
    assert name.split("/")[-1] in str(info.value) and "--step" in str(info.value)
    assert tree_digest(lora_crafted) == before and not (tmp_path / "out").exists()
