"""The audio-video onset agreement reward (flowforge/rewards/scorers/av_sync.py) on synthetic clips whose answer is
known, and the reward processor's ``takes_audio`` route (flowforge/rewards/processor.py): the scorer gets the whole
videos and, as ``audio=``, exactly the rows it scores; without audio it is refused."""
from __future__ import annotations

import math

import pytest
import torch

from flowforge.rewards.base import AudioBatch, takes_audio
from flowforge.rewards.processor import RewardProcessor
from flowforge.rewards.registry import build_scorer
from flowforge.rewards.scorers.av_sync import AVOnsetSync, spectral_flux, video_motion

RATE = 8000
FRAMES = 8
SEG = 400  # audio samples per frame


def _video(moves: list[int], seed: int = 0) -> torch.Tensor:
    """[3, F, 8, 8]: a still random frame that is replaced by a new random frame at each transition in ``moves``."""
    g = torch.Generator().manual_seed(seed)
    frames, current = [], torch.rand(3, 8, 8, generator=g)
    for f in range(FRAMES):
        if f in moves:
            current = torch.rand(3, 8, 8, generator=g)
        frames.append(current)
    return torch.stack(frames, dim=1)


def _audio(bursts: list[int], seed: int = 0) -> torch.Tensor:
    """[2, F * SEG]: quiet noise, with a loud tone + noise burst in the segments of ``bursts`` (stereo copies)."""
    g = torch.Generator().manual_seed(seed)
    wave = 0.01 * torch.randn(FRAMES * SEG, generator=g)
    t = torch.arange(SEG) / RATE
    for f in bursts:
        wave[f * SEG:(f + 1) * SEG] += 0.5 * torch.sin(2 * math.pi * 440 * t) + 0.2 * torch.randn(SEG, generator=g)
    return torch.stack([wave, wave])


def test_onsets_with_the_motion_score_high_and_elsewhere_low():
    scorer = build_scorer("av_onset_sync")
    assert isinstance(scorer, AVOnsetSync) and takes_audio(scorer) and scorer.takes_video
    video = torch.stack([_video([3, 6]), _video([3, 6]), _video([3, 6])])
    # in sync: a burst starts where the picture changes; off: the bursts start elsewhere
    audio = AudioBatch(torch.stack([_audio([3, 6]), _audio([1, 4]), _audio([3, 6], seed=1)]), RATE)
    scores = scorer(video, ["p"] * 3, [{}] * 3, audio=audio)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    assert scores[0] > 0.8 and scores[2] > 0.8 and scores[1] < 0.2


def test_undefined_cases_are_nan_and_bad_input_is_refused():
    scorer = AVOnsetSync()
    still = _video([]).unsqueeze(0)
    assert torch.isnan(scorer(still, ["p"], [{}], audio=AudioBatch(_audio([2]).unsqueeze(0), RATE))).all()
    two = _video([1])[:, :2].unsqueeze(0)
    assert torch.isnan(scorer(two, ["p"], [{}], audio=AudioBatch(_audio([1]).unsqueeze(0), RATE))).all()
    with pytest.raises(ValueError, match="audio"):
        scorer(_video([1]).unsqueeze(0), ["p"], [{}])
    with pytest.raises(ValueError, match="videos"):
        scorer(torch.rand(1, 3, 8, 8), ["p"], [{}], audio=AudioBatch(_audio([1]).unsqueeze(0), RATE))
    with pytest.raises(ValueError, match="segments"):
        spectral_flux(torch.zeros(1, 1, 10), 8)
    with pytest.raises(ValueError, match="sample_rate"):
        AudioBatch(torch.zeros(1, 1, 4), 0)


def test_features_are_the_documented_ones():
    video = _video([3]).unsqueeze(0)
    motion = video_motion(video)
    assert motion.shape == (1, FRAMES - 1) and motion[0, 2] > 0 and motion[0, :2].abs().max() == 0
    flux = spectral_flux(_audio([5]).unsqueeze(0), FRAMES)
    assert flux.shape == (1, FRAMES - 1) and int(flux[0].argmax()) == 4  # the increase into segment 5


class _Recorder:
    name = "rec"
    needs_group = False
    takes_audio = True

    def __init__(self):
        self.calls = []

    def __call__(self, media, prompts, metadata, *, audio):
        self.calls.append((media.clone(), list(prompts), audio))
        return audio.waveform[:, 0, 0].float()


def test_processor_hands_each_chunk_its_own_audio_rows():
    rec = _Recorder()
    video = torch.rand(5, 3, 4, 8, 8)
    wave = torch.arange(5.0).view(5, 1, 1).expand(5, 2, 16).contiguous()
    proc = RewardProcessor({"rec": rec, "sync": AVOnsetSync()}, {"rec": 1.0}, batch_size=2)
    components, metrics = proc(video, [f"p{i}" for i in range(5)], [{}] * 5, audio=AudioBatch(wave, RATE))
    assert torch.equal(components["rec"], torch.arange(5.0))  # row i got waveform i
    assert [len(p) for _, p, _ in rec.calls] == [2, 2, 1] and rec.calls[2][1] == ["p4"]
    assert all(m.ndim == 5 and a.sample_rate == RATE for m, _, a in rec.calls)  # whole videos, not frames
    assert "reward/sync_mean" in metrics
    with pytest.raises(ValueError, match="produced none"):
        proc(video, ["p"] * 5, [{}] * 5)
    with pytest.raises(ValueError, match="rows"):
        proc(video, ["p"] * 5, [{}] * 5, audio=AudioBatch(wave[:3], RATE))
