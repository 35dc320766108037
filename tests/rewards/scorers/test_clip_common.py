"""Shared CLIP pieces (:mod:`flowforge.rewards.scorers.clip_common`): torch preprocessing against the PIL processor
path, the weak model cache, prompt truncation to the text window, and the model dtype, on tiny offline CLIPs."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from flowforge.rewards import build_scorer
from flowforge.rewards.scorers.clip_score import ClipScore
from flowforge.rewards.scorers.pickscore import PickScore
from tests.rewards.scorers.tiny_clip import IMAGE_SIZE, META, PROMPTS, TEXT_WINDOW, random_media


def test_torch_preprocessing_matches_the_processor_pil_path(clip_dirs):
    from PIL import Image
    from transformers import AutoImageProcessor

    _, processor_dir = clip_dirs
    scorer = PickScore(clip_dirs[0], processor_dir)
    # smooth 8-bit content (upsampled noise): the PIL path quantises to uint8, so give it exactly representable input
    low = random_media(2, 6, 5, seed=7)
    media = (F.interpolate(low, size=(60, 48), mode="bilinear", align_corners=False) * 255).round() / 255
    ours = scorer.preprocess(media)
    assert ours.shape == (2, 3, IMAGE_SIZE, IMAGE_SIZE)
    reference_processor = AutoImageProcessor.from_pretrained(str(processor_dir))
    images = [Image.fromarray((m.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)) for m in media]
    reference = reference_processor(images=images, return_tensors="pt")["pixel_values"]
    assert reference.shape == ours.shape
    # PIL resamples in 8-bit fixed point and rounds to uint8: within about one grey level (1/255/std = 0.015);
    # measured 0.0144 max / 0.0043 mean. Bilinear or non-antialiased bicubic miss these bounds (0.07+ max).
    assert (ours - reference).abs().max() < 0.03
    assert (ours - reference).abs().mean() < 0.006
    # a wrong crop (e.g. from the top-left corner) is far off
    wrong = scorer.preprocess(media[..., :48, :])
    assert (wrong - reference).abs().mean() > 0.05


def test_same_model_is_loaded_once_and_shared(clip_dirs):
    model_dir, processor_dir = clip_dirs
    first = PickScore(model_dir, processor_dir)
    second = build_scorer("pickscore", model_path=str(model_dir), processor_path=processor_dir, normalize=True)
    clip = build_scorer("clip_score", model_path=model_dir / ".." / "model", processor_path=processor_dir)
    assert second.model is first.model and clip.model is first.model
    assert second.tokenizer is first.tokenizer
    other_dtype = PickScore(model_dir, processor_dir, dtype="bfloat16")
    assert other_dtype.model is not first.model and other_dtype.model.dtype == torch.bfloat16
    # the cache is weak: once no scorer holds the model, its weights are freed
    released = weakref.ref(first.model)
    del first, second, clip
    gc.collect()
    assert released() is None
    third = PickScore(model_dir, processor_dir)
    assert third.model is PickScore(model_dir, processor_dir).model


def test_long_prompt_is_truncated_to_the_text_window(clip_dirs):
    model_dir, processor_dir = clip_dirs
    scorer = PickScore(model_dir, processor_dir)
    assert scorer.max_length == TEXT_WINDOW
    head = " ".join(["a cat"] * 40)  # 80 words, far beyond 16 positions
    media = random_media(2, seed=5)
    scores = scorer(media, [head, head + " on a red sofa"], [{}, {}])
    assert torch.isfinite(scores).all()
    # both prompts share their first 14 tokens, so after truncation the text embeddings are identical
    text = scorer.text_embeddings([head, head + " on a red sofa"])
    torch.testing.assert_close(text[0], text[1])
    assert not torch.allclose(text[0], scorer.text_embeddings(["a cat"])[0])


def test_bfloat16_scores_close_to_float32(clip_dirs):
    model_dir, processor_dir = clip_dirs
    media = random_media(3, seed=11)
    full = ClipScore(model_dir, processor_dir)(media, PROMPTS[:3], META[:3])
    half = ClipScore(model_dir, processor_dir, dtype=torch.bfloat16)(media, PROMPTS[:3], META[:3])
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, atol=0.05, rtol=0.0)
