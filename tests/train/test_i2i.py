"""Image-to-image on the real loop, for both i2i families: FLUX.1 Kontext (a saved tiny ``FluxKontextPipeline``;
GRPO at distilled guidance 3.5) and Qwen-Image-Edit (a saved tiny ``QwenImageEditPipeline`` with its processor;
GRPO at true CFG 4.0), and NFT for each, through ``Trainer`` with i2i prompt files whose records name their own
condition image. The image is consumed inside the adapter's velocity (packed image tokens appended to the image
stream; for Qwen-Image-Edit the prompt and the negative are also re-encoded by the Qwen2.5-VL with the image): no
condition slot, the whole latent is generated and trained."""
from __future__ import annotations

import pytest
import torch

from tests.train.test_families_loop import _components, family_cfg, image_prompt_files, train_and_check

FAMILIES = {"flux": ("FluxKontextPipeline", {}, 3.5), "qwen_image": ("QwenImageEditPipeline", {"edit": True}, 4.0)}
"""family -> (diffusers i2i pipeline, tiny-component options, GRPO guidance)."""


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def i2i_dirs(tmp_path_factory):
    """``family -> saved i2i pipeline directory``."""
    import diffusers

    dirs = {}
    for family, (pipeline, options, _) in FAMILIES.items():
        path = tmp_path_factory.mktemp(f"{family}_i2i")
        getattr(diffusers, pipeline)(**_components(family, **options)).save_pretrained(str(path))
        dirs[family] = path
    return dirs


@pytest.fixture(scope="module")
def i2i_prompts(tmp_path_factory):
    return image_prompt_files(tmp_path_factory.mktemp("i2i_prompts"), "i2i", seed=1)


def make_trainer(family, algorithm, i2i_dirs, i2i_prompts, tmp_path):
    from flowforge.train.trainer import Trainer

    guidance = FAMILIES[family][2] if algorithm == "grpo" else 1.0
    cfg = family_cfg(family, i2i_dirs[family], tmp_path / "runs", tmp_path / "cache", i2i_prompts,
                     f"run.name=i2i-{family}-{algorithm}", f"train.algorithm={algorithm}",
                     f"sampler.guidance_scale={guidance}", task="i2i")
    trainer = Trainer(cfg, progress=False)
    assert trainer.adapter.task == "i2i" and trainer.adapter.condition_index is None
    return trainer


@pytest.mark.parametrize("algorithm", ["grpo", "nft"])
@pytest.mark.parametrize("family", FAMILIES)
def test_i2i_trains_on_the_real_loop(family, algorithm, i2i_dirs, i2i_prompts, tmp_path):
    trainer = make_trainer(family, algorithm, i2i_dirs, i2i_prompts, tmp_path)
    torch.testing.assert_close(trainer.sigmas, trainer.adapter.pipeline_sigmas(4, 16, 16))
    train_and_check(trainer, algorithm)  # GRPO: the replayed guided step is the sampled one (first ratio 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_rows_carry_their_prompts_image_conditioning(family, i2i_dirs, i2i_prompts, tmp_path):
    from flowforge.data.images import load_condition_images

    trainer = make_trainer(family, "grpo", i2i_dirs, i2i_prompts, tmp_path)
    sb = trainer.next_prompts()
    traj, cond = trainer.sample(sb, 0)
    records = [trainer.train_prompts[i] for i in sb.prompt_indices.tolist()]
    c, h, w = trainer.latent_shape
    assert cond.image.shape == (len(records), (h // 2) * (w // 2), 4 * c)  # packed image tokens
    images = load_condition_images([r.metadata["image"] for r in records], 16, 16)
    text_only = trainer.train_cond.index(sb.prompt_indices)  # the trainer's cached text-only encoding
    want = trainer.adapter.condition_on_images(text_only, [r.prompt for r in records], images, trainer.latent_shape)
    torch.testing.assert_close(cond.image, want.image)
    torch.testing.assert_close(cond.prompt_embeds, want.prompt_embeds, rtol=0, atol=1e-6)
    if family == "qwen_image":  # the Qwen2.5-VL read the prompt (and the negative) together with the image
        torch.testing.assert_close(cond.negative.prompt_embeds, want.negative.prompt_embeds, rtol=0, atol=1e-6)
        assert not torch.equal(cond.prompt_embeds, text_only.prompt_embeds.to(cond.prompt_embeds.dtype))
    g0, g1 = (sb.group_ids == 0).nonzero()[0], (sb.group_ids == 1).nonzero()[0]
    assert not torch.equal(cond.image[g0], cond.image[g1])  # each prompt's own image
    assert traj.final.shape == (len(records), c, h, w)  # the latent holds only the generated image
