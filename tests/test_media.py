"""flowforge.media: the media tensors below rollout and rewards (8-bit pixels, video frames, audio batches)."""

import pytest
import torch

from flowforge.media import AudioBatch, to_uint8, video_frames


def test_to_uint8_rounds_clamped_values_in_float32_for_every_float_dtype():
    x = torch.tensor([-0.5, 0.0, 0.5 / 255, 1.5 / 255, 0.2, 0.5, 254.5 / 255, 1.0, 3.0])
    assert to_uint8(x).tolist() == [0, 0, 0, 2, 51, 128, 254, 255, 255]  # round half to even, as torch.round
    for dtype in (torch.float16, torch.bfloat16):
        y = torch.rand(2, 3, 4, 5).to(dtype).requires_grad_()
        out = to_uint8(y)
        assert out.dtype == torch.uint8 and out.shape == y.shape and not out.requires_grad
        assert torch.equal(out, (y.detach().float() * 255.0).round().to(torch.uint8))  # float32 maths, not dtype's


def test_video_frames_keeps_each_video_s_frames_together():
    video = torch.arange(2 * 3 * 4).float().view(2, 1, 3, 2, 2).expand(2, 3, 3, 2, 2)  # [B, C, F, H, W]
    frames = video_frames(video)
    assert frames.shape == (6, 3, 2, 2)
    assert torch.equal(frames[4], video[1, :, 1])  # video 1, frame 1


def test_audio_batch_checks_index_and_cat():
    a = AudioBatch(torch.zeros(2, 1, 8), 16000)
    assert len(AudioBatch.cat([a, a.index([1])])) == 3
    with pytest.raises(ValueError, match="sample rate"):
        AudioBatch.cat([a, AudioBatch(torch.zeros(1, 1, 8), 8000)])
    with pytest.raises(ValueError, match=r"\[B, C, T\]"):
        AudioBatch(torch.zeros(2, 8), 16000)
