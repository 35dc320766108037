"""HPSv2 (:mod:`flowforge.rewards.scorers.hps`) against a stand-in ``open_clip`` module (the real one needs
torchvision, which this environment lacks): the install hint on a missing / broken dependency, and the score."""

from __future__ import annotations

import importlib.abc
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flowforge.rewards import build_scorer
from flowforge.rewards.scorers.hps import HPSv2Scorer
from tests.rewards.scorers.tiny_clip import MEAN, STD, random_media


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
    media = random_media(3, 8, 8, seed=23)  # already at the model's size: no resize, exact comparison
    prompts = ["a cat", "a dog", "a very long prompt that the tokenizer truncates"]
    scores = scorer(media, prompts, [{}] * 3)
    pixels = (media - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    with torch.no_grad():
        expected = (reference.encode_image(pixels, normalize=True)
                    * reference.encode_text(_fake_tokenize(prompts), normalize=True)).sum(-1)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    assert HPSv2Scorer(checkpoint).model is scorer.model
    assert torch.isfinite(scorer(random_media(2, 20, 30), ["a", "b"], [{}, {}])).all()  # resized + cropped path
    with pytest.raises(ValueError, match="HPS_v2.1_compressed.pt"):
        HPSv2Scorer(tmp_path / "missing.pt")
