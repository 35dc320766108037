"""action_following on real Breakout clips: true actions score high, other clips' actions lower (command-blind videos:
tests/rewards/scorers/test_world_eval.py)."""

import pytest
import torch

from flowforge.data import atari
from flowforge.data.atari import ACTIONS, AtariDataConfig
from flowforge.rewards.registry import build_scorer
from flowforge.rewards.scorers.action_following import ActionFollowingScorer


@pytest.fixture(scope="module")
def real():
    clips = atari.record_clips(AtariDataConfig(episodes=4, heldout_every=2, max_steps=48, seed=5))
    video, actions = clips.clips(torch.arange(len(clips.clip_starts)))
    media = video.repeat(1, 3, 1, 1, 1)  # [B, 3, F, H, W], as the world model's decode gives it
    names = [[ACTIONS[a] for a in row] for row in actions.tolist()]
    return media, names


def _meta(names):
    return [{"task": "i2v", "actions": n} for n in names]


def test_true_actions_score_high_shuffled_lower(real):
    media, names = real
    scorer = build_scorer("action_following")
    assert isinstance(scorer, ActionFollowingScorer) and scorer.needs_group is False
    true = scorer(media, [" ".join(n) for n in names], _meta(names))
    shuffled_names = names[1:] + names[:1]
    shuffled = scorer(media, [" ".join(n) for n in shuffled_names], _meta(shuffled_names))
    assert true.shape == (len(names),) and true.dtype == torch.float32
    assert 0.0 <= float(true.min()) and float(true.max()) <= 1.0
    assert float(shuffled.mean()) <= float(true.mean()) - 0.25


def test_frame_flattened_layout_and_prompt_fallback_agree(real):
    media, names = real
    media, names = media[:4], names[:4]
    scorer = ActionFollowingScorer()
    prompts = [" ".join(n) for n in names]
    whole = scorer(media, prompts, _meta(names))
    assert torch.equal(scorer(media, prompts, [{} for _ in names]), whole)  # actions read from the prompt
    frames = media.shape[2]
    flat = media.permute(0, 2, 1, 3, 4).flatten(0, 1)  # the trainer's video_frames layout
    per_frame = scorer(flat, [p for p in prompts for _ in range(frames)], [m for m in _meta(names) for _ in range(frames)])
    assert torch.equal(per_frame, whole.repeat_interleave(frames))
    with pytest.raises(ValueError, match="whole videos"):
        scorer(flat[:-1], [p for p in prompts for _ in range(frames)][:-1], [{} for _ in range(len(flat) - 1)])


def test_a_video_without_a_paddle_scores_zero_and_bad_inputs_raise(real):
    media, names = real
    scorer = ActionFollowingScorer()
    blank = torch.zeros_like(media[:2])
    assert scorer(blank, [" ".join(n) for n in names[:2]], _meta(names[:2])).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="one action per frame"):
        scorer(media[:1], ["LEFT"], [{"actions": ["LEFT"]}])
    with pytest.raises(ValueError, match="allowed"):
        scorer(media[:1], ["x"], [{"actions": ["JUMP"] * media.shape[2]}])
