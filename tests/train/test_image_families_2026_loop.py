"""The issue-25 image families (Z-Image, ...) on the real training loop (``flowforge.train.trainer.Trainer``): each
tiny random pipeline (tests/models/tiny_image_families.py) is saved with ``save_pretrained`` and loaded through
``model.adapter=<family>``; a 2-step LoRA run per algorithm checks GRPO's first ratio is exactly 1 and NFT's forward
process runs. Few-step families run their few-step settings: 4 steps, guidance-free, SDE from the first sigma
(sigma = 1) and NFT's forward process on the 4-step grid."""
from __future__ import annotations

import pytest
import torch

from tests.models import tiny_image_families as tiny_image
from tests.models import tiny_families as tiny
from tests.train.test_families_loop import EXTRA_WORDS, prompt_files, train_and_check  # noqa: F401 (fixture)

PIPELINES = {"z_image": ("ZImagePipeline", tiny_image.z_image_components),
             "flux2": ("Flux2KleinPipeline", tiny_image.flux2_klein_components),
             "flux2_dev": ("Flux2Pipeline", tiny_image.flux2_dev_components)}
ADAPTER = {"flux2_dev": "flux2"}
"""Saved pipeline -> model.adapter, where the two differ (FLUX.2 [dev] loads with the flux2 adapter)."""
SIZES = {"z_image": (16, 16), "flux2": (16, 16), "flux2_dev": (16, 16)}
SETTINGS = {
    # Z-Image-Turbo: few-step and guidance-free; the trained SDE steps are the first two, so step 0 (sigma = 1,
    # where the transition std is eta exactly) is sampled and replayed
    ("z_image", "turbo"): (1.0, ["sampler.num_steps=4", "sampler.trained_indices=[0,1]", "sampler.noise_level=0.5"]),
    # Z-Image base: true CFG (two branches in one forward, replayed as such)
    ("z_image", "base"): (4.0, ["sampler.num_steps=4", "sampler.num_sde_steps=2"]),
    # FLUX.2 Klein (step-distilled use): few-step, guidance-free, SDE from sigma = 1
    ("flux2", "klein"): (1.0, ["sampler.num_steps=4", "sampler.trained_indices=[0,1]", "sampler.noise_level=0.5"]),
    # FLUX.2 [dev]: guidance-distilled, the pipeline's default embedded guidance 4.0 (one forward, replayed as such)
    ("flux2_dev", "dev"): (4.0, ["sampler.num_steps=4", "sampler.num_sde_steps=2"]),
}
"""(family, variant) -> (GRPO guidance_scale in flowforge's convention, extra overrides)."""


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def image_family_dirs(tmp_path_factory):
    import diffusers

    dirs = {}
    for family, (cls, build) in PIPELINES.items():
        mp = pytest.MonkeyPatch()
        mp.setattr(tiny, "WORDS", list(tiny.WORDS) + EXTRA_WORDS)  # > 1000 tokens: passes the loaders' guard
        try:
            parts = build(0)
        finally:
            mp.undo()
        path = tmp_path_factory.mktemp(f"tiny_{family}")
        getattr(diffusers, cls)(**parts).save_pretrained(str(path))
        dirs[family] = path
    return dirs


CASES = [("z_image", "turbo", "grpo"), ("z_image", "turbo", "nft"), ("z_image", "base", "grpo"),
         ("flux2", "klein", "grpo"), ("flux2", "klein", "nft"), ("flux2_dev", "dev", "grpo"),
         pytest.param("flux2_dev", "dev", "nft", marks=pytest.mark.slow)]
"""NFT samples guidance-free, so one NFT run per family (on its few-step grid where it has one); FLUX.2-dev's is in
the slow set (CI runs it; FLUX.2 Klein shares its transformer class and runs NFT in the default set)."""

MULTI_IMAGE = [pytest.param("grpo"), pytest.param("nft", marks=pytest.mark.slow)]
"""The multi-image i2i runs: GRPO in the default set, NFT (the same conditioning path) in the slow set."""


@pytest.mark.parametrize("family,variant,algorithm", CASES)
def test_image_family_trains_on_the_real_loop(family, variant, algorithm, image_family_dirs, prompt_files, tmp_path):
    from flowforge.config import load_config
    from flowforge.train.trainer import Trainer

    h, w = SIZES[family]
    guidance, extra = SETTINGS[family, variant]
    adapter = ADAPTER.get(family, family)
    cfg = load_config(None, [
        f"model.adapter={adapter}", f"model.path={image_family_dirs[family]}", f"model.height={h}",
        f"model.width={w}", "model.task=t2i", f"run.output_dir={tmp_path / 'runs'}",
        f"data.cache_dir={tmp_path / 'cache'}", f"data.prompts={prompt_files['t2i', 'train']}",
        f"data.eval_prompts={prompt_files['t2i', 'eval']}", "data.prompts_per_step=2", "data.group_size=4",
        "sampler.schedule=dynamic", "train.micro_batch_size=2", "train.num_updates_per_batch=2", "train.steps=2",
        "train.lr=1e-2", "grpo.clip_low=1e-3", "eval.max_prompts=2", "eval.every=0",
        "reward.weights={jpeg_compressibility: 1.0}", f"run.name={family}-{algorithm}",
        f"train.algorithm={algorithm}", f"sampler.guidance_scale={guidance if algorithm == 'grpo' else 1.0}",
        "forward.sigma_mode=uniform_schedule", *extra])
    trainer = Trainer(cfg, progress=False)
    assert type(trainer.adapter).__module__ == f"flowforge.models.{adapter}.adapter"
    if family == "flux2_dev":
        assert trainer.adapter.guidance_embeds and trainer.train_cond.negative is None  # no CFG branch
    steps = cfg.sampler.num_steps
    assert torch.equal(trainer.sigmas, trainer.adapter.pipeline_sigmas(steps, h, w))  # the pipeline's own grid
    assert trainer.sigmas[0] == 1.0
    train_and_check(trainer, algorithm)


@pytest.fixture(scope="module")
def edit_plus_dir(tmp_path_factory):
    """A saved tiny ``QwenImageEditPlusPipeline`` (Edit-2511's ``zero_cond_t`` transformer)."""
    from diffusers import QwenImageEditPlusPipeline

    mp = pytest.MonkeyPatch()
    mp.setattr(tiny, "WORDS", list(tiny.WORDS) + EXTRA_WORDS)  # > 1000 tokens: passes the loaders' guard
    try:
        parts = tiny_image.qwen_edit_plus_components(0)
    finally:
        mp.undo()
    path = tmp_path_factory.mktemp("tiny_qwen_edit_plus")
    QwenImageEditPlusPipeline(**parts).save_pretrained(str(path))
    return path


def multi_image_prompt_files(root, sizes, seed=0):
    """``{("i2i", split): prompt file}`` under ``root`` whose rows list 2 and 3 reference images
    (``metadata.images``, paths relative to the file) of the ``(h, w)`` sizes ``sizes`` (none the model's)."""
    import json

    import numpy as np
    from PIL import Image

    (root / "refs").mkdir()
    rng = np.random.default_rng(seed)
    files = {}
    for split, prompts in (("train", ["a red cat", "two dogs", "a blue car", "a boat"]), ("eval", ["a bird", "a hut"])):
        rows = []
        for i, prompt in enumerate(prompts):
            names = []
            for k, (h, w) in enumerate(sizes[: 2 + i % 2]):  # 2 images, 3 images, 2, 3, ...
                names.append(f"refs/{split}{i}_{k}.png")
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / names[-1])
            rows.append({"prompt": prompt, "metadata": {"task": "i2i", "sample_id": f"{split}{i}", "images": names}})
        files["i2i", split] = root / f"{split}.jsonl"
        files["i2i", split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


@pytest.mark.parametrize("algorithm", MULTI_IMAGE)
def test_qwen_image_edit_plus_trains_on_the_real_loop(algorithm, edit_plus_dir, tmp_path, monkeypatch):
    """Qwen-Image-Edit-2511 multi-image i2i: each record's 2 or 3 images (``metadata.images``, odd sizes) re-encoded
    with its prompt by the Qwen2.5-VL and appended as image tokens (each on its own VAE-size grid); GRPO at true CFG
    4 (two forwards, renormalised), NFT guidance-free. The pipeline's resize areas are set small (32x32 for the VL
    and the VAE: 40x24 -> 40x24 VAE pixels, 72x56 -> 32x32 ...), as in tests/models/test_qwen_edit_plus.py."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    from flowforge.config import load_config
    from flowforge.train.trainer import Trainer
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", 32 * 32)
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 32 * 32)
    prompts = multi_image_prompt_files(tmp_path, [(40, 24), (72, 56), (24, 40)], seed=2)
    cfg = load_config(None, [
        "model.adapter=qwen_image", f"model.path={edit_plus_dir}", "model.height=16", "model.width=16",
        "model.task=i2i", f"run.output_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}",
        f"data.prompts={prompts['i2i', 'train']}", f"data.eval_prompts={prompts['i2i', 'eval']}",
        "data.prompts_per_step=2", "data.group_size=4", "sampler.schedule=dynamic", "sampler.num_steps=4",
        "sampler.num_sde_steps=2", "train.micro_batch_size=2", "train.num_updates_per_batch=2", "train.steps=2",
        "train.lr=1e-2", "grpo.clip_low=1e-3", "eval.max_prompts=2", "eval.every=0",
        "reward.weights={jpeg_compressibility: 1.0}", f"run.name=edit-plus-{algorithm}",
        f"train.algorithm={algorithm}", f"sampler.guidance_scale={4.0 if algorithm == 'grpo' else 1.0}",
        "forward.sigma_mode=uniform_schedule"])
    trainer = Trainer(cfg, progress=False)
    assert trainer.adapter.edit_plus and trainer.adapter.task == "i2i"
    assert torch.equal(trainer.sigmas, trainer.adapter.pipeline_sigmas(4, 16, 16))
    sb = trainer.next_prompts()
    cond = trainer._conditioning(trainer.train_cond, trainer.train_prompts, sb.prompt_indices)
    counts = sorted({int((g.prod(-1) > 0).sum()) for g in cond.image_grids})
    assert counts == [2, 3] or len(counts) == 1 and counts[0] in (2, 3)  # 2- and 3-image rows
    train_and_check(trainer, algorithm)


@pytest.mark.parametrize("algorithm", MULTI_IMAGE)
def test_flux2_klein_reference_image_trains_on_the_real_loop(algorithm, image_family_dirs, tmp_path):
    """FLUX.2 Klein multi-image i2i (reference-image editing), few-step and guidance-free as the distilled model runs:
    each record's 2 or 3 images (``metadata.images``; odd sizes, at least 64 px as the pipeline requires) VAE-encoded
    at their own sizes and appended as reference tokens; GRPO from sigma = 1 (first ratio 1) and NFT on the 4-step
    grid."""
    from flowforge.config import load_config
    from flowforge.train.trainer import Trainer

    prompts = multi_image_prompt_files(tmp_path, [(73, 66), (64, 90), (66, 70)], seed=3)
    cfg = load_config(None, [
        "model.adapter=flux2", f"model.path={image_family_dirs['flux2']}", "model.height=64", "model.width=64",
        "model.task=i2i", f"run.output_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}",
        f"data.prompts={prompts['i2i', 'train']}", f"data.eval_prompts={prompts['i2i', 'eval']}",
        "data.prompts_per_step=2", "data.group_size=4", "sampler.schedule=dynamic", "sampler.num_steps=4",
        "sampler.trained_indices=[0,1]", "sampler.noise_level=0.5", "sampler.guidance_scale=1.0",
        "train.micro_batch_size=2", "train.num_updates_per_batch=2", "train.steps=2", "train.lr=1e-2",
        "grpo.clip_low=1e-3", "eval.max_prompts=2", "eval.every=0", "reward.weights={jpeg_compressibility: 1.0}",
        f"run.name=klein-i2i-{algorithm}", f"train.algorithm={algorithm}", "forward.sigma_mode=uniform_schedule"])
    trainer = Trainer(cfg, progress=False)
    assert trainer.adapter.task == "i2i" and trainer.sigmas[0] == 1.0
    sb = trainer.next_prompts()
    cond = trainer._conditioning(trainer.train_cond, trainer.train_prompts, sb.prompt_indices)
    layouts = {tuple(map(tuple, g)) for g in cond.image_grids.tolist()}
    assert layouts <= {((18, 16), (16, 22), (0, 0)), ((18, 16), (16, 22), (16, 17))}  # own sizes, floored to 4s
    train_and_check(trainer, algorithm)
