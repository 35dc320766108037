"""Video batches in the reward processor: whole videos to takes_video scorers, frames (averaged) to the others."""

import pytest
import torch

from flowforge.rewards.base import takes_video
from flowforge.rewards.processor import RewardProcessor


class VideoScorer:
    name = "video"
    needs_group = False
    takes_video = True

    def __init__(self):
        self.shapes = []

    def __call__(self, media, prompts, metadata):
        self.shapes.append(tuple(media.shape))
        return media[:, 0, -1].mean(dim=(1, 2)) - media[:, 0, 0].mean(dim=(1, 2))  # last minus first frame


class FrameScorer:
    name = "frame"
    needs_group = False

    def __init__(self):
        self.shapes = []

    def __call__(self, media, prompts, metadata):
        self.shapes.append((tuple(media.shape), list(prompts)))
        return media.mean(dim=(1, 2, 3))


def test_video_goes_whole_to_takes_video_scorers_and_frame_by_frame_to_others():
    video = torch.zeros(2, 3, 4, 8, 8)
    for f in range(4):
        video[:, :, f] = 0.1 * f
    video[1] += 0.5
    vs, fs = VideoScorer(), FrameScorer()
    assert takes_video(vs) and not takes_video(fs)
    proc = RewardProcessor({"video": vs, "frame": fs}, {"video": 1.0}, batch_size=64)
    comps, metrics = proc(video, ["a", "b"], [{}, {}], torch.tensor([0, 0]))
    assert vs.shapes == [(2, 3, 4, 8, 8)]
    assert fs.shapes == [((8, 3, 8, 8), ["a"] * 4 + ["b"] * 4)]
    assert torch.allclose(comps["video"], torch.tensor([0.3, 0.3]))
    assert torch.allclose(comps["frame"], torch.tensor([0.15, 0.65]))  # mean over each video's frames
    assert metrics["reward/frame_mean"] == pytest.approx(0.4)
