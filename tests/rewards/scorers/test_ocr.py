"""The ``ocr`` reward: Flow-GRPO's formula by hand, and the real PP-OCRv4 models (shipped in the
``rapidocr-onnxruntime`` wheel) reading words rendered with PIL."""

import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from flowforge.rewards.scorers.ocr import edit_distance, ocr_reward, target_text

WORDS = ["hello", "FLOW", "forge 42"]


def test_edit_distance_and_reward_formula():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3 and edit_distance("ab", "ab") == 0
    assert ocr_reward("Hello World", "hello world") == 1.0  # spaces removed, lower-cased
    assert ocr_reward("xx OPEN yy", "open") == 1.0  # the target inside the reading costs nothing
    assert ocr_reward("OPEM", "open") == pytest.approx(0.75)  # one substitution in four characters
    assert ocr_reward("", "open") == 0.0 and ocr_reward("zzzzzzzzzzzz", "open") == 0.0  # the distance is capped
    assert math.isnan(ocr_reward("anything", "  "))


def test_target_is_metadata_text_else_the_quoted_prompt_text():
    assert target_text('a sign that says "OPEN" at night', {}) == "OPEN"
    assert target_text('a sign that says "OPEN"', {"text": "CLOSED"}) == "CLOSED"
    assert target_text("a sign with no quotes", {}) is None and target_text('one " quote', {}) is None
    with pytest.raises(ValueError, match="must be a string"):
        target_text("p", {"text": 3})


def _rendered(words, width=256, height=64):
    """``[B, 3, H, W]`` float: each word in black on white, PIL's scalable default font."""
    images = []
    for word in words:
        image = Image.new("RGB", (width, height), "white")
        ImageDraw.Draw(image).text((10, 10), word, fill="black", font=ImageFont.load_default(size=36))
        images.append(torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255)
    return torch.stack(images)


@pytest.fixture(scope="module")
def rapidocr():
    return pytest.importorskip("rapidocr_onnxruntime",
                               reason="the ocr reward's extra is not installed: pip install 'flowforge[ocr]'")


def test_the_real_model_reads_rendered_words(rapidocr):
    from flowforge.rewards import RewardProcessor
    from flowforge.rewards.registry import build_scorer

    media = _rendered(WORDS)
    prompts = [f'a card that says "{w}"' for w in WORDS]
    detect = build_scorer("ocr")  # detection + recognition (about 0.5 s per image on 2 cores)
    assert torch.equal(detect(media, prompts, [{}] * 3), torch.ones(3))
    scorer = build_scorer("ocr", mode="recognize", num_threads=1)  # the whole image is the text line
    for image, word in zip(media, WORDS):
        assert scorer.read((image.permute(1, 2, 0) * 255).round().byte().numpy()) == word
    assert torch.equal(scorer(media, prompts, [{}] * 3), torch.ones(3))
    wrong = scorer(media, ["p"] * 3, [{"text": "help"}, {"text": "flaw"}, {"text": "forge 43"}])
    assert wrong.tolist() == pytest.approx([0.5, 0.75, 6 / 7])  # hel(lo/p), fl(o/a)w, forge4(2/3)
    processor = RewardProcessor({"ocr": scorer}, {"ocr": 1.0})
    components, metrics = processor(media[:2], ['"hello"', "no target here"], [{}, {}])
    assert components["ocr"][0] == 1.0 and math.isnan(components["ocr"][1])
    assert metrics["reward/ocr_nan_fraction"] == 0.5


def test_options_are_checked(rapidocr):
    from flowforge.rewards.scorers.ocr import OcrScorer

    for bad in ({"mode": "fast"}, {"min_confidence": 2.0}, {"num_threads": 0}):
        with pytest.raises(ValueError):
            OcrScorer(**bad)
