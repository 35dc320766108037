"""Exports carry no path of the machine that wrote them (issue 27 item 8): exported next to a local base, moved with it
to another directory, they load there with diffusers / peft through the model card's own code (run without
flowforge) and with ``flowforge sample``; no file of the export holds a path of the source machine; the card shows
the run's own config sections only."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from flowforge.models.text import minilm_model_dir
from flowforge.tools.export import export_run, read_export_meta
from flowforge.tools.export.portable import base_ref, own_sections, resolve_base_ref
from tests.tools.test_export import fresh, lora_run, probe  # noqa: F401 - lora_run is a fixture
from tests.tools.test_export_loading import probe_inputs, run_outside_flowforge

REPO = Path(__file__).resolve().parents[2]


def machine_paths_in(root: Path, paths: list[str]) -> list[tuple[str, str]]:
    """``(file, path)`` for every file under ``root`` (binary ones too: a safetensors header is JSON) holding one
    of ``paths``."""
    found = []
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        data = file.read_bytes()
        found += [(file.relative_to(root).as_posix(), p) for p in paths if p.encode() in data]
    return found


def source_paths(*roots: Path) -> list[str]:
    """The absolute paths of the source machine an export must not name: the given directories (as given and as
    realpaths), the repository, the MiniLM package."""
    out = {str(REPO), minilm_model_dir()}
    for r in roots:
        out |= {str(r), str(r.resolve())}
    return sorted(out)


def test_base_ref_names_the_base_as_the_user_did(tmp_path):
    out = tmp_path / "exports" / "x"
    (tmp_path / "models" / "base").mkdir(parents=True)
    assert base_ref("demo:base", REPO / "flowforge" / "demo" / "weights" / "base", out) == "demo:base"
    assert base_ref("stabilityai/stable-diffusion-3.5-medium", None, out) == "stabilityai/stable-diffusion-3.5-medium"
    assert base_ref(str(tmp_path / "models" / "base"), tmp_path / "models" / "base", out) == "../../models/base"
    assert base_ref("/models/gone", None, out).startswith("../") and not base_ref("/models/gone", None, out) \
        .startswith("/")
    out.mkdir(parents=True)
    assert resolve_base_ref("../../models/base", out) == str(out / "../../models/base")
    assert resolve_base_ref("org/name", out) == "org/name" and resolve_base_ref("demo:base", out) == "demo:base"


def test_card_config_has_the_runs_own_sections_only():
    data = {k: {} for k in ("run", "model", "train", "rollout", "grpo", "grpo_guard", "forward", "nft", "awm", "dgpo",
                            "dpo", "crd", "dppo", "anchor", "eval", "sft")}
    assert set(own_sections(data, "nft")) == {"run", "model", "train", "rollout", "forward", "nft", "anchor", "eval"}
    assert set(own_sections(data, "dppo")) == {"run", "model", "train", "rollout", "grpo", "dppo", "anchor", "eval"}


@pytest.mark.slow  # a few short runs (10-15 s each on 2 cores): CI runs it in the slow set
def test_exports_moved_with_their_base_load_elsewhere_and_name_no_machine_path(lora_run, tiny_model_dir, tmp_path):
    from flowforge.tools.sample import run_sample

    run_dir, trained, base = lora_run
    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir, src / "models" / "base")  # the base as a user keeps it beside the exports
    outs = {form: export_run(run_dir, src / "exports" / form, form=form, base=src / "models" / "base",
                             verify=True) for form in ("adapter", "merged")}
    forbidden = source_paths(src, run_dir, tiny_model_dir, tmp_path)
    for form, out in outs.items():
        assert machine_paths_in(out, forbidden) == [], form
        meta = read_export_meta(out)
        assert meta["base_model"] == "../../models/base" and meta["checkpoint"] == "checkpoints/step_000002"
        assert not Path(meta["run_dir"]).is_absolute()
        assert yaml.safe_load((out / "config.yaml").read_text())["model"]["path"] == "../../models/base"
    assert json.loads((outs["adapter"] / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "../../models/base"

    moved = tmp_path / "elsewhere"
    shutil.move(str(src), str(moved))  # the exports and their base, to another directory
    torch.save(probe_inputs(fresh(tiny_model_dir).config), tmp_path / "inputs.pt")
    velocity = ('\nimport torch\ninp = torch.load({inputs!r})\n'
                'def v(m):\n    with torch.no_grad():\n'
                '        return m(hidden_states=inp["x"], encoder_hidden_states=inp["embeds"], '
                'pooled_projections=inp["pooled"], timestep=inp["timestep"], return_dict=False)[0]\n')
    for form in ("adapter", "merged"):
        out = moved / "exports" / form
        snippet = (out / "README.md").read_text().split("```python")[1].split("```")[0]
        assert "flowforge" not in snippet and str(tmp_path) not in snippet
        save = ('torch.save({{"pipe": v(pipe.transformer.eval())' + (', "peft": v(model.eval())' if form == "adapter"
                                                                      else "") + '}}, {result!r})\n')
        # the card's code as written, run from inside the moved export (its `out = "."`), without flowforge
        (out.parent / f"{form}.py").write_text(snippet + velocity.format(inputs=str(tmp_path / "inputs.pt"))
                                               + save.format(result=str(tmp_path / f"{form}.pt")))
        run_outside_flowforge(f'import os\nos.chdir({str(out)!r})\nexec(open({str(out.parent / (form + ".py"))!r})'
                              '.read())', tmp_path)
        got = torch.load(tmp_path / f"{form}.pt")
        for name, v in got.items():
            c = fresh(tiny_model_dir).config
            assert v.shape == (3, c.out_channels, c.sample_size, c.sample_size)
        # the trained policy's velocity through flowforge's own probe, with the exports loaded from the new place
        if form == "adapter":
            from peft import PeftModel

            peft = PeftModel.from_pretrained(fresh(out / "base" / "transformer"), str(out)).eval()
            assert (probe(peft) - trained).abs().max() <= 1e-5
            t = fresh(out / "base" / "transformer")
            t.load_lora_adapter(str(out), prefix="transformer", use_safetensors=True)
            assert (probe(t) - trained).abs().max() <= 1e-5 and (probe(t) - base).abs().max() > 1e-3
            assert torch.allclose(got["pipe"], got["peft"], atol=1e-6)
        else:
            assert (probe(fresh(out / "transformer")) - trained).abs().max() <= 1e-4 * max(1.0, float(
                trained.abs().max()))
        # flowforge sample finds the base relative to the moved export (the original base is gone from there)
        run_sample(out, tmp_path / f"{form}.png", prompts=["the digit 7"], num=1, seed=0)
        source = json.loads((tmp_path / f"{form}.json").read_text())["source"]
        assert source.endswith(f"on base {out / '../../models/base'}" if form == "adapter" else str(out)), source
    assert machine_paths_in(moved / "exports", [str(src), str(src.resolve())]) == []


def test_cli_export_prints_no_library_warnings(lora_run, tmp_path):
    """`flowforge export` in a fresh process (transformers' warn-once caches are per process): no torchvision
    fallback warning from transformers (issue 27 item 4), no line but flowforge's own."""
    import os
    import subprocess
    import sys

    run_dir, _, _ = lora_run
    proc = subprocess.run([sys.executable, "-m", "flowforge.cli", "export", str(run_dir), str(tmp_path / "out"),
                           "--form", "adapter"], capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torchvision" not in proc.stderr and "[transformers]" not in proc.stderr, proc.stderr
    assert (tmp_path / "out" / "base" / "model_index.json").is_file()
