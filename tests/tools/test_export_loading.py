"""Exports load in the ecosystem's own tools: the loading code runs in a subprocess that imports only torch,
diffusers, peft and transformers (never flowforge), and its outputs are compared with flowforge's."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from flowforge.tools.export import export_run, read_export_meta
from tests.tools.test_export import fresh, lora_run, probe  # noqa: F401 - lora_run is a fixture

PROMPTS = ["the digit 7", "the number 3"]


def run_outside_flowforge(script, tmp_path, **paths):
    """Run ``script`` (formatted with ``paths``) in a fresh interpreter where importing flowforge fails."""
    guard = textwrap.dedent("""
        import sys
        class _NoFlowforge:
            def find_spec(self, name, path=None, target=None):
                if name == "flowforge" or name.startswith("flowforge."):
                    raise ImportError("the loading code must not import flowforge")
        sys.meta_path.insert(0, _NoFlowforge())
    """)
    file = tmp_path / "load.py"
    file.write_text(guard + textwrap.dedent(script).format(**{k: str(v) for k, v in paths.items()}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    proc = subprocess.run([sys.executable, str(file)], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def probe_inputs(transformer_config, seed=7):
    """The inputs :func:`tests.tools.test_export.probe` uses, as the raw transformer arguments."""
    g = torch.Generator().manual_seed(seed)
    c = transformer_config
    x = torch.randn(3, c.in_channels, c.sample_size, c.sample_size, generator=g)
    embeds = torch.randn(3, 5, c.joint_attention_dim, generator=g)
    pooled = torch.randn(3, c.pooled_projection_dim, generator=g)
    return {"x": x, "embeds": embeds, "pooled": pooled, "timestep": 1000.0 * torch.tensor([0.1, 0.5, 0.95])}


def test_adapter_export_loads_with_peft_and_load_lora_weights(lora_run, tiny_model_dir, tmp_path):
    run_dir, trained, base = lora_run
    out = export_run(run_dir, tmp_path / "lora", form="adapter")
    files = set(read_export_meta(out)["files"])
    assert {"adapter_model.safetensors", "adapter_config.json", "pytorch_lora_weights.safetensors", "README.md",
            "config.yaml"} <= files
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and (config["r"], config["lora_alpha"]) == (4, 8)
    # the base as the export names it: relative to the export (no path of this machine, tools.export.portable)
    assert config["base_model_name_or_path"] == os.path.relpath(tiny_model_dir.resolve(), out.resolve())
    assert config["target_modules"]
    torch.save(probe_inputs(fresh(tiny_model_dir).config), tmp_path / "inputs.pt")
    run_outside_flowforge("""
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
        from peft import PeftModel

        inp = torch.load("{tmp}/inputs.pt")

        def velocity(model):
            with torch.no_grad():
                return model(hidden_states=inp["x"], encoder_hidden_states=inp["embeds"],
                             pooled_projections=inp["pooled"], timestep=inp["timestep"], return_dict=False)[0]

        peft = PeftModel.from_pretrained(SD3Transformer2DModel.from_pretrained("{base}").eval(), "{out}").eval()
        pipe = StableDiffusion3Pipeline(transformer=SD3Transformer2DModel.from_pretrained("{base}").eval(),
                                        scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
                                        tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
                                        tokenizer_3=None)
        pipe.load_lora_weights("{out}")
        torch.save({{"peft": velocity(peft), "diffusers": velocity(pipe.transformer)}}, "{tmp}/v.pt")
    """, tmp_path, tmp=tmp_path, base=tiny_model_dir, out=out)
    v = torch.load(tmp_path / "v.pt")
    merged = export_run(run_dir, tmp_path / "merged", form="merged")
    v_merged = probe(fresh(merged / "transformer"))
    for name in ("peft", "diffusers"):
        assert torch.allclose(v[name], trained, atol=1e-5), name  # the trainer's live weights
        assert torch.allclose(v[name], v_merged, atol=1e-4), name  # flowforge's merged export
        assert (v[name] - base).abs().max() > 1e-3  # the adapter is not a no-op


def test_merged_demo_export_is_a_custom_diffusers_pipeline_equal_to_flowforge_sample(lora_run, tmp_path):
    from flowforge.rollout import candidate_noise
    from flowforge.tools.sample import run_sample

    run_dir, _, _ = lora_run
    copy = tmp_path / "run_copy"  # the export must work once the run directory is gone
    shutil.copytree(run_dir, copy)
    out = export_run(copy, tmp_path / "merged", form="merged", verify=True)
    shutil.rmtree(copy)
    names = set(read_export_meta(out)["files"])
    assert {"pipeline.py", "model_index.json", "README.md", "config.yaml", "transformer/config.json",
            "transformer/flowforge.json", "scheduler/scheduler_config.json"} <= names
    assert any(n.startswith("text_encoder/") for n in names) and any(n.startswith("tokenizer/") for n in names)
    assert "flowforge" not in (out / "pipeline.py").read_text().split('"""')[-1].replace("flowforge export", "")
    assert read_export_meta(out)["verify"]["passed"]

    num, seed = 2, 1
    ours = run_sample(out, tmp_path / "grid.png", prompts=PROMPTS, num=num, seed=seed).media  # [4, 3, 32, 32]
    latents = candidate_noise(list(range(len(PROMPTS) * num)), (1, 32, 32), seed, -1)
    torch.save(latents, tmp_path / "latents.pt")
    run_outside_flowforge("""
        import json, torch
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained("{out}", custom_pipeline="{out}/pipeline.py",
                                         trust_remote_code=True)
        assert type(pipe).__name__ == "FlowforgeDigitsPipeline"
        prompts = json.loads('{prompts}')
        images = pipe(prompts, num_images_per_prompt=2, latents=torch.load("{tmp}/latents.pt"), output_type="pt").images
        pil = pipe(prompts[:1], generator=torch.Generator().manual_seed(0)).images
        assert len(pil) == 1 and pil[0].size == (32, 32)
        torch.save(images, "{tmp}/images.pt")
    """, tmp_path, out=out, tmp=tmp_path, prompts=json.dumps(PROMPTS))
    theirs = torch.load(tmp_path / "images.pt")
    assert theirs.shape == ours.shape
    assert torch.allclose(theirs, ours, atol=1e-5), float((theirs - ours).abs().max())


@pytest.mark.parametrize("form", ["adapter", "merged"])
def test_every_export_has_a_model_card_and_the_run_config(lora_run, tiny_model_dir, tmp_path, form):
    run_dir, _, _ = lora_run
    copy = tmp_path / "run_copy"
    shutil.copytree(run_dir, copy)
    (copy / "eval.jsonl").write_text('{"step": 1, "eval/digit_eval_mean": 0.7}\nnot json\n'
                                     '{"step": 2, "eval/digit_eval_mean": 0.5}\n')
    out = export_run(copy, tmp_path / form, form=form)
    card = (out / "README.md").read_text()
    meta = read_export_meta(out)
    assert "README.md" in meta["files"] and "config.yaml" in meta["files"]
    exported, trained = (yaml.safe_load(p.read_text()) for p in (out / "config.yaml", run_dir / "config.yaml"))
    assert exported["model"]["path"] == os.path.relpath(tiny_model_dir.resolve(), out.resolve())
    assert exported["run"]["output_dir"] == os.path.relpath(trained["run"]["output_dir"], out.resolve())
    assert {k: v for k, v in exported.items() if k not in ("model", "run", "data")} == \
        {k: v for k, v in trained.items() if k not in ("model", "run", "data")}
    assert "| `eval/digit_eval_mean` | 0.5 (2) | 0.7 (1) |" in card
    card_config = yaml.safe_load(card.split("```yaml")[1].split("```")[0])
    assert "grpo" in card_config and not {"nft", "awm", "dpo", "crd", "dgpo", "sft"} & set(card_config)
    assert card_config["train"] == trained["train"]
    for text in ("base model", "grpo", "`digit`", "checkpoint step 2", "## Evaluation", "```yaml", "```python"):
        assert text in card, text
    snippet = card.split("```python")[1].split("```")[0]
    assert "flowforge" not in snippet and str(tmp_path) not in card
    assert 'out = "."' in snippet
    if form == "adapter":  # a MiniLM demo-style base: carried as a diffusers pipeline in OUT/base
        assert 'base = os.path.join(out, \'base\')' in snippet and "PeftModel.from_pretrained(" in snippet
        assert "load_lora_adapter(out, " in snippet
    else:
        assert 'custom_pipeline=os.path.join(out, \'pipeline.py\'), trust_remote_code=True' in snippet
    # the card's snippet runs as written from inside the export, without flowforge
    (tmp_path / "snippet.py").write_text(snippet)
    run_outside_flowforge('import os\nos.chdir("{out}")\nexec(open("{tmp}/snippet.py").read())', tmp_path,
                          tmp=tmp_path, out=out)
