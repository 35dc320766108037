"""Qwen-Image-Edit image-to-image on the real loop: a saved tiny ``QwenImageEditPipeline`` directory (with its
processor), i2i prompt files whose records name their own condition image, GRPO (true CFG 4.0) and NFT through
``Trainer``. Every sampled row is conditioned by ``QwenImageAdapter.condition_on_images``: its prompt re-encoded by the
Qwen2.5-VL together with its image (the negative with the same image) and the image's packed latents appended to the
transformer's image stream; no condition slot, the whole latent is generated and trained."""
from __future__ import annotations

import pytest
import torch

from tests.test_families_loop import _components, family_cfg, train_and_check
from tests.test_i2i import i2i_prompts  # noqa: F401  (fixture)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory):
    from diffusers import QwenImageEditPipeline

    path = tmp_path_factory.mktemp("qwen_image_edit")
    QwenImageEditPipeline(**_components("qwen_image", edit=True)).save_pretrained(str(path))
    return path


def make_trainer(algorithm, edit_dir, prompts, tmp_path, *extra):
    from flowforge.trainer import Trainer

    cfg = family_cfg("qwen_image", edit_dir, tmp_path / "runs", tmp_path / "cache", prompts,
                     f"run.name=i2i-qwen-{algorithm}", f"train.algorithm={algorithm}", *extra, task="i2i")
    trainer = Trainer(cfg, progress=False)
    assert trainer.adapter.task == "i2i" and trainer.adapter.condition_index is None
    return trainer


@pytest.mark.parametrize("algorithm", ["grpo", "nft"])
def test_qwen_edit_i2i_trains_on_the_real_loop(algorithm, edit_dir, i2i_prompts, tmp_path):  # noqa: F811
    guidance = "sampler.guidance_scale=4.0" if algorithm == "grpo" else "sampler.guidance_scale=1.0"
    trainer = make_trainer(algorithm, edit_dir, i2i_prompts, tmp_path, guidance)
    torch.testing.assert_close(trainer.sigmas, trainer.adapter.pipeline_sigmas(4, 16, 16))
    train_and_check(trainer, algorithm)  # GRPO: the replayed true-CFG step is the sampled one (first ratio 1)


def test_sampled_rows_carry_their_prompts_edit_conditioning(edit_dir, i2i_prompts, tmp_path):  # noqa: F811
    from flowforge.data.images import load_condition_images

    trainer = make_trainer("grpo", edit_dir, i2i_prompts, tmp_path, "sampler.guidance_scale=4.0")
    sb = trainer.next_prompts()
    traj, cond = trainer.sample(sb, 0)
    records = [trainer.train_prompts[i] for i in sb.prompt_indices.tolist()]
    c, h, w = trainer.latent_shape
    assert cond.image.shape == (len(records), (h // 2) * (w // 2), 4 * c)  # packed Edit image latents
    images = load_condition_images([r.metadata["image"] for r in records], 16, 16)
    prompts = [r.prompt for r in records]
    want = trainer.adapter.condition_on_images(trainer.train_cond.index(sb.prompt_indices), prompts, images,
                                               trainer.latent_shape)
    torch.testing.assert_close(cond.image, want.image)
    torch.testing.assert_close(cond.prompt_embeds, want.prompt_embeds, rtol=0, atol=1e-6)  # read with the image
    torch.testing.assert_close(cond.negative.prompt_embeds, want.negative.prompt_embeds, rtol=0, atol=1e-6)
    text_only = trainer.train_cond.index(sb.prompt_indices)  # the trainer's cached text-only encoding
    assert not torch.equal(cond.prompt_embeds, text_only.prompt_embeds.to(cond.prompt_embeds.dtype))
    g0, g1 = (sb.group_ids == 0).nonzero()[0], (sb.group_ids == 1).nonzero()[0]
    assert not torch.equal(cond.image[g0], cond.image[g1])  # each prompt's own image
    assert traj.final.shape == (len(records), c, h, w)  # the latent holds only the generated image
