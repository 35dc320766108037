"""``flowforge sample``: a tiny 2-step LoRA run and its exports generate the trained model's images, deterministically
for a seed; prompt files; one-line errors; every family the adapters support."""

import json

import pytest
import torch
from PIL import Image

from flowforge.cli import main
from flowforge.rollout import candidate_noise, decode_media, generate
from flowforge.tools.export import export_run
from flowforge.tools.sample import load_for_sampling, read_prompts, run_sample, sample
from tests.train.test_trainer import tiny_cfg

PROMPT = "a handwritten seven"


@pytest.fixture(scope="module")
def run(tiny_model_dir, encode_cache_dir, tmp_path_factory):
    """A 2-step GRPO LoRA run with a checkpoint at every step, and its trainer (the trained policy in memory)."""
    from flowforge.train.trainer import Trainer

    out = tmp_path_factory.mktemp("sample_runs")
    trainer = Trainer(tiny_cfg(tiny_model_dir, out, encode_cache_dir, "lora.rank=4", "lora.alpha=8",
                               "checkpoint.every=1", "train.lr=1e-2", "run.name=lora"), progress=False)
    return trainer.train(), trainer


def cli_sample(source, out, *args):
    return main(["sample", str(source), "--prompt", PROMPT, "--out", str(out), *args])


def test_run_sample_is_the_trained_policy_and_deterministic_for_a_seed(run, tmp_path):
    run_dir, trainer = run
    assert cli_sample(run_dir, tmp_path / "a.png", "--num", "3", "--seed", "5") == 0
    assert cli_sample(run_dir, tmp_path / "b.png", "--num", "3", "--seed", "5") == 0
    assert cli_sample(run_dir, tmp_path / "c.png", "--num", "3", "--seed", "6") == 0
    for i in range(3):  # same seed: byte-identical PNGs; another seed: other images
        a, b, c = ((tmp_path / f"{s}_{i}.png").read_bytes() for s in "abc")
        assert a == b and a != c
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    with Image.open(tmp_path / "a_0.png") as im:
        assert im.size == (32, 32) and im.mode == "RGB"
    with Image.open(tmp_path / "a.png") as grid:  # 3 tiles upscaled to 128 px, a label under each
        assert grid.width == 3 * (128 + 8) and grid.height > 128 + 8
    info = json.loads((tmp_path / "a.json").read_text())
    assert info["seed"] == 5 and info["num_steps"] == 4 and "checkpoint step_000002" in info["source"]
    assert [x["prompt"] for x in info["images"]] == [PROMPT] * 3

    # the images are the trained policy's: the trainer's live weights, the same noise, the ODE sampler
    model = load_for_sampling(run_dir)
    media = sample(model, read_prompts([PROMPT], None, "t2i"), num=3, seed=5)
    x_T = candidate_noise([0, 1, 2], trainer.latent_shape, 5, -1)
    cond = model.adapter.encode([PROMPT] * 3)
    with torch.no_grad():
        with trainer.policy.using("live"):
            expected = decode_media(trainer.adapter, generate(trainer.adapter, cond, x_T, trainer.sigmas, 1.0), 8)
        with trainer.policy.using("ref"):
            base = decode_media(trainer.adapter, generate(trainer.adapter, cond, x_T, trainer.sigmas, 1.0), 8)
    assert (media - expected).abs().max() <= 1e-5
    assert (media - base).abs().max() > 1e-3  # not the base model


def test_merged_and_adapter_exports_sample_the_same_images(run, tmp_path):
    run_dir, _ = run
    merged = export_run(run_dir, tmp_path / "merged", form="merged")
    adapter = export_run(run_dir, tmp_path / "adapter", form="adapter")
    from_run = run_sample(run_dir, tmp_path / "r.png", prompts=[PROMPT, "the number 3"], num=2, seed=1).media
    m1 = run_sample(merged, tmp_path / "m1.png", prompts=[PROMPT, "the number 3"], num=2, seed=1)
    m2 = run_sample(merged, tmp_path / "m2.png", prompts=[PROMPT, "the number 3"], num=2, seed=1)
    m3 = run_sample(merged, tmp_path / "m3.png", prompts=[PROMPT, "the number 3"], num=2, seed=2)
    assert [p.name for p in m1.images] == ["m1_0.png", "m1_1.png", "m1_2.png", "m1_3.png"]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(m1.images, m2.images))
    assert all(a.read_bytes() != b.read_bytes() for a, b in zip(m1.images, m3.images))
    assert (m1.media - from_run).abs().max() <= 1e-4  # merged: W + s B A rounds differently from W x + s B (A x)
    a = run_sample(adapter, tmp_path / "a.png", prompts=[PROMPT, "the number 3"], num=2, seed=1).media
    assert (a - from_run).abs().max() <= 1e-5
    assert "merged export" in json.loads((tmp_path / "m1.json").read_text())["source"]


def test_eval_prompts_and_seed_reproduce_the_eval_grid(run, tmp_path):
    """With the eval's prompts, seed and samples per prompt the first image of each prompt is the eval grid's."""
    from flowforge.data.prompts import load_prompts
    from flowforge.report.grids import read_grid_cells

    run_dir, trainer = run
    records = load_prompts("demo:eval")[:3]
    k = trainer.cfg.eval.samples_per_prompt
    media = sample(load_for_sampling(run_dir), records, num=k, seed=trainer.cfg.eval.seed)
    grid_path = run_dir / "samples" / "step_000002.png"
    cells = read_grid_cells(grid_path)
    with Image.open(grid_path) as grid:
        tiles = [torch.tensor(list(grid.crop(tuple(c["box"])).resize((32, 32), Image.Resampling.NEAREST)
                                   .convert("L").get_flattened_data())) for c in cells]
    for p, tile in enumerate(tiles):
        ours = (media[p * k, 0].clamp(0, 1) * 255).round().flatten()
        assert (ours - tile).abs().max() <= 1  # one quantisation step: encodings cached on disk vs encoded now


def test_prompt_files(run, tmp_path):
    run_dir, _ = run
    text = tmp_path / "prompts.txt"
    text.write_text("a handwritten two\n\n  the number 9  \n")
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(json.dumps({"prompt": "a zero", "metadata": {"task": "t2i", "sample_id": "z"}}) + "\n")
    assert [r.prompt for r in read_prompts(["x"], text, "t2i")] == ["x", "a handwritten two", "the number 9"]
    assert [r.prompt for r in read_prompts([], rows, "t2i")] == ["a zero"]
    assert main(["sample", str(run_dir), "--prompt-file", str(text), "--num", "1", "--out",
                 str(tmp_path / "g.png")]) == 0
    assert [x["prompt"] for x in json.loads((tmp_path / "g.json").read_text())["images"]] == \
        ["a handwritten two", "the number 9"]


def test_errors_are_one_line(run, tmp_path, capsys):
    run_dir, _ = run
    assert cli_sample(tmp_path, tmp_path / "x.png") == 2
    assert "neither a run directory" in capsys.readouterr().err
    assert main(["sample", str(run_dir), "--out", str(tmp_path / "x.png")]) == 2
    assert "no prompt given" in capsys.readouterr().err
    assert cli_sample(run_dir, tmp_path / "x.jpg") == 2
    assert "not a .png" in capsys.readouterr().err
    assert cli_sample(run_dir, tmp_path / "x.png", "--num", "0") == 2
    assert cli_sample(run_dir, tmp_path / "x.png", "--config", str(run_dir / "config.yaml")) == 2
    assert "--config: " in capsys.readouterr().err  # a run samples with its own config
    with pytest.raises(ValueError, match="needs a condition image"):
        read_prompts(["a"], None, "i2v")
    assert not list(tmp_path.glob("x*.png"))


def test_a_base_that_is_not_the_trained_from_one_is_refused(run, tiny_model_dir, tmp_path, capsys):
    """--base with a changed copy of the base (one weight byte flipped): both the run and its adapter export are
    refused in one line naming the base's sha256, before any image is written; the real base samples."""
    import shutil

    from flowforge.runtime.run_dir import sha256_of_path

    run_dir, _ = run
    adapter = export_run(run_dir, tmp_path / "adapter", form="adapter")
    other = tmp_path / "other_base"
    shutil.copytree(tiny_model_dir, other)
    weights = next(other.rglob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert sha256_of_path(other) != sha256_of_path(tiny_model_dir)
    for source in (run_dir, adapter):
        assert cli_sample(source, tmp_path / "x.png", "--base", str(other)) == 2
        err = capsys.readouterr().err
        assert f"base model {other}" in err and "is not the model the run was trained from" in err
        assert len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("x*.png"))
    assert cli_sample(adapter, tmp_path / "y.png", "--base", str(tiny_model_dir)) == 0


# ------------------------------------------------------------------------------------------------ every family
@pytest.mark.parametrize("family", ["flux", "qwen_image", "wan"])
def test_every_family_samples_from_a_run_and_a_merged_export(family, tmp_path):
    import diffusers

    from flowforge.train.trainer import Trainer
    from tests.train.test_families_loop import PIPELINES, SIZES, _components, family_cfg

    base = tmp_path / "base"
    getattr(diffusers, PIPELINES[family])(**_components(family)).save_pretrained(str(base))
    prompts = {}
    for task in ("t2i", "t2v"):
        for split in ("train", "eval"):
            f = tmp_path / f"{task}_{split}.jsonl"
            f.write_text(json.dumps({"prompt": "a red cat", "metadata": {"task": task, "sample_id": "0"}}) + "\n")
            prompts[task, split] = f
    cfg = family_cfg(family, base, tmp_path / "runs", tmp_path / "cache", prompts, "run.name=r", "train.steps=1",
                     "checkpoint.every=1", "lora.rank=2", "lora.alpha=2", "data.prompts_per_step=1",
                     "eval.samples_per_prompt=1")
    run_dir = Trainer(cfg, progress=False).train()
    one = run_sample(run_dir, tmp_path / "one.png", prompts=["a red cat"], num=2, seed=0)
    h, w, frames = SIZES[family]
    assert one.media.shape == ((2, 3, frames, h, w) if frames else (2, 3, h, w))
    two = run_sample(export_run(run_dir, tmp_path / "merged", form="merged"), tmp_path / "two.png",
                     prompts=["a red cat"], num=2, seed=0)
    assert (two.media - one.media).abs().max() <= 1e-3
    assert [p.read_bytes() for p in one.images] != [p.read_bytes() for p in
                                                    run_sample(run_dir, tmp_path / "s1.png", prompts=["a red cat"],
                                                               num=2, seed=1).images]


def _digest(root):
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_out_into_a_run_or_a_committed_checkpoint_is_refused(run, tmp_path, capsys):
    """Issue 24 item 1: --out onto the run's eval grid, into a committed checkpoint, through `..` and through a
    symlinked directory; each refused in one line (exit 2) before anything is written."""
    run_dir, _ = run
    step = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    (tmp_path / "link").symlink_to(run_dir, target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    before = _digest(run_dir)
    for out in (run_dir / "samples" / "step_000002.png", step / "weights" / "live.png",
                tmp_path / "elsewhere" / ".." / "link" / "samples" / "x.png", tmp_path / "link" / "new.png"):
        assert cli_sample(run_dir, out) == 2
        err = capsys.readouterr().err.strip()
        assert "--out" in err and "lies inside the sampled run" in err and "\n" not in err
    assert _digest(run_dir) == before
    (tmp_path / "p.png").write_text("a handwritten one\n")  # a prompt file the grid would replace
    assert cli_sample(run_dir, tmp_path / "p.png", "--prompt-file", str(tmp_path / "p.png")) == 2
    assert "is the prompt file" in capsys.readouterr().err
    assert (tmp_path / "p.png").read_text() == "a handwritten one\n"
