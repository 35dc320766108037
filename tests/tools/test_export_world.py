"""Issue 14: export of a world-model run (demo:world trained 1 step) in its own format and as its trained tensors,
for module mode (exact submodules fine-tuned) and coupling-LoRA mode; reloaded the way a user would, the exports
give the trained policy's velocity; the source checkpoint is never written over; ``flowforge sample`` and the
trainer load a merged export."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from flowforge.cli import main
from flowforge.data.prompts import load_prompts
from flowforge.demo.paths import demo_world_dir
from flowforge.models.world_model.adapter import load_world_model
from flowforge.tools.export import ExportError, export_run, read_export_meta
from tests.cli.harness import assert_one_line_error, run_cli
from tests.tools.test_export import tree_digest
from tests.train.test_world_model_train import LORA, _trainer

MODULES = ["latent_state_rollout.transition", "blocks.0.coupling"]  # the coupling gate moves the video


def probe(adapter, seed=7):
    """Velocities ``[3, 1, 8, 32, 32]`` of a world-model adapter on real action prompts and random first frames,
    inputs independent of the ones export's verify uses."""
    g = torch.Generator().manual_seed(seed)
    prompts = ["LEFT LEFT RIGHT NOOP NOOP LEFT RIGHT RIGHT", "NOOP RIGHT RIGHT RIGHT LEFT LEFT NOOP NOOP",
               "RIGHT RIGHT RIGHT RIGHT LEFT LEFT LEFT LEFT"]
    shape = adapter.latent_shape(32, 32, 8)
    cond = adapter.condition_on_images(adapter.encode(prompts), prompts, torch.rand(3, 3, 32, 32, generator=g), shape)
    x = torch.randn(3, *shape, generator=g)
    with torch.no_grad():
        return adapter.velocity(x, torch.tensor([0.2, 0.5, 0.9]), cond, 1.0)


def _train(root, name, cache, *extra):
    """A 1-step NFT run from ``root/source`` (a private copy of demo:world), its trained and base velocities and
    the names / values of its trained weights."""
    trainer = _trainer(root, cache, "nft", f"run.name={name}", f"model.path={root / 'source'}", "checkpoint.every=1",
                       "train.lr=1e-2", *extra)
    trainer.train()
    t = trainer.adapter.transformer
    with trainer.policy.using("live"):
        trained = probe(trainer.adapter)
        weights = {k: v.detach().clone() for k, v in trainer.policy.named_weights("live").items()}
        grads = sorted(n for n, p in t.named_parameters() if p.requires_grad)
    base = probe(load_world_model(root / "source"))
    assert (trained - base).abs().max() > 0  # training moved the model: the comparisons below are not vacuous
    return trainer.run_dir, trained, weights, grads


@pytest.fixture(scope="module")
def world_runs(tmp_path_factory):
    """``{"module": (run_dir, v_trained, weights, trainable names), "lora": (...)}`` over one source copy."""
    root = tmp_path_factory.mktemp("world_export")
    shutil.copytree(demo_world_dir(), root / "source")
    cache = tmp_path_factory.mktemp("world_cache")
    modules = f"lora.modules=[{','.join(MODULES)}]"
    runs = {"module": _train(root, "module", cache, "lora.trainable=module", modules),
            "lora": _train(root, "lora", cache, *LORA)}
    return root, runs


def test_module_run_exports_its_own_format_and_exactly_the_trained_tensors(world_runs, tmp_path, capsys):
    root, runs = world_runs
    run_dir, trained, weights, grads = runs["module"]
    assert main(["export", str(run_dir), str(tmp_path / "m"), "--form", "merged", "--verify"]) == 0
    assert "passed" in capsys.readouterr().out
    report = read_export_meta(tmp_path / "m")["verify"]
    assert report["max_abs_diff"] == 0.0 and report["base_diff"] > 0 and report["passed"]
    card = (tmp_path / "m" / "README.md").read_text()
    assert "--prompt-file demo:world-eval" in card and '--prompt "..."' not in card  # i2v needs first frames
    merged = load_world_model(tmp_path / "m")  # the own format: config.json + safetensors + flowforge.json
    assert torch.equal(probe(merged), trained)
    assert merged.action_names == ("NOOP", "LEFT", "RIGHT")
    # the adapter form: exactly the trained submodules' tensors under their full names, and a json describing them
    assert main(["export", str(run_dir), str(tmp_path / "a"), "--form", "adapter", "--verify"]) == 0
    assert read_export_meta(tmp_path / "a")["verify"]["max_abs_diff"] == 0.0
    tensors = load_file(str(tmp_path / "a" / "trained_modules.safetensors"))
    assert set(tensors) == set(weights) and set(grads) <= set(tensors)
    # portable (issue 27 item 8): no path of this machine in either export (source_provenance.json included), and
    # the card's code run from inside the adapter export finds the base relative to it
    from tests.tools.test_export_portable import machine_paths_in, source_paths

    for name in ("m", "a"):
        assert machine_paths_in(tmp_path / name, source_paths(root, run_dir, tmp_path)) == [], name
    snippet = (tmp_path / "a" / "README.md").read_text().split("```python")[1].split("```")[0]
    here = os.getcwd()
    try:
        os.chdir(tmp_path / "a")
        scope: dict = {}
        exec(snippet, scope)  # noqa: S102 - the card's own loading code
    finally:
        os.chdir(here)
    assert torch.equal(probe(scope["model"]), trained)
    assert all(any(k.startswith(m + ".") for m in MODULES) for k in tensors)
    assert all(torch.equal(tensors[k], weights[k]) for k in tensors)
    meta = json.loads((tmp_path / "a" / "trained_modules.json").read_text())
    assert meta["modules"] == sorted(MODULES) and sorted(meta["tensors"]) == sorted(tensors)
    assert meta["tensors"][grads[0]]["shape"] == list(tensors[grads[0]].shape)
    fresh = load_world_model(root / "source")
    fresh.transformer.load_state_dict(tensors, strict=False)  # the card's loading snippet
    assert torch.equal(probe(fresh), trained)


def test_lora_run_exports_merged_weights_and_the_peft_adapter(world_runs, tmp_path, caplog):
    from peft import PeftModel

    root, runs = world_runs
    run_dir, trained, weights, _ = runs["lora"]
    export_run(run_dir, tmp_path / "m", form="merged", verify=True)
    report = read_export_meta(tmp_path / "m")["verify"]
    assert report["passed"] and report["base_diff"] > report["max_abs_diff"]
    state = load_file(str(tmp_path / "m" / "diffusion_pytorch_model.safetensors"))
    assert not any("lora" in k or "base_layer" in k for k in state)  # folded in: W + (alpha / rank) B A
    merged = probe(load_world_model(tmp_path / "m"))
    assert (merged - trained).abs().max() <= 1e-4 * max(1.0, float(trained.abs().max()))
    export_run(run_dir, tmp_path / "a", form="adapter", verify=True)
    adapter = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert set(adapter) == {"base_model.model." + k for k in weights}
    assert {k.split(".lora_")[0] for k in weights} == {f"blocks.{i}.coupling.{n}" for i in range(4)
                                                         for n in ("q", "k", "v", "out")}
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16.0)
    user = load_world_model(root / "source")
    PeftModel.from_pretrained(user.transformer, str(tmp_path / "a"))  # the card's loading snippet
    assert (probe(user) - trained).abs().max() <= 1e-5 * max(1.0, float(trained.abs().max()))
    # sampling the export logs the base's provenance as one line (issue 27 item 4: was a 14-line table)
    from flowforge.tools.sample.load import load_for_sampling

    with caplog.at_level("INFO"):
        sampled = load_for_sampling(tmp_path / "a").adapter
    lines = [r.getMessage() for r in caplog.records if "provenance" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert (probe(sampled) - trained).abs().max() <= 1e-5 * max(1.0, float(trained.abs().max()))


def test_export_into_the_source_checkpoint_is_refused(world_runs, tmp_path):
    root, runs = world_runs
    source = root / "source"
    before = tree_digest(source)
    for run_dir, *_ in runs.values():
        for out, why in ((source, "is the base model directory"), (source / "exported", "lies inside the base")):
            for form in ("merged", "adapter"):
                with pytest.raises(ExportError, match=why):
                    export_run(run_dir, out, form=form, verify=True, overwrite=True)
    rc, stdout, stderr = run_cli(["export", runs["module"][0], source, "--form", "merged", "--overwrite"], tmp_path)
    assert_one_line_error(rc, stderr, [str(source), "base model directory"])
    assert stdout == "" and tree_digest(source) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_sample_and_train_load_a_merged_world_model_export(world_runs, tmp_path, capsys):
    root, runs = world_runs
    run_dir, trained, _, _ = runs["module"]
    out = export_run(run_dir, tmp_path / "m", form="merged")
    first = load_prompts("demo:world-eval")[0]  # one held-out start: its first frame (absolute path) and actions
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"prompt": first.prompt, "metadata": first.metadata}) + "\n")
    assert main(["sample", str(out), "--prompt-file", str(rows), "--num", "1", "--steps", "2",
                 "--out", str(tmp_path / "g.png")]) == 0
    info = json.loads((tmp_path / "g.json").read_text())
    assert info["source"] == f"merged export {out}" and info["images"][0]["prompt"] == first.prompt
    capsys.readouterr()
    # a world model needs a first frame: actions alone are refused in one line naming where frames come from
    assert main(["sample", str(out), "--prompt", first.prompt, "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "condition image" in err and "--prompt-file demo:world-eval" in err
    # model.path=OUT trains from the export: the trainer's model is the trained policy
    trainer = _trainer(tmp_path / "runs", tmp_path / "cache", "nft", f"model.path={out}", "lora.trainable=module",
                       f"lora.modules=[{','.join(MODULES)}]")
    assert torch.equal(probe(trainer.adapter), trained)


@pytest.mark.slow  # 15-30 s of training on 2 cores: CI runs it in the slow set (the default run stays near 10 min)
def test_module_lora_run_exports_merged_and_both_adapter_files(tmp_path):
    """``lora.trainable: module+lora`` (B in full + the coupling LoRA): merged = B overlaid and the LoRA folded in,
    verified and reloaded equal within the merged tolerance; adapter = the module file and peft's, verified; the
    run, the merged export and the adapter export load for sampling as the trained policy."""
    from flowforge.tools.sample.load import load_for_sampling
    from tests.train.test_world_model_module_lora import B, MODULE_LORA

    shutil.copytree(demo_world_dir(), tmp_path / "source")
    run_dir, trained, weights, _ = _train(tmp_path, "ml", tmp_path / "cache", *MODULE_LORA)
    module_keys = {k for k in weights if k.startswith(B + ".")}
    lora_keys = set(weights) - module_keys
    assert module_keys and lora_keys and all(".lora_" in k and ".coupling." in k for k in lora_keys)
    tol = 1e-4 * max(1.0, float(trained.abs().max()))
    assert main(["export", str(run_dir), str(tmp_path / "m"), "--form", "merged", "--verify"]) == 0
    report = read_export_meta(tmp_path / "m")["verify"]
    assert report["passed"] and report["base_diff"] > report["max_abs_diff"]
    state = load_file(str(tmp_path / "m" / "diffusion_pytorch_model.safetensors"))
    assert not any("lora" in k or "base_layer" in k for k in state)
    assert all(torch.equal(state[k], weights[k]) for k in module_keys)  # B overlaid as trained
    assert (probe(load_world_model(tmp_path / "m")) - trained).abs().max() <= tol
    assert (probe(load_for_sampling(tmp_path / "m").adapter) - trained).abs().max() <= tol
    export_run(run_dir, tmp_path / "a", form="adapter", verify=True)
    assert read_export_meta(tmp_path / "a")["verify"]["passed"]
    tensors = load_file(str(tmp_path / "a" / "trained_modules.safetensors"))
    peft_tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert set(tensors) == module_keys and set(peft_tensors) == {"base_model.model." + k for k in lora_keys}
    assert json.loads((tmp_path / "a" / "trained_modules.json").read_text())["modules"] == [B]
    card = (tmp_path / "a" / "README.md").read_text()
    assert "trained_modules.safetensors" in card and "PeftModel.from_pretrained" in card
    exact = 1e-5 * max(1.0, float(trained.abs().max()))
    assert (probe(load_for_sampling(tmp_path / "a").adapter) - trained).abs().max() <= exact
    assert (probe(load_for_sampling(run_dir).adapter) - trained).abs().max() <= exact


def test_the_own_format_families_and_the_writer_table_name_the_same_families():
    """read_run_config accepts OWN_FORMAT_FAMILIES; export_run dispatches through WRITERS (every other family goes to
    the diffusers writer): a family in one list only would be accepted and then written as diffusers files."""
    from flowforge.tools.export import WRITERS
    from flowforge.models import OWN_FORMAT_FAMILIES

    assert sorted(WRITERS) == sorted(OWN_FORMAT_FAMILIES)
