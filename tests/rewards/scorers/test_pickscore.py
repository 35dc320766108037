"""PickScore (:mod:`flowforge.rewards.scorers.pickscore`) on a tiny offline CLIP: the score is
``logit_scale.exp() * cos``, option checks and batching."""

from __future__ import annotations

import pytest
import torch

from flowforge.rewards import build_scorer
from flowforge.rewards.scorers.pickscore import PICKSCORE_NORMALIZER, PickScore
from tests.rewards.scorers.tiny_clip import META, PROMPTS, direct_clip, random_media


def test_pickscore_scores_a_batch(clip_dirs):
    model_dir, processor_dir = clip_dirs
    scorer = build_scorer("pickscore", model_path=model_dir, processor_path=processor_dir)
    assert scorer.name == "pickscore" and scorer.needs_group is False
    media = random_media(4)
    scores = scorer(media, PROMPTS, META)
    assert scores.shape == (4,) and scores.dtype == torch.float32 and scores.device == media.device
    assert torch.isfinite(scores).all()
    assert scores.unique().numel() == 4  # depends on each image / prompt, not a constant


def test_pickscore_equals_logit_scale_times_cosine(clip_dirs):
    model_dir, processor_dir = clip_dirs
    media = random_media(4, seed=3)
    logits, image_embeds, text_embeds, model = direct_clip(model_dir, processor_dir, media, PROMPTS)
    by_hand = model.logit_scale.exp() * (image_embeds * text_embeds).sum(-1)
    torch.testing.assert_close(logits, by_hand)  # the reference forward is indeed s * cos
    assert 50 < model.logit_scale.detach().exp().item() < 150

    raw = PickScore(model_dir, processor_dir)(media, PROMPTS, META)
    torch.testing.assert_close(raw, by_hand, rtol=1e-5, atol=1e-5)
    normalized = PickScore(model_dir, processor_dir, normalize=True)(media, PROMPTS, META)
    torch.testing.assert_close(normalized, by_hand / PICKSCORE_NORMALIZER, rtol=1e-5, atol=1e-6)


def test_build_errors_are_clear(clip_dirs, tmp_path):
    model_dir, processor_dir = clip_dirs
    with pytest.raises(ValueError, match="PickScore_v1"):
        PickScore()
    with pytest.raises(ValueError, match="not a local directory"):
        PickScore("yuvalkirstain/PickScore_v1", processor_dir)
    with pytest.raises(ValueError, match="dtype must be one of"):
        PickScore(model_dir, processor_dir, dtype="int8")
    with pytest.raises(ValueError, match="batch_size"):
        PickScore(model_dir, processor_dir, batch_size=0)
    with pytest.raises(ValueError, match="normalize"):
        PickScore(model_dir, processor_dir, normalize="yes")
    with pytest.raises(ValueError, match="could not load a CLIP tokenizer"):
        PickScore(model_dir, tmp_path)  # an empty directory: no tokenizer files
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            PickScore(model_dir, processor_dir, device="cuda")


def test_empty_batch_and_batch_size_chunks(clip_dirs):
    model_dir, processor_dir = clip_dirs
    whole = PickScore(model_dir, processor_dir, batch_size=32)
    chunked = PickScore(model_dir, processor_dir, batch_size=1)
    media = random_media(4, 40, 36, seed=13)
    torch.testing.assert_close(chunked(media, PROMPTS, META), whole(media, PROMPTS, META), rtol=1e-5, atol=1e-5)
    empty = whole(media[:0], [], [])
    assert empty.shape == (0,) and empty.dtype == torch.float32
