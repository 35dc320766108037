"""Export of the families the other export tests do not reach: FLUX.2 [dev] and Klein, Z-Image, HunyuanVideo 1.5,
Qwen-Image-Edit and Wan 2.2 TI2V. Each case's tiny random pipeline (the tests/models builders) is saved as the base;
a LoRA run is written without training (rank 4, alpha 8 on the family's default targets, seeded random A and B, by
the trainer's own checkpoint code); both forms are exported with ``--verify`` and loaded back the way a user
would -- ``merged``: the export is a pipeline directory, ``<Pipeline>.from_pretrained(OUT)``; ``adapter``: the base
pipeline's ``load_lora_weights(OUT)``, or for HunyuanVideo 1.5, whose pipelines have no LoRA loader, peft's
``PeftModel.from_pretrained`` and diffusers' ``load_lora_adapter`` on the pipeline's transformer -- and the loaded
transformer's velocity through the family's adapter equals the trained policy's within 1e-5.

Coverage of the other families: sd3 / flux / qwen_image / wan 2.1 (tests/train/test_families_loop.py), ltx2
(tests/train/test_ltx2_loop.py), Wan 2.2 A14B (tests/train/test_wan_experts_loop.py), world_model
(tests/tools/test_export_world.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from flowforge.config import dump_config, load_config
from flowforge.models import lora as lora_lib
from flowforge.models.base import Conditioning
from flowforge.runtime.run_dir import sha256_of_path
from flowforge.tools.export import export_run, read_export_meta
from flowforge.train import checkpoint as ckpt

RANK, ALPHA = 4, 8
TOL = 1e-5  # relative to max(1, max |v_trained|), as the export's own check


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@dataclass(frozen=True)
class Case:
    family: str  # model.adapter
    pipeline: str  # the base's diffusers pipeline class
    task: str
    frames: int | None = None

    def components(self) -> dict:
        from tests.models import tiny_families, tiny_hunyuan_video15, tiny_image_families

        return {
            "Flux2Pipeline": tiny_image_families.flux2_dev_components,
            "Flux2KleinPipeline": tiny_image_families.flux2_klein_components,
            "ZImagePipeline": tiny_image_families.z_image_components,
            "HunyuanVideo15Pipeline": tiny_hunyuan_video15.components,
            "QwenImageEditPipeline": lambda: tiny_families.qwen_components(edit=True),
            "WanImageToVideoPipeline": lambda: dict(tiny_families.wan_components(), expand_timesteps=True),
        }[self.pipeline]()


CASES = {
    "flux2_dev": Case("flux2", "Flux2Pipeline", "t2i"),
    "flux2_klein": Case("flux2", "Flux2KleinPipeline", "t2i"),
    "z_image": Case("z_image", "ZImagePipeline", "t2i"),
    "hunyuan_video15": Case("hunyuan_video15", "HunyuanVideo15Pipeline", "t2v", frames=5),
    "qwen_image_edit": Case("qwen_image", "QwenImageEditPipeline", "i2i"),
    "wan22_ti2v": Case("wan", "WanImageToVideoPipeline", "i2v", frames=5),
}


def drive(case: Case, transformer):
    """The family's adapter around a bare ``transformer`` as the trained policy runs it (Wan 2.2 TI2V: i2v with
    the first-frame pin, per-token timesteps)."""
    from flowforge.models import adapter_class

    cls = adapter_class(case.family)
    if case.pipeline == "WanImageToVideoPipeline":
        return cls(transformer.eval(), task="i2v", expand_timesteps=True)
    return cls(transformer.eval())


def probe(case: Case, transformer) -> torch.Tensor:
    """Velocities on seeded inputs shaped like export's own probe but drawn from another seed, ``sigma = [0.15,
    0.6]``, guidance 1."""
    from flowforge.tools.export.probes import PROBES

    g = torch.Generator().manual_seed(7)
    x, cond = PROBES[case.family].inputs(transformer.config, lambda *s: torch.randn(*s, generator=g))
    if case.pipeline == "WanImageToVideoPipeline":  # the pin layout's condition frame: latent frame 0
        cond = Conditioning(prompt_embeds=cond.prompt_embeds, image=x[:, :, :1].clone())
    with torch.no_grad():
        return drive(case, transformer).velocity(x, torch.tensor([0.15, 0.6]), cond, 1.0)


def crafted_run(case: Case, base, root):
    """A run directory (config.yaml + committed checkpoint step 1) of a LoRA on ``base``'s transformer, written by
    :func:`flowforge.train.checkpoint.save_checkpoint`, and the transformer carrying that LoRA (the trained
    policy)."""
    import diffusers

    from flowforge.models import adapter_class

    index = json.loads((base / "model_index.json").read_text())
    transformer = getattr(diffusers, index["transformer"][1]).from_pretrained(str(base / "transformer")).eval()
    targets = list(adapter_class(case.family).lora_targets)
    lora_lib.inject_lora(transformer, RANK, ALPHA, targets)
    g = torch.Generator().manual_seed(11)
    lora_lib.load_lora_state_dict(transformer, {k: 0.1 * torch.randn(v.shape, generator=g)
                                                for k, v in lora_lib.lora_state_dict(transformer).items()})
    run_dir = root / "run"
    run_dir.mkdir()
    frames = "null" if case.frames is None else case.frames
    cfg = load_config(None, [f"model.adapter={case.family}", f"model.path={base}", f"model.task={case.task}",
                             f"model.frames={frames}", f"run.output_dir={root}", "run.name=run"])
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    lora = {"trainable": "lora", "dropout": 0.0, "rank": RANK, "alpha": float(ALPHA), "targets": targets}
    ckpt.save_checkpoint(run_dir, 1, tensors={"live": lora_lib.lora_state_dict(transformer)}, optimizer_state=None,
                         keep=1, trainer_state={"step": 1, "lora": lora, "base_model_sha256": sha256_of_path(base)})
    return run_dir, transformer


@pytest.fixture(scope="module", params=list(CASES))
def family_run(request, tmp_path_factory):
    """``(case, base pipeline directory, run directory, v_trained, v_base)`` of each case."""
    import diffusers

    case = CASES[request.param]
    root = tmp_path_factory.mktemp(f"export_{request.param}")
    base = root / "base"
    getattr(diffusers, case.pipeline)(**case.components()).save_pretrained(str(base))
    run_dir, policy = crafted_run(case, base, root)
    trained = probe(case, policy)
    with lora_lib.adapters_disabled(policy):
        untrained = probe(case, policy)
    assert (trained - untrained).abs().max() > 1e-4  # the LoRA changes the model: the checks below are not vacuous
    return case, base, run_dir, trained, untrained


def _pipeline(case: Case, path):
    import diffusers

    return getattr(diffusers, case.pipeline).from_pretrained(str(path), local_files_only=True)


def _close(v, trained, untrained):
    assert (v - trained).abs().max() <= TOL * max(1.0, float(trained.abs().max()))
    assert (v - untrained).abs().max() > 1e-4  # the loaded model is the trained one, not the base


def test_adapter_export_loads_into_the_family_pipeline(family_run, tmp_path):
    from peft import PeftModel

    case, base, run_dir, trained, untrained = family_run
    out = export_run(run_dir, tmp_path / "adapter", form="adapter", verify=True)
    report = read_export_meta(out)["verify"]
    assert report["passed"] and report["max_abs_diff"] <= TOL and report["base_diff"] > 1e-4
    pipe = _pipeline(case, base)
    if hasattr(pipe, "load_lora_weights"):  # the family pipeline's own LoRA loader; alpha 8 (scale 2) honoured
        pipe.load_lora_weights(str(out))
        (config,) = pipe.transformer.peft_config.values()
        assert (config.r, config.lora_alpha) == (RANK, ALPHA)
        _close(probe(case, pipe.transformer), trained, untrained)
    else:  # no LoRA loader in any of the family's pipelines (HunyuanVideo 1.5): peft, or diffusers' model loader
        assert case.family == "hunyuan_video15"
        model = PeftModel.from_pretrained(pipe.transformer, str(out))  # injects into pipe.transformer in place
        assert model.base_model.model is pipe.transformer
        _close(probe(case, pipe.transformer), trained, untrained)
        fresh = _pipeline(case, base).transformer
        fresh.load_lora_adapter(str(out), prefix="transformer", use_safetensors=True)
        _close(probe(case, fresh), trained, untrained)
    snippet = (out / "README.md").read_text().split("```python")[1].split("```")[0]
    assert ("pipe.load_lora_weights(out)" in snippet) == hasattr(pipe, "load_lora_weights")
    if not hasattr(pipe, "load_lora_weights"):  # the card's transformer-level loading runs as written, from OUT
        from tests.tools.test_export_loading import run_outside_flowforge

        assert snippet.count('subfolder="transformer"') == 2
        (tmp_path / "snippet.py").write_text(snippet)
        run_outside_flowforge('import os\nos.chdir("{out}")\nexec(open("{tmp}/snippet.py").read())', tmp_path,
                              tmp=tmp_path, out=out)


def test_merged_export_loads_as_the_family_pipeline(family_run, tmp_path):
    case, base, run_dir, trained, untrained = family_run
    out = export_run(run_dir, tmp_path / "merged", form="merged", verify=True)
    assert read_export_meta(out)["verify"]["passed"]
    pipe = _pipeline(case, out)  # the merged transformer in transformer/, every other component copied
    assert not any("lora" in k for k in pipe.transformer.state_dict())
    _close(probe(case, pipe.transformer), trained, untrained)


def test_every_registered_family_exports():
    """Every registered family has an export writer: the diffusers ones a verification probe and a LoRA writer
    (their pipeline's ``save_lora_weights`` / ``load_lora_weights``, or none declared), the others their own."""
    import diffusers

    from flowforge.models import ADAPTERS, OWN_FORMAT_FAMILIES
    from flowforge.models.registry import FAMILIES
    from flowforge.tools.export.source import SUPPORTED_ADAPTERS

    assert sorted((*SUPPORTED_ADAPTERS, *OWN_FORMAT_FAMILIES)) == sorted(ADAPTERS)
    for family in SUPPORTED_ADAPTERS:
        name = FAMILIES[family].export_pipeline
        if name is not None:
            cls = getattr(diffusers, name)
            assert hasattr(cls, "save_lora_weights") and hasattr(cls, "load_lora_weights"), family
    assert FAMILIES["hunyuan_video15"].export_pipeline is None
    assert not hasattr(diffusers.HunyuanVideo15Pipeline, "load_lora_weights")  # else declare it
