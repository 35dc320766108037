"""ImageReward (:mod:`flowforge.rewards.scorers.image_reward`) against the official ImageReward code's scores on the
same tiny random weights (``data/image_reward_official.json``, recorded by ``record_image_reward.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from flowforge.rewards import build_scorer
from flowforge.rewards.scorers.image_reward import ImageRewardScorer, transformers_state
from tests.rewards.scorers.tiny_image_reward import GOLDEN, fill_state, smooth_image, write_med_config, write_tokenizer

OFFICIAL = json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def image_reward_dir(tmp_path_factory):
    """A tiny ``THUDM/ImageReward``-layout directory (official key names) holding its tokenizer too."""
    root = tmp_path_factory.mktemp("image_reward")
    write_tokenizer(root)
    write_med_config(root / "med_config.json")
    torch.save(fill_state([(key, shape) for key, shape in OFFICIAL["keys_shapes"]]), root / "ImageReward.pt")
    return root


def _case_media(case) -> torch.Tensor:
    return smooth_image(case["height"], case["width"], case["seed"]).permute(2, 0, 1)[None].float() / 255


def test_scores_equal_the_official_code_on_random_weights(image_reward_dir):
    scorer = build_scorer("image_reward", model_path=image_reward_dir)
    assert scorer.name == "image_reward" and scorer.needs_group is False
    for case in OFFICIAL["cases"]:
        tokens = scorer.tokenizer(case["prompt"], padding="max_length", truncation=True, max_length=35,
                                  return_tensors="pt")
        assert tokens["input_ids"][0].tolist() == case["input_ids"]  # [CLS] ... [SEP] [PAD]..., 35 ids
        pixels = scorer.preprocess(_case_media(case))
        score = scorer(_case_media(case), [case["prompt"]], [{}]).item()
        if "resized_uint8_hex" not in case:
            # no resize: the same pixels (crop at torchvision's rounded offset, 32 x 35 -> columns 2..33)
            assert pixels.double().sum().item() == pytest.approx(case["pixel_sum"], abs=1e-3)
            assert abs(score - case["score"]) < 2e-5, case
            continue
        official = torch.tensor(list(bytes.fromhex(case["resized_uint8_hex"])), dtype=torch.float32)
        official = official.view(1, 32, 32, 3).permute(0, 3, 1, 2) / 255
        mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (scorer.preprocess.mean, scorer.preprocess.std))
        official = (official - mean) / std
        assert (pixels - official).abs().max() < 0.02  # torch bicubic vs PIL's 8-bit bicubic: about a grey level
        raw = scorer.model(official, tokens["input_ids"], tokens["attention_mask"])
        assert abs(((raw - OFFICIAL["mean"]) / OFFICIAL["std"]).item() - case["score"]) < 2e-5, case
        assert abs(score - case["score"]) < 0.06, case  # the resampling difference through random weights


def test_batch_is_the_cases_one_by_one(image_reward_dir):
    scorer = ImageRewardScorer(image_reward_dir, batch_size=2)
    exact = [c for c in OFFICIAL["cases"] if (c["height"], c["width"]) == (32, 32)]
    media = torch.cat([_case_media(c) for c in exact] * 2)
    prompts = [c["prompt"] for c in exact] * 2
    scores = scorer(media, prompts, [{}] * len(prompts))
    assert scores.shape == (len(prompts),) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor([c["score"] for c in exact] * 2), atol=2e-5, rtol=0)
    assert scorer.sample_flags["truncated"].tolist() == [False, True] * 2  # the second prompt is cut at 35 tokens
    raw = ImageRewardScorer(image_reward_dir, normalize=False)(media, prompts, [{}] * len(prompts))
    torch.testing.assert_close(raw, scores * OFFICIAL["std"] + OFFICIAL["mean"], atol=1e-5, rtol=0)
    assert scorer(media[:0], [], []).shape == (0,)


def test_checkpoint_keys_map_onto_the_transformers_modules(image_reward_dir):
    official = torch.load(image_reward_dir / "ImageReward.pt", weights_only=True)
    scorer = ImageRewardScorer(image_reward_dir)
    mapped = transformers_state(official)
    assert len(mapped) == len(official)  # every official parameter has a home
    model_state = scorer.model.state_dict()
    for key, value in mapped.items():
        torch.testing.assert_close(model_state[key].float(), value)


def test_build_errors_are_clear(image_reward_dir, tmp_path):
    with pytest.raises(ValueError, match="THUDM/ImageReward"):
        ImageRewardScorer()
    with pytest.raises(ValueError, match="not a local directory"):
        ImageRewardScorer("THUDM/ImageReward")
    with pytest.raises(ValueError, match="has no ImageReward.pt"):
        ImageRewardScorer(tmp_path, image_reward_dir)
    with pytest.raises(ValueError, match="normalize"):
        ImageRewardScorer(image_reward_dir, normalize="yes")
    with pytest.raises(ValueError, match="batch_size"):
        ImageRewardScorer(image_reward_dir, batch_size=0)
    with pytest.raises(ValueError, match="BERT tokenizer|stub"):
        ImageRewardScorer(image_reward_dir, tmp_path)
