"""CLIP-tower reward scorers (PickScore, CLIP score, aesthetic, HPSv2) on tiny random-init models built offline.

Every model here is a tiny ``CLIPModel`` from a ``CLIPConfig`` with a CLIP BPE tokenizer written from scratch (byte
alphabet + ``</w>`` forms, two merges), saved with ``save_pretrained`` and loaded back through the scorers. HPSv2 is
exercised against a stand-in ``open_clip`` module (the real one needs torchvision, which this environment lacks).
"""

from __future__ import annotations

import gc
import importlib.abc
import json
import os
import sys
import types
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

from flowforge.rewards import RewardProcessor, build_scorer  # noqa: E402
from flowforge.rewards.clip_scorers import (  # noqa: E402
    PICKSCORE_NORMALIZER,
    AestheticHead,
    AestheticScorer,
    ClipScore,
    HPSv2Scorer,
    PickScore,
    load_aesthetic_head,
)

IMAGE_SIZE = 32
TEXT_WINDOW = 16
PROJECTION = 16
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def _write_tokenizer_files(directory) -> None:
    from tokenizers import pre_tokenizers

    vocab: dict[str, int] = {}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    for symbol in alphabet:
        vocab[symbol] = len(vocab)
    for symbol in alphabet:
        vocab[symbol + "</w>"] = len(vocab)
    for token in ("ca", "cat</w>", "<|startoftext|>", "<|endoftext|>"):
        vocab[token] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\nc a\nca t</w>\n")


@pytest.fixture(scope="module")
def clip_dirs(tmp_path_factory):
    """``(model_dir, processor_dir)`` of a tiny CLIP; the processor dir holds a tokenizer and an image processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    root = tmp_path_factory.mktemp("tiny_clip")
    model_dir, processor_dir = root / "model", root / "processor"
    processor_dir.mkdir()
    _write_tokenizer_files(processor_dir)
    tokenizer = CLIPTokenizer.from_pretrained(str(processor_dir))
    assert len(tokenizer) == 516 and tokenizer.eos_token_id == 515
    tokenizer.save_pretrained(str(processor_dir))
    CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                       image_mean=list(MEAN), image_std=list(STD)).save_pretrained(str(processor_dir))
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=TEXT_WINDOW,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=IMAGE_SIZE, patch_size=8),
        projection_dim=PROJECTION,
        logit_scale_init_value=4.6052,  # exp = 100, as the released checkpoints
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(str(model_dir))
    return model_dir, processor_dir


@pytest.fixture(scope="module")
def head_file(tmp_path_factory):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    head = AestheticHead(PROJECTION)
    path = tmp_path_factory.mktemp("head") / "head.safetensors"
    save_file(head.state_dict(), str(path))
    return path, head


def _media(batch: int, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, height, width, generator=generator)


PROMPTS = ["a cat", "a handwritten seven", "a cat", "two dogs on a red sofa"]
META = [{}] * 4


def _direct_clip(model_dir, processor_dir, media, prompts):
    """``(logits_per_image diagonal, image_embeds, text_embeds)`` from CLIPModel.forward, pixels normalised by hand."""
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(processor_dir))
    tokens = tokenizer(list(prompts), padding=True, truncation=True, max_length=TEXT_WINDOW, return_tensors="pt")
    pixels = (media - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    with torch.no_grad():
        out = model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], pixel_values=pixels)
    return out.logits_per_image.diagonal(), out.image_embeds, out.text_embeds, model


# ------------------------------------------------------------------------------------------------ PickScore


def test_pickscore_scores_a_batch(clip_dirs):
    model_dir, processor_dir = clip_dirs
    scorer = build_scorer("pickscore", model_path=model_dir, processor_path=processor_dir)
    assert scorer.name == "pickscore" and scorer.needs_group is False
    media = _media(4)
    scores = scorer(media, PROMPTS, META)
    assert scores.shape == (4,) and scores.dtype == torch.float32 and scores.device == media.device
    assert torch.isfinite(scores).all()
    assert scores.unique().numel() == 4  # depends on each image / prompt, not a constant


def test_pickscore_equals_logit_scale_times_cosine(clip_dirs):
    model_dir, processor_dir = clip_dirs
    media = _media(4, seed=3)
    logits, image_embeds, text_embeds, model = _direct_clip(model_dir, processor_dir, media, PROMPTS)
    by_hand = model.logit_scale.exp() * (image_embeds * text_embeds).sum(-1)
    torch.testing.assert_close(logits, by_hand)  # the reference forward is indeed s * cos
    assert 50 < model.logit_scale.detach().exp().item() < 150

    raw = PickScore(model_dir, processor_dir)(media, PROMPTS, META)
    torch.testing.assert_close(raw, by_hand, rtol=1e-5, atol=1e-5)
    normalized = PickScore(model_dir, processor_dir, normalize=True)(media, PROMPTS, META)
    torch.testing.assert_close(normalized, by_hand / PICKSCORE_NORMALIZER, rtol=1e-5, atol=1e-6)


def test_long_prompt_is_truncated_to_the_text_window(clip_dirs):
    model_dir, processor_dir = clip_dirs
    scorer = PickScore(model_dir, processor_dir)
    assert scorer.max_length == TEXT_WINDOW
    head = " ".join(["a cat"] * 40)  # 80 words, far beyond 16 positions
    media = _media(2, seed=5)
    scores = scorer(media, [head, head + " on a red sofa"], [{}, {}])
    assert torch.isfinite(scores).all()
    # both prompts share their first 14 tokens, so after truncation the text embeddings are identical
    text = scorer.text_embeddings([head, head + " on a red sofa"])
    torch.testing.assert_close(text[0], text[1])
    assert not torch.allclose(text[0], scorer.text_embeddings(["a cat"])[0])


def test_torch_preprocessing_matches_the_processor_pil_path(clip_dirs):
    from PIL import Image
    from transformers import AutoImageProcessor

    _, processor_dir = clip_dirs
    scorer = PickScore(clip_dirs[0], processor_dir)
    # smooth 8-bit content (upsampled noise): the PIL path quantises to uint8, so give it exactly representable input
    low = _media(2, 6, 5, seed=7)
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


def test_bfloat16_scores_close_to_float32(clip_dirs):
    model_dir, processor_dir = clip_dirs
    media = _media(3, seed=11)
    full = ClipScore(model_dir, processor_dir)(media, PROMPTS[:3], META[:3])
    half = ClipScore(model_dir, processor_dir, dtype=torch.bfloat16)(media, PROMPTS[:3], META[:3])
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, atol=0.05, rtol=0.0)


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
    media = _media(4, 40, 36, seed=13)
    torch.testing.assert_close(chunked(media, PROMPTS, META), whole(media, PROMPTS, META), rtol=1e-5, atol=1e-5)
    empty = whole(media[:0], [], [])
    assert empty.shape == (0,) and empty.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ CLIP score


def test_clip_score_formulas(clip_dirs):
    model_dir, processor_dir = clip_dirs
    media = _media(4, seed=17)
    _, image_embeds, text_embeds, model = _direct_clip(model_dir, processor_dir, media, PROMPTS)
    cosine = (image_embeds * text_embeds).sum(-1)
    scores = {formula: build_scorer("clip_score", model_path=model_dir, processor_path=processor_dir,
                                    formula=formula)(media, PROMPTS, META)
              for formula in ("cosine", "clipscore", "flow_grpo")}
    torch.testing.assert_close(scores["cosine"], cosine, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores["clipscore"], 2.5 * cosine.clamp(min=0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores["flow_grpo"], model.logit_scale.exp() * cosine / 30, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cosine"):
        ClipScore(model_dir, processor_dir, formula="hessel")


# ------------------------------------------------------------------------------------------------ aesthetic


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
    media = _media(4, seed=19)
    _, image_embeds, _, _ = _direct_clip(model_dir, processor_dir, media, PROMPTS)
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
    components, metrics = processor(_media(5, 28, 28), ["a cat"] * 5, [{}] * 5)
    assert components["aesthetic"].shape == (5,) and torch.isfinite(components["clip"]).all()
    assert metrics["reward/aesthetic_nan_fraction"] == 0.0


# ------------------------------------------------------------------------------------------------ HPSv2


class _RaiseOnImport(importlib.abc.MetaPathFinder):
    """Makes ``import open_clip`` fail the way a torchvision built for another torch does."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "open_clip":
            raise RuntimeError("operator torchvision::nms does not exist")
        return None


def test_hps_missing_dependency_fails_at_build_with_install_hint(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "open_clip", None)  # import open_clip -> ImportError
    with pytest.raises(ImportError) as missing:
        build_scorer("hps", checkpoint_path=tmp_path / "HPS_v2.1_compressed.pt")
    message = str(missing.value)
    assert "pip install 'flowforge[hps]'" in message and "torchvision" in message and "open-clip-torch" in message

    monkeypatch.delitem(sys.modules, "open_clip")
    finder = _RaiseOnImport()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    with pytest.raises(ImportError, match=r"flowforge\[hps\]") as broken:
        HPSv2Scorer(tmp_path / "HPS_v2.1_compressed.pt")
    assert isinstance(broken.value.__cause__, RuntimeError)
    assert "torchvision::nms" in str(broken.value)


class _FakeVisual(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3 * 8 * 8, 12)
        self.preprocess_cfg = {"size": 8, "mean": MEAN, "std": STD, "interpolation": "bicubic"}

    def forward(self, pixels):
        return self.proj(pixels.flatten(1))


class _FakeOpenClipModel(nn.Module):
    """Stand-in for an open_clip CLIP: encode_image / encode_text / visual.preprocess_cfg, as the scorer uses."""

    def __init__(self):
        super().__init__()
        self.visual = _FakeVisual()
        self.token_embedding = nn.Embedding(64, 12)

    def encode_image(self, image, normalize=False):
        features = self.visual(image)
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text, normalize=False):
        features = self.token_embedding(text).mean(1)
        return F.normalize(features, dim=-1) if normalize else features


def _fake_tokenize(texts, context_length=6):
    out = torch.zeros(len(texts), context_length, dtype=torch.long)
    for row, text in enumerate(texts):
        ids = [ord(c) % 64 for c in text][:context_length]
        out[row, : len(ids)] = torch.tensor(ids)
    return out


@pytest.fixture
def fake_open_clip(monkeypatch):
    module = types.ModuleType("open_clip")
    module.create_model = lambda name, pretrained=None, precision="fp32", device="cpu": _FakeOpenClipModel()
    module.get_tokenizer = lambda name: _fake_tokenize
    monkeypatch.setitem(sys.modules, "open_clip", module)
    return module


def test_hps_scores_are_open_clip_cosines(fake_open_clip, tmp_path):
    torch.manual_seed(2)
    reference = _FakeOpenClipModel().eval()
    checkpoint = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": {"module." + k: v for k, v in reference.state_dict().items()}}, checkpoint)
    scorer = build_scorer("hps", checkpoint_path=checkpoint)
    assert scorer.name == "hps"
    media = _media(3, 8, 8, seed=23)  # already at the model's size: no resize, exact comparison
    prompts = ["a cat", "a dog", "a very long prompt that the tokenizer truncates"]
    scores = scorer(media, prompts, [{}] * 3)
    pixels = (media - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    with torch.no_grad():
        expected = (reference.encode_image(pixels, normalize=True)
                    * reference.encode_text(_fake_tokenize(prompts), normalize=True)).sum(-1)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    assert HPSv2Scorer(checkpoint).model is scorer.model
    assert torch.isfinite(scorer(_media(2, 20, 30), ["a", "b"], [{}, {}])).all()  # resized + cropped path
    with pytest.raises(ValueError, match="HPS_v2.1_compressed.pt"):
        HPSv2Scorer(tmp_path / "missing.pt")
