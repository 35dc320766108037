"""eval/sample_change: thumbnails, the mean per-sample RMS change, the kept start (trainer use: test_trainer.py)."""

import math

import pytest
import torch

from flowforge.train.sample_change import CHANGE_SIDE, StartSamples, change_thumbnail, sample_change


def test_sample_change_is_zero_for_the_same_samples_and_the_rms_difference_otherwise():
    x = torch.rand(4, 3, 8, 8)
    start = change_thumbnail(x)
    assert sample_change(change_thumbnail(x.clone()), start) == 0.0
    # a constant shift of 0.125 on every element of one sample of two: the mean over samples of the per-sample RMS
    base = torch.full((2, 3, 4, 4), 0.5)
    moved = base.clone()
    moved[0] += 0.125
    assert sample_change(change_thumbnail(moved), change_thumbnail(base)) == 0.0625
    # a sample with a non-finite element in either eval is left out; none finite -> NaN
    broken = moved.clone()
    broken[1, 0, 0, 0] = float("nan")
    assert sample_change(change_thumbnail(broken), change_thumbnail(base)) == 0.125
    assert math.isnan(sample_change(torch.full((1, 3, 2, 2), float("nan")), torch.zeros(1, 3, 2, 2)))


def test_change_thumbnail_area_averages_large_frames_and_keeps_small_ones():
    small = torch.rand(2, 3, CHANGE_SIDE, CHANGE_SIDE // 2)
    t = change_thumbnail(small)
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert torch.equal(t, small)
    big = torch.rand(2, 3, 5, 2 * CHANGE_SIDE, CHANGE_SIDE)  # video: every frame pooled 2x2, aspect kept
    t = change_thumbnail(big)
    assert list(t.shape) == [2, 3, 5, CHANGE_SIDE, CHANGE_SIDE // 2]
    want = big.reshape(2, 3, 5, CHANGE_SIDE, 2, CHANGE_SIDE // 2, 2).mean(dim=(4, 6))
    assert torch.allclose(t, want, atol=1e-6)


def test_sample_change_and_thumbnail_reject_bad_input():
    with pytest.raises(ValueError, match="equal non-empty shapes"):
        sample_change(torch.zeros(2, 3, 4, 4), torch.zeros(3, 3, 4, 4))
    with pytest.raises(ValueError, match="equal non-empty shapes"):
        sample_change(torch.zeros(0, 3, 4, 4), torch.zeros(0, 3, 4, 4))
    with pytest.raises(ValueError, match="float"):
        change_thumbnail(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        change_thumbnail(torch.zeros(3, 4, 4))


def test_start_samples_warns_once_per_reason(tmp_path, caplog):
    images = torch.rand(2, 3, 4, 4)
    StartSamples(tmp_path / "start.safetensors", "eval set A").measure(0, images)
    other = StartSamples(tmp_path / "start.safetensors", "eval set B")  # the eval changed on resume
    with caplog.at_level("WARNING", logger="flowforge"):
        assert other.measure(1, images) is None
        assert other.measure(2, images) is None
    assert caplog.text.count("kept by another eval set") == 1
    assert StartSamples(tmp_path / "start.safetensors", "eval set A").measure(3, images) == 0.0
