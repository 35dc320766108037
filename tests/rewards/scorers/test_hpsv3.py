"""HPSv3 (:mod:`flowforge.rewards.scorers.hpsv3`) against the official HPSv3 code's scores on the same tiny random
Qwen2-VL (``data/hpsv3_official.json``, recorded by ``record_hpsv3.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from flowforge.rewards import build_scorer
from flowforge.rewards.scorers.hpsv3 import HPSv3Scorer
from tests.rewards.scorers.tiny_qwen2vl import GOLDEN, config_dict, fill_state, smooth_image, write_processor

OFFICIAL = json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def hpsv3_dirs(tmp_path_factory):
    """``(model_dir, base_dir)``: HPSv3.safetensors with the official key names, and the tiny base's files."""
    root = tmp_path_factory.mktemp("hpsv3")
    base, model = root / "base", root / "model"
    vocab_size = write_processor(base)
    (base / "config.json").write_text(json.dumps(config_dict(vocab_size)))
    model.mkdir()
    save_file(fill_state([(key, shape) for key, shape in OFFICIAL["keys_shapes"]]), str(model / "HPSv3.safetensors"))
    return model, base


def _media(case) -> torch.Tensor:
    return smooth_image(case["height"], case["width"], case["seed"]).permute(2, 0, 1).float() / 255


def test_tokens_and_pixels_equal_the_official_processor(hpsv3_dirs):
    scorer = HPSv3Scorer(*hpsv3_dirs, dtype="float32")
    cases = OFFICIAL["cases"]
    assert scorer.model.reward_token_id == OFFICIAL["reward_token_id"]
    inputs = scorer.inputs(torch.stack([_media(c) for c in cases[:2]]), [c["prompt"] for c in cases[:2]])
    for row, case in enumerate(cases[:2]):  # the chat layout, 256 <|image_pad|> slots, <|Reward|>, right padding
        assert inputs["input_ids"][row][inputs["attention_mask"][row] > 0].tolist() == case["input_ids"]
    for case, expected in zip(cases, OFFICIAL["pixel_values"]):
        pixels, grid = scorer.pixels(_media(case))
        pixels = pixels.double()
        weights = torch.arange(pixels.numel(), dtype=torch.float64).view_as(pixels) % 1009
        assert list(pixels.shape) == expected["shape"]
        if (case["height"], case["width"]) == (448, 448):  # no resize: the same numbers, in the same order
            # float32 pixels: the sum of ~2e5 values moves with the reduction order (threads), ~1e-7 relative
            assert pixels.sum().item() == pytest.approx(expected["sum"], rel=1e-6)
            assert (pixels * weights).sum().item() == pytest.approx(expected["weighted_sum"], rel=1e-6)
        else:  # 300 x 500 -> 392 x 504: torch bicubic vs PIL's 8-bit bicubic
            assert pixels.abs().sum().item() == pytest.approx(expected["abs_sum"], rel=2e-3)
    assert [scorer.pixels(_media(c))[1].tolist() for c in cases] == OFFICIAL["image_grid_thw"]


def test_scores_equal_the_official_code_on_random_weights(hpsv3_dirs):
    scorer = build_scorer("hpsv3", model_path=hpsv3_dirs[0], base_path=hpsv3_dirs[1], dtype="float32", batch_size=2)
    assert scorer.name == "hpsv3" and scorer.needs_group is False
    cases = OFFICIAL["cases"]
    scores = scorer(torch.stack([_media(c) for c in cases[:2]]), [c["prompt"] for c in cases[:2]], [{}, {}])
    assert scores.shape == (2,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor([c["mu"] for c in cases[:2]]), atol=2e-5, rtol=0)
    resized = scorer(_media(cases[2])[None], [cases[2]["prompt"]], [{}])  # 300 x 500: torch vs PIL bicubic
    assert abs(resized.item() - cases[2]["mu"]) < 5e-3
    assert scorer(torch.zeros(0, 3, 8, 8), [], []).shape == (0,)


def test_build_errors_are_clear(hpsv3_dirs, tmp_path):
    model_dir, base_dir = hpsv3_dirs
    with pytest.raises(ValueError, match="MizzenAI/HPSv3"):
        HPSv3Scorer(None, base_dir)
    with pytest.raises(ValueError, match="not a local directory"):
        HPSv3Scorer(model_dir, "Qwen/Qwen2-VL-7B-Instruct")
    with pytest.raises(ValueError, match="has no HPSv3.safetensors"):
        HPSv3Scorer(tmp_path, base_dir)
    with pytest.raises(ValueError, match="batch_size"):
        HPSv3Scorer(model_dir, base_dir, batch_size=0)


def test_bfloat16_builds_the_backbone_in_bfloat16(hpsv3_dirs):
    """The tiny config.json says float32: the backbone must still be built in the requested dtype (transformers builds
    each part in its config's dtype), the head in float32."""
    scorer = HPSv3Scorer(*hpsv3_dirs)
    assert {p.dtype for p in scorer.model.backbone.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in scorer.model.head.parameters()} == {torch.float32}
    case = OFFICIAL["cases"][0]
    assert abs(scorer(_media(case)[None], [case["prompt"]], [{}]).item() - case["mu"]) < 0.1
