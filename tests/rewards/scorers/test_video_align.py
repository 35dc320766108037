"""VideoAlign (:mod:`flowforge.rewards.scorers.video_align`) against the official VideoAlign code's rewards on the
same tiny random Qwen2-VL, for a LoRA and a full checkpoint (``data/video_align_official.json``, recorded by
``record_video_align.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from flowforge.rewards import build_scorer
from flowforge.rewards.scorers.video_align import VideoAlignScorer, frame_indices
from tests.rewards.scorers.tiny_qwen2vl import config_dict, fill_state, write_processor
from tests.rewards.scorers.tiny_video_align import (
    CASES, DATA_CONFIG, GOLDEN, INFERENCE_CONFIG, LORA, NUM_FRAMES_CASE, video_frames,
)

OFFICIAL = json.loads(GOLDEN.read_text())
DIMS = ("VQ", "MQ", "TA")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``{"base", "lora", "full"}``: the tiny base (its 4.45-layout weights) and the two checkpoint directories, with
    the files the official run saved, filled with the same numbers."""
    root = tmp_path_factory.mktemp("video_align")
    base = root / "base"
    vocab_size = write_processor(base)
    (base / "config.json").write_text(json.dumps(config_dict(vocab_size)))
    save_file(fill_state(OFFICIAL["base_keys_shapes"]), str(base / "model.safetensors"))
    out = {"base": base}
    for variant, lora in (("lora", True), ("full", False)):
        record, folder = OFFICIAL[variant], root / variant / f"checkpoint-{OFFICIAL[variant]['step']}"
        folder.mkdir(parents=True)
        (root / variant / "model_config.json").write_text(json.dumps({
            "data_config": DATA_CONFIG, "inference_config": INFERENCE_CONFIG,
            "model_config": {"output_dim": record["output_dim"], "use_special_tokens": True, "reward_token": "special"},
            "peft_lora_config": {**LORA, "lora_enable": lora}}))
        if lora:
            trained = fill_state(record["trained_keys_shapes"], seed=1)
            adapter = {key.replace(".default", ""): value for key, value in trained.items() if "lora_" in key}
            for key, shape in record["adapter_keys_shapes"]:
                if "lora_" not in key:  # PEFT saved the resized embedding layers too
                    adapter[key] = trained.get(key, torch.zeros(shape))
            save_file(adapter, str(folder / "adapter_model.safetensors"))
            torch.save({key: value for key, value in trained.items() if "lora_" not in key},
                       folder / "non_lora_state_dict.pth")
        else:
            torch.save(fill_state(record["model_keys_shapes"], seed=2), folder / "model.pth")
        out[variant] = root / variant
    return out


def _clip(case) -> torch.Tensor:
    _, frames, height, width, _, seed = case
    return video_frames(frames, height, width, seed).transpose(0, 1).float() / 255  # [3, F, H, W]


def test_frame_sampling_is_vision_process_smart_nframes():
    assert frame_indices(10, video_fps=8.0, fps=2.0, num_frames=None) == [0, 3, 6, 9]  # 2.5 frames -> at least 4
    assert frame_indices(17, video_fps=16.0, fps=2.0, num_frames=None) == [0, 5, 11, 16]
    assert frame_indices(81, video_fps=16.0, fps=2.0, num_frames=None) == [0, 9, 18, 27, 36, 44, 53, 62, 71, 80]
    assert frame_indices(10, video_fps=None, fps=2.0, num_frames=6) == [0, 2, 4, 5, 7, 9]
    assert frame_indices(3, video_fps=None, fps=2.0, num_frames=8) == [0, 1, 2]  # capped at the clip
    with pytest.raises(ValueError, match="video_fps"):
        frame_indices(10, video_fps=None, fps=2.0, num_frames=None)


def test_tokens_and_pixels_equal_the_official_processor(dirs):
    scorer = VideoAlignScorer(dirs["lora"], dirs["base"], video_fps=8.0, dtype="float32")
    record = OFFICIAL["lora"]
    inputs = scorer.inputs(torch.stack([_clip(c) for c in CASES[:2]]), [c[0] for c in CASES[:2]])
    for row in range(2):  # chat layout, <|video_pad|> slots, the three reward tokens, right padding
        assert inputs["input_ids"][row][inputs["attention_mask"][row] > 0].tolist() == record["input_ids"][row]
    fast = VideoAlignScorer(dirs["lora"], dirs["base"], video_fps=16.0, dtype="float32")
    for case, expected, grid in zip(CASES, record["pixel_values"], record["video_grid_thw"]):
        pixels, thw = (scorer if case[4] == 8.0 else fast).pixels(_clip(case))
        pixels = pixels.double()
        weights = torch.arange(pixels.numel(), dtype=torch.float64).view_as(pixels) % 1009
        assert list(pixels.shape) == expected["shape"] and thw.tolist() == grid
        assert pixels.abs().sum().item() == pytest.approx(expected["abs_sum"], rel=1e-6)
        assert (pixels * weights).sum().item() == pytest.approx(expected["weighted_sum"], rel=1e-6)


@pytest.mark.parametrize("variant", ["lora", "full"])
def test_rewards_equal_the_official_code_on_random_weights(dirs, variant):
    record = OFFICIAL[variant]
    by_fps = {fps: VideoAlignScorer(dirs[variant], dirs["base"], video_fps=fps, dtype="float32", use_norm=False)
              for fps in (8.0, 16.0)}
    raw = torch.cat([by_fps[8.0].dimensions(torch.stack([_clip(c) for c in CASES[:2]]), [c[0] for c in CASES[:2]]),
                     by_fps[16.0].dimensions(_clip(CASES[2])[None], [CASES[2][0]])])
    torch.testing.assert_close(raw, torch.tensor([[r[k] for k in DIMS] for r in record["raw"]]), atol=2e-5, rtol=0)
    overall = build_scorer("video_align", model_path=dirs[variant], base_path=dirs["base"], video_fps=8.0,
                           dtype="float32", batch_size=1)
    assert overall.name == "video_align" and overall.takes_video and overall.needs_group is False
    scores = overall(torch.stack([_clip(c) for c in CASES[:2]]), [c[0] for c in CASES[:2]], [{}, {}])
    assert scores.shape == (2,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor([r["Overall"] for r in record["normed"][:2]]), atol=2e-5, rtol=0)
    ta = VideoAlignScorer(dirs[variant], dirs["base"], heads=["ta", "vq"], num_frames=NUM_FRAMES_CASE, dtype="float32")
    expected = record["num_frames_normed"][0]
    assert ta(_clip(CASES[0])[None], [CASES[0][0]], [{}]).item() == pytest.approx(expected["TA"] + expected["VQ"],
                                                                                  abs=2e-5)
    assert overall(torch.zeros(0, 3, 4, 8, 8), [], []).shape == (0,)


def test_bad_options_and_files_are_clear(dirs, tmp_path):
    with pytest.raises(ValueError, match="KwaiVGI/VideoReward"):
        VideoAlignScorer(None, dirs["base"], video_fps=8.0)
    with pytest.raises(ValueError, match="heads must be overall"):
        VideoAlignScorer(dirs["full"], dirs["base"], heads="motion", video_fps=8.0)
    with pytest.raises(ValueError, match="heads must be overall"):
        VideoAlignScorer(dirs["full"], dirs["base"], heads=["overall", "ta"], video_fps=8.0)
    with pytest.raises(ValueError, match="video_fps"):
        VideoAlignScorer(dirs["full"], dirs["base"], dtype="float32")
    with pytest.raises(ValueError, match=r"checkpoint_step=5 is not in .*allowed: \[3\]"):
        VideoAlignScorer(dirs["full"], dirs["base"], video_fps=8.0, checkpoint_step=5)
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "model_config.json").write_text(json.dumps({"data_config": DATA_CONFIG, "model_config": {
        "use_special_tokens": True, "reward_token": "special"}}))
    with pytest.raises(ValueError, match="neither model.pth nor adapter_model"):
        VideoAlignScorer(tmp_path, dirs["base"], video_fps=8.0)
    scorer = VideoAlignScorer(dirs["full"], dirs["base"], video_fps=8.0, dtype="float32")
    with pytest.raises(ValueError, match=r"clips \[B, 3, F, H, W\]"):
        scorer(torch.zeros(1, 3, 8, 8), ["a"], [{}])


def test_bfloat16_builds_every_part_in_bfloat16(dirs):
    """The tiny config.json says float32: every part must still be built in the requested dtype (transformers builds
    each part in its config's dtype), and the rewards stay near the float32 official ones."""
    scorer = VideoAlignScorer(dirs["full"], dirs["base"], video_fps=8.0, heads="mq")
    assert {p.dtype for p in scorer.model.parameters()} == {torch.bfloat16}
    scores = scorer(torch.stack([_clip(c) for c in CASES[:2]]), [c[0] for c in CASES[:2]], [{}, {}])
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor([r["MQ"] for r in OFFICIAL["full"]["normed"][:2]]), atol=0.1,
                               rtol=0)
