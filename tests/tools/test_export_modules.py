"""Export of a ``lora.trainable: module`` run of a diffusers family (the tiny SD3, one block fine-tuned in full): merged
as the base with that block's tensors, adapter as exactly those tensors; both verify bit-equal, sample reloads the
adapter, and a tensor outside the trained modules is refused by the contract check."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from flowforge.tools.export import ExportError, export_run, read_export_meta
from flowforge.tools.sample import run_sample
from tests.tools.test_export import _crafted_run, fresh, probe

MODULE = "transformer_blocks.0"
CONTRACT = {"trainable": "module", "dropout": 0.0, "modules": [MODULE]}


def _module_run(tmp_path, base_dir, cache_dir, extra=None):
    t = fresh(base_dir)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in t.get_submodule(MODULE).parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    tensors = {f"{MODULE}.{k}": v.detach().clone() for k, v in t.get_submodule(MODULE).state_dict().items()}
    return _crafted_run(tmp_path, base_dir, cache_dir, {**tensors, **(extra or {})}, CONTRACT), tensors, probe(t)


def test_module_run_exports_merged_and_exactly_its_tensors(tiny_model_dir, encode_cache_dir, tmp_path):
    run_dir, tensors, expected = _module_run(tmp_path, tiny_model_dir, encode_cache_dir)
    merged = export_run(run_dir, tmp_path / "m", form="merged", verify=True)
    assert read_export_meta(merged)["verify"]["max_abs_diff"] == 0.0
    assert torch.equal(probe(fresh(merged / "transformer")), expected)  # a demo base: a pipeline directory
    out = export_run(run_dir, tmp_path / "a", form="adapter", verify=True)
    report = read_export_meta(out)["verify"]
    assert report["max_abs_diff"] == 0.0 and report["base_diff"] > 0
    written = load_file(str(out / "trained_modules.safetensors"))
    assert sorted(written) == sorted(tensors) and all(torch.equal(written[k], tensors[k]) for k in tensors)
    meta = json.loads((out / "trained_modules.json").read_text())
    assert meta["modules"] == [MODULE] and meta["base_model"] == os.path.relpath(tiny_model_dir.resolve(), out.resolve())  # no machine path
    t = fresh(tiny_model_dir)
    t.load_state_dict(written, strict=False)
    assert torch.equal(probe(t), expected)
    result = run_sample(out, tmp_path / "g.png", prompts=["a handwritten seven"], steps=2)
    assert len(result.images) == 1 and "adapter export" in json.loads((tmp_path / "g.json").read_text())["source"]


def test_a_tensor_outside_the_trained_modules_is_refused(tiny_model_dir, encode_cache_dir, tmp_path):
    other = {"transformer_blocks.1.attn.to_q.weight": fresh(tiny_model_dir).transformer_blocks[1].attn.to_q.weight}
    run_dir, _, _ = _module_run(tmp_path, tiny_model_dir, encode_cache_dir, extra=other)
    with pytest.raises(ExportError, match=r"transformer_blocks\.1\.attn\.to_q\.weight.*not in the trained submodules"):
        export_run(run_dir, tmp_path / "a", form="adapter")
    assert not (tmp_path / "a").exists()


def test_a_module_lora_run_of_a_diffusers_family_is_refused_in_one_line(tiny_model_dir, encode_cache_dir, tmp_path):
    """``module+lora`` exports exist for the world model only: a diffusers family's is refused, nothing written."""
    from flowforge.models import lora as lora_lib

    t = fresh(tiny_model_dir)
    targets = ["transformer_blocks.1.attn.to_q"]
    lora_lib.inject_lora(t, 4, 8.0, targets)
    tensors = {f"{MODULE}.{k}": v.detach().clone() for k, v in t.get_submodule(MODULE).state_dict().items()}
    run_dir = _crafted_run(tmp_path, tiny_model_dir, encode_cache_dir, {**tensors, **lora_lib.lora_state_dict(t)},
                           {**CONTRACT, "trainable": "module+lora", "rank": 4, "alpha": 8.0, "targets": targets})
    for form in ("merged", "adapter"):
        with pytest.raises(ExportError, match="module\\+lora' runs of model.adapter='sd3' cannot be exported") as err:
            export_run(run_dir, tmp_path / form, form=form)
        assert "\n" not in str(err.value) and not (tmp_path / form).exists()
