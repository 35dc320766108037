"""LAION aesthetic score (:mod:`flowforge.rewards.scorers.aesthetic`): head files, head width checks, and a shared
CLIP inside the reward processor."""

from __future__ import annotations

import pytest
import torch

from flowforge.rewards import RewardProcessor, build_scorer
from flowforge.rewards.scorers.aesthetic import AestheticHead, AestheticScorer, load_aesthetic_head
from flowforge.rewards.scorers.clip_score import ClipScore
from tests.rewards.scorers.tiny_clip import META, PROJECTION, PROMPTS, direct_clip, random_media


@pytest.fixture(scope="module")
def head_file(tmp_path_factory):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    head = AestheticHead(PROJECTION)
    path = tmp_path_factory.mktemp("head") / "head.safetensors"
    save_file(head.state_dict(), str(path))
    return path, head


def test_aesthetic_head_file_round_trips(clip_dirs, head_file, tmp_path):
    model_dir, processor_dir = clip_dirs
    path, head = head_file
    pth = tmp_path / "head.pth"
    torch.save(head.state_dict(), pth)
    for file in (path, pth):
        loaded = load_aesthetic_head(file, PROJECTION)
        assert not loaded.training
        for key, value in head.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
    media = random_media(4, seed=19)
    _, image_embeds, _, _ = direct_clip(model_dir, processor_dir, media, PROMPTS)
    with torch.no_grad():
        expected = head.eval()(image_embeds).squeeze(1)
    for file in (path, pth):
        scorer = build_scorer("aesthetic", model_path=model_dir, head_path=file, processor_path=processor_dir)
        scores = scorer(media, PROMPTS, META)
        assert scores.shape == (4,) and scores.dtype == torch.float32
        torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def test_aesthetic_rejects_a_head_of_the_wrong_width(clip_dirs, tmp_path):
    model_dir, processor_dir = clip_dirs
    wrong = tmp_path / "wide.pth"
    torch.save(AestheticHead(768).state_dict(), wrong)
    with pytest.raises(ValueError, match="16-d CLIP embeddings"):
        AestheticScorer(model_dir, wrong, processor_dir)
    with pytest.raises(ValueError, match="head_path is required"):
        AestheticScorer(model_dir, None, processor_dir)


def test_aesthetic_and_clip_score_share_the_clip_and_run_in_the_processor(clip_dirs, head_file):
    model_dir, processor_dir = clip_dirs
    aesthetic = AestheticScorer(model_dir, head_file[0], processor_dir)
    clip = ClipScore(model_dir, processor_dir)
    assert aesthetic.model is clip.model
    processor = RewardProcessor({"aesthetic": aesthetic, "clip": clip}, weights={"aesthetic": 1.0}, batch_size=3)
    components, metrics = processor(random_media(5, 28, 28), ["a cat"] * 5, [{}] * 5)
    assert components["aesthetic"].shape == (5,) and torch.isfinite(components["clip"]).all()
    assert metrics["reward/aesthetic_nan_fraction"] == 0.0
