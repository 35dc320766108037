"""CLIP-family scorers count the prompts their tokenizer truncates (``reward/<name>_truncated_fraction``) instead
of truncating silently; the scores themselves are unchanged (still the truncated prompt's)."""

import sys
import types

import pytest
import torch

from flowforge.rewards import RewardProcessor, build_scorer
from tests.rewards.scorers.test_hps import _FakeOpenClipModel
from tests.rewards.scorers.tiny_clip import TEXT_WINDOW, direct_clip, random_media

PROMPTS = ["a cat", "two dogs on a red sofa", "a cat", "a"]  # the second needs 19 of 16 tokens (byte-level BPE)


def test_transformers_clip_scorers_flag_truncated_prompts(clip_dirs):
    model_dir, processor_dir = clip_dirs
    media = random_media(4, seed=5)
    for name in ("pickscore", "clip_score"):
        scorer = build_scorer(name, model_path=model_dir, processor_path=processor_dir)
        assert scorer.max_length == TEXT_WINDOW
        processor = RewardProcessor({name: scorer}, {name: 1.0}, batch_size=3)
        components, metrics = processor(media, PROMPTS, [{}] * 4)
        assert metrics[f"reward/{name}_truncated_fraction"] == 0.25
        assert torch.isfinite(components[name]).all()
    logits, *_ = direct_clip(model_dir, processor_dir, media, PROMPTS)  # scores stay those of the truncated text
    pickscore = build_scorer("pickscore", model_path=model_dir, processor_path=processor_dir)
    torch.testing.assert_close(pickscore(media, PROMPTS, [{}] * 4), logits)
    short = RewardProcessor({"p": pickscore}, {"p": 1.0})
    assert short(media, ["a cat"] * 4, [{}] * 4)[1]["reward/p_truncated_fraction"] == 0.0


class _BpeLikeTokenizer:
    """open_clip's tokenizer interface: ``encode`` (ids without start / end tokens) and ``context_length``."""

    context_length = 6

    def encode(self, text):
        return [ord(c) % 64 for c in text]

    def __call__(self, texts):
        out = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = self.encode(text)[: self.context_length]
            out[row, : len(ids)] = torch.tensor(ids)
        return out


def test_hps_flags_prompts_longer_than_the_context(monkeypatch, tmp_path):
    module = types.ModuleType("open_clip")  # open_clip is an optional extra: a stand-in with its interface
    module.create_model = lambda name, pretrained=None, precision="fp32", device="cpu": _FakeOpenClipModel()
    module.get_tokenizer = lambda name: _BpeLikeTokenizer()
    monkeypatch.setitem(sys.modules, "open_clip", module)
    checkpoint = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": _FakeOpenClipModel().state_dict()}, checkpoint)
    processor = RewardProcessor({"hps": build_scorer("hps", checkpoint_path=checkpoint)}, {"hps": 1.0})
    _, metrics = processor(random_media(3, 8, 8), ["abcd", "abcde", "a"], [{}] * 3)  # 4 + 2 ids fit in 6, 5 + 2 not
    assert metrics["reward/hps_truncated_fraction"] == pytest.approx(1 / 3)
