"""CLIP score (:mod:`flowforge.rewards.scorers.clip_score`): the three formulas against CLIPModel's own forward."""

from __future__ import annotations

import pytest
import torch

from flowforge.rewards import build_scorer
from flowforge.rewards.scorers.clip_score import ClipScore
from tests.rewards.scorers.tiny_clip import META, PROMPTS, direct_clip, random_media


def test_clip_score_formulas(clip_dirs):
    model_dir, processor_dir = clip_dirs
    media = random_media(4, seed=17)
    _, image_embeds, text_embeds, model = direct_clip(model_dir, processor_dir, media, PROMPTS)
    cosine = (image_embeds * text_embeds).sum(-1)
    scores = {formula: build_scorer("clip_score", model_path=model_dir, processor_path=processor_dir,
                                    formula=formula)(media, PROMPTS, META)
              for formula in ("cosine", "clipscore", "flow_grpo")}
    torch.testing.assert_close(scores["cosine"], cosine, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores["clipscore"], 2.5 * cosine.clamp(min=0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores["flow_grpo"], model.logit_scale.exp() * cosine / 30, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cosine"):
        ClipScore(model_dir, processor_dir, formula="hessel")
