"""FLUX.1 Kontext image-to-image on the real loop: a saved tiny ``FluxKontextPipeline`` directory, i2i prompt files
whose records name their own condition image, GRPO (distilled guidance 3.5) and NFT through ``Trainer``. The image
is consumed inside the adapter's velocity (no condition slot): the whole latent is generated and trained."""
from __future__ import annotations

import pytest
import torch

from tests.test_families_loop import _components, family_cfg, image_prompt_files, train_and_check


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory):
    from diffusers import FluxKontextPipeline

    path = tmp_path_factory.mktemp("flux_kontext")
    FluxKontextPipeline(**_components("flux")).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def i2i_prompts(tmp_path_factory):
    return image_prompt_files(tmp_path_factory.mktemp("i2i_prompts"), "i2i", seed=1)


def make_trainer(algorithm, kontext_dir, i2i_prompts, tmp_path, *extra):
    from flowforge.trainer import Trainer

    cfg = family_cfg("flux", kontext_dir, tmp_path / "runs", tmp_path / "cache", i2i_prompts,
                     f"run.name=i2i-{algorithm}", f"train.algorithm={algorithm}", *extra, task="i2i")
    trainer = Trainer(cfg, progress=False)
    assert trainer.adapter.task == "i2i" and trainer.adapter.condition_index is None
    return trainer


@pytest.mark.parametrize("algorithm", ["grpo", "nft"])
def test_kontext_i2i_trains_on_the_real_loop(algorithm, kontext_dir, i2i_prompts, tmp_path):
    guidance = "sampler.guidance_scale=3.5" if algorithm == "grpo" else "sampler.guidance_scale=1.0"
    train_and_check(make_trainer(algorithm, kontext_dir, i2i_prompts, tmp_path, guidance), algorithm)


def test_sampled_rows_carry_their_prompts_image_tokens(kontext_dir, i2i_prompts, tmp_path):
    from flowforge.data.images import load_condition_images

    trainer = make_trainer("grpo", kontext_dir, i2i_prompts, tmp_path, "sampler.guidance_scale=3.5")
    sb = trainer.next_prompts()
    traj, cond = trainer.sample(sb, 0)
    records = [trainer.train_prompts[i] for i in sb.prompt_indices.tolist()]
    c, h, w = trainer.latent_shape
    assert cond.image.shape == (len(records), (h // 2) * (w // 2), 4 * c)  # packed Kontext image tokens
    images = load_condition_images([r.metadata["image"] for r in records], 16, 16)
    torch.testing.assert_close(cond.image, trainer.adapter.encode_condition_images(images, trainer.latent_shape))
    g0, g1 = (sb.group_ids == 0).nonzero()[0], (sb.group_ids == 1).nonzero()[0]
    assert not torch.equal(cond.image[g0], cond.image[g1])  # each prompt's own image
    assert traj.final.shape == (len(records), c, h, w)  # the latent holds only the generated image
