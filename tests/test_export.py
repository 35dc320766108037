"""Export: a real LoRA run (rank 4, alpha 8) exported as adapter and merged, reloaded through diffusers / peft, gives
the trained model's outputs; full fine-tune and pipeline-directory layouts; missing / wrong base; the CLI."""

import shutil
import warnings

import pytest
import torch

from flowforge.train import checkpoint as ckpt
from flowforge.cli import main
from flowforge.config import dump_config
from flowforge.tools.export import ExportError, export_run, read_export_meta
from flowforge.models import lora as lora_lib
from flowforge.models.base import Conditioning
from flowforge.models.sd3 import SD3Adapter
from tests.test_trainer import tiny_cfg

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
    assert {"config.json", "diffusion_pytorch_model.safetensors", "flowforge.json"} <= {p.name for p in
                                                                                       out.iterdir()}
    assert (out / "flowforge.json").read_text() == (tiny_model_dir / "flowforge.json").read_text()
    t = fresh(out)
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
    assert (probe(fresh(out)) - trained).abs().max() <= 1e-4 * max(1.0, float(trained.abs().max()))
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
    assert (probe(fresh(tmp_path / "m")) - trained).abs().max() <= 1e-4 * max(1.0, float(trained.abs().max()))


def test_failed_verification_writes_nothing(lora_run, tmp_path, monkeypatch):
    from flowforge.tools import export

    run_dir, _, _ = lora_run
    monkeypatch.setitem(export.TOLERANCES, "merged", -1.0)  # any difference, even 0, now fails
    with pytest.raises(export.ExportVerificationError, match="verification failed"):
        export_run(run_dir, tmp_path / "m", form="merged", verify=True)
    assert main(["export", str(run_dir), str(tmp_path / "m"), "--form", "merged", "--verify"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ crafted runs
def _crafted_run(tmp_path, base_dir, cache_dir, tensors, lora, sharded_writer=None):
    """A run directory without training: config.yaml + one committed checkpoint with the given live weights."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = tiny_cfg(base_dir, tmp_path, cache_dir)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    ckpt.save_checkpoint(run_dir, 1, tensors={"live": tensors} if tensors else {}, optimizer_state=None, keep=1,
                         trainer_state={"step": 1, "lora": lora, "base_model_sha256": ckpt.sha256_of_path(base_dir)},
                         sharded_writer=sharded_writer)
    return run_dir


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


def test_full_finetune_exports_merged_only(tiny_model_dir, encode_cache_dir, tmp_path):
    t = fresh(tiny_model_dir)
    with torch.no_grad():
        for p in t.parameters():
            p.add_(0.01 * torch.randn_like(p))
    expected = probe(t)
    run_dir = _crafted_run(tmp_path, tiny_model_dir, encode_cache_dir, t.state_dict(),
                           {"trainable": "full", "dropout": 0.0})
    with pytest.raises(ExportError, match="--form merged"):
        export_run(run_dir, tmp_path / "a", form="adapter")
    out = export_run(run_dir, tmp_path / "m", form="merged", verify=True)
    assert read_export_meta(out)["verify"]["max_abs_diff"] <= 1e-5
    assert torch.equal(probe(fresh(out)), expected)


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
