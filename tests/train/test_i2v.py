"""Wan image-to-video on the real loop: the condition slot is pinned from the prompt's image through every rollout
step, excluded from every log-prob and loss, and has no gradient path. Both layouts: Wan2.2 TI2V's first-frame pin
(``expand_timesteps``) and Wan2.1 I2V's channel concat, the latter also with CLIP image tokens (``concat_clip``:
Wan2.1-I2V-14B's ``image_dim`` transformer, image encoder and processor; tests/models/test_wan_i2v_clip.py)."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from flowforge.objectives import TrainBatch
from tests.models.test_wan_i2v_clip import with_clip
from tests.train.test_families_loop import _components, family_cfg, image_prompt_files, train_and_check

LAYOUTS = ["pin", "concat", "concat_clip"]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def i2v_dirs(tmp_path_factory):
    """``layout -> saved WanImageToVideoPipeline directory``."""
    from diffusers import WanImageToVideoPipeline

    pin = _components("wan")
    concat = _components("wan", i2v=True)
    concat_clip = with_clip(_components("wan", i2v=True))
    dirs = {}
    layouts = (("pin", pin, True), ("concat", concat, False), ("concat_clip", concat_clip, False))
    for layout, parts, expand in layouts:
        path = tmp_path_factory.mktemp(f"wan_i2v_{layout}")
        WanImageToVideoPipeline(**parts, expand_timesteps=expand).save_pretrained(str(path))
        dirs[layout] = path
    return dirs


@pytest.fixture(scope="module")
def i2v_prompts(tmp_path_factory):
    return image_prompt_files(tmp_path_factory.mktemp("i2v_prompts"), "i2v")


def make_trainer(layout, algorithm, i2v_dirs, i2v_prompts, tmp_path, *extra):
    from flowforge.train.trainer import Trainer

    cfg = family_cfg("wan", i2v_dirs[layout], tmp_path / "runs", tmp_path / "cache", i2v_prompts,
                     f"run.name=i2v-{layout}-{algorithm}", f"train.algorithm={algorithm}", *extra, task="i2v")
    trainer = Trainer(cfg, progress=False)
    assert trainer.adapter.task == "i2v" and trainer.adapter.condition_index is not None
    return trainer


def scored_batch(trainer, step=0) -> TrainBatch:
    sb = trainer.next_prompts()
    traj, cond = trainer.sample(sb, step)
    _, comps, _ = trainer.score(traj, sb)
    adv, total, _ = trainer.advantages(comps, sb)
    return TrainBatch(traj=traj, cond=cond, advantages=adv, group_ids=sb.group_ids, rewards=total,
                      candidate_ids=sb.candidate_ids)


@pytest.mark.parametrize("algorithm", ["grpo", "nft"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_i2v_trains_on_the_real_loop(layout, algorithm, i2v_dirs, i2v_prompts, tmp_path):
    guidance = "sampler.guidance_scale=5.0" if algorithm == "grpo" else "sampler.guidance_scale=1.0"
    train_and_check(make_trainer(layout, algorithm, i2v_dirs, i2v_prompts, tmp_path, guidance), algorithm)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_condition_slot_is_pinned_through_every_step(layout, i2v_dirs, i2v_prompts, tmp_path):
    trainer = make_trainer(layout, "grpo", i2v_dirs, i2v_prompts, tmp_path, "sampler.guidance_scale=5.0")
    batch = scored_batch(trainer)
    slot, gen = trainer.adapter.condition_index, trainer.adapter.generated_index
    image = batch.cond.image
    assert image is not None and image.shape == batch.traj.final[slot].shape
    # each prompt's own image: rows of different groups hold different conditions (the check is not vacuous)
    g0, g1 = (batch.group_ids == 0).nonzero()[0], (batch.group_ids == 1).nonzero()[0]
    assert not torch.equal(image[g0], image[g1])
    assert torch.equal(batch.traj.final[slot], image)
    if layout == "concat_clip":  # each prompt's CLIP tokens, the same in both CFG branches
        tokens = batch.cond.pooled
        assert tokens is not None and torch.equal(batch.cond.negative.pooled, tokens)
        assert not torch.equal(tokens[g0], tokens[g1])
    else:
        assert batch.cond.pooled is None
    for s in range(len(batch.traj.trained_steps)):
        assert torch.equal(batch.traj.latents[:, s][slot], image)
        assert torch.equal(batch.traj.next_latents[:, s][slot], image)  # re-pinned after the stochastic step
    # the generated part really was sampled (not a copy of the start)
    assert batch.traj.final[gen].abs().max() > 0


def _velocity_spy(monkeypatch, adapter):
    """Keep every velocity the adapter returns with ``retain_grad`` so a test can read d loss / d velocity."""
    outputs = []
    velocity = adapter.velocity

    def spy(x, sigma, cond, guidance_scale):
        v = velocity(x, sigma, cond, guidance_scale)
        if v.requires_grad:
            v.retain_grad()
            outputs.append(v)
        return v

    monkeypatch.setattr(adapter, "velocity", spy)
    return outputs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grpo_log_prob_and_loss_exclude_the_condition_slot(layout, i2v_dirs, i2v_prompts, tmp_path, monkeypatch):
    from flowforge.rollout import replay_log_prob

    trainer = make_trainer(layout, "grpo", i2v_dirs, i2v_prompts, tmp_path, "sampler.guidance_scale=5.0",
                           "grpo.kl_weight=0.1")
    batch = scored_batch(trainer)
    slot, gen = trainer.adapter.condition_index, trainer.adapter.generated_index
    spec = trainer.objective.rollout_spec_of(batch)
    sub = batch.select(torch.arange(2))

    # 1. the stored next latent's slot does not enter the log-prob: scrambling it changes nothing, bit for bit
    scrambled = sub.traj.next_latents.clone()
    scrambled[:, 0][slot] = torch.randn_like(scrambled[:, 0][slot]) * 10
    with torch.no_grad():
        lp = replay_log_prob(trainer.adapter, sub.traj, 0, sub.cond, spec).log_prob
        lp2 = replay_log_prob(trainer.adapter, replace(sub.traj, next_latents=scrambled), 0, sub.cond, spec).log_prob
        assert torch.equal(lp, sub.traj.log_probs[:, 0]) and torch.equal(lp, lp2)
        # ... while the generated elements do
        moved = sub.traj.next_latents.clone()
        moved[:, 0][gen] += 0.1
        lp3 = replay_log_prob(trainer.adapter, replace(sub.traj, next_latents=moved), 0, sub.cond, spec).log_prob
        assert not torch.equal(lp, lp3)

    # 2. no gradient path: d loss / d velocity is exactly 0 on the slot, nonzero on the generated elements
    outputs = _velocity_spy(monkeypatch, trainer.adapter)
    loss, _ = trainer.objective.step_loss(sub, 0, spec)  # clipped surrogate + transition-mean KL to the reference
    loss.backward()
    (v,) = outputs  # the live replay (the reference evaluation runs without gradients)
    assert v.grad[slot].abs().max() == 0
    assert v.grad[gen].abs().max() > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_process_loss_excludes_the_condition_slot(layout, i2v_dirs, i2v_prompts, tmp_path, monkeypatch):
    trainer = make_trainer(layout, "nft", i2v_dirs, i2v_prompts, tmp_path, "nft.ref_weight=0.1")
    batch = scored_batch(trainer)
    obj = trainer.objective
    slot, gen = trainer.adapter.condition_index, trainer.adapter.generated_index
    prepared, extras, _ = obj.prepare(batch)
    rows = torch.arange(2)
    sub, sub_extras = prepared.select(rows), {k: v[rows] for k, v in extras.items()}
    sigma_index, noise_slot = obj.visits(prepared, 0)[0]
    visit = obj.make_visit(sub, sigma_index[rows], noise_slot)

    # the model sees a clean slot holding the condition image, the loss sees only the generated elements
    assert torch.equal(visit.model_input[slot], sub.cond.image)
    assert visit.x_sigma.shape == sub.traj.final[gen].shape
    # the rollout's final slot does not matter: the visit takes the slot from cond.image
    scrambled = sub.traj.final.clone()
    scrambled[slot] = torch.randn_like(scrambled[slot])
    other = obj.make_visit(replace(sub, traj=replace(sub.traj, final=scrambled)), sigma_index[rows], noise_slot)
    assert torch.equal(other.model_input, visit.model_input)

    outputs = _velocity_spy(monkeypatch, trainer.adapter)
    loss, _ = obj.micro_loss(sub, sub_extras, visit)  # NFT loss + velocity-MSE to the reference
    trainer.policy.backward(loss)
    (v,) = outputs
    assert v.grad[slot].abs().max() == 0
    assert v.grad[gen].abs().max() > 0


def test_i2v_prompt_records_need_an_existing_image(tmp_path, i2v_prompts):
    from flowforge.data.prompts import check_task, load_prompts

    records = load_prompts(i2v_prompts["i2v", "train"])
    assert all(r.metadata["image"].endswith(".png") and r.metadata["image"].startswith("/") for r in records)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "metadata": {"task": "i2v", "sample_id": "a"}}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'metadata.image' must be the condition image"):
        load_prompts(bad)
    bad.write_text(json.dumps({"prompt": "p", "metadata": {"task": "i2v", "sample_id": "a", "image": "no.png"}})
                   + "\n")
    with pytest.raises(ValueError, match=r"'metadata.image' names 'no.png', which is not a file"):
        load_prompts(bad)
    with pytest.raises(ValueError, match=r"model.task='t2v' needs records with metadata.task in \['t2i', 't2v'\]"):
        check_task(records, "t2v", "data.prompts")
    with pytest.raises(ValueError, match=r"model.task='i2i' needs records with metadata.task in \['i2i'\]"):
        check_task(records, "i2i", "data.prompts")
    (tmp_path / "corrupt.png").write_text("not an image")
    bad.write_text(json.dumps({"prompt": "p", "metadata": {"task": "i2v", "sample_id": "a", "image": "corrupt.png"}})
                   + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'metadata.image' names 'corrupt.png', which is not a "
                                         r"readable image \(UnidentifiedImageError"):
        load_prompts(bad)


def test_condition_images_follow_exif_orientation(tmp_path):
    """A phone JPEG rotated by its EXIF tag is loaded upright, as diffusers' load_image does."""
    from diffusers.utils import load_image
    from PIL import Image

    from flowforge.data.images import load_condition_images

    pixels = np.zeros((16, 32, 3), dtype=np.uint8)
    pixels[:, :16] = 255  # left half white: orientation is visible
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    Image.fromarray(pixels).save(tmp_path / "phone.png", exif=exif)
    ours = load_condition_images([str(tmp_path / "phone.png")], 32, 16)
    upright = load_image(str(tmp_path / "phone.png"))
    assert upright.size == (16, 32)  # width 16, height 32 after the EXIF rotation
    reference = torch.from_numpy(np.array(upright.resize((16, 32), Image.LANCZOS))).permute(2, 0, 1) / 255.0
    assert ours.shape == (1, 3, 32, 16)
    torch.testing.assert_close(ours[0], reference.float(), atol=1 / 255, rtol=0)


def test_a_condition_slot_without_generated_index_is_refused():
    from flowforge.rollout import generated_index

    class Partial:
        condition_index = (slice(None), slice(None), slice(0, 1))

    with pytest.raises(TypeError, match="declares condition_index but no generated_index"):
        generated_index(Partial())
