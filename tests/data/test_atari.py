"""Real Breakout clips (flowforge.data.atari): deterministic cache, split by episode, the paddle tracker and rule."""

import hashlib
import json

import numpy as np
import pytest
import torch

from flowforge.data import atari
from flowforge.data.atari import ACTIONS, AtariDataConfig

SMALL = AtariDataConfig(episodes=4, heldout_every=2, max_steps=40, frames=8, stride=4, seed=3)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return atari.load_atari_clips(SMALL, tmp_path_factory.mktemp("atari"))


def test_cache_is_deterministic_and_keyed_by_config(tmp_path, clips):
    a = atari.prepare_atari_clips(SMALL, tmp_path / "a")
    b = atari.prepare_atari_clips(SMALL, tmp_path / "b")
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()
    assert atari.prepare_atari_clips(SMALL, tmp_path / "a") == a  # reused, not rewritten
    other = atari.cache_path(AtariDataConfig(episodes=4, heldout_every=2, max_steps=40, seed=4), tmp_path / "a")
    assert other != a
    loaded = atari.load_atari_clips(SMALL, tmp_path / "a")
    assert torch.equal(loaded.frames, clips.frames) and torch.equal(loaded.actions, clips.actions)
    from safetensors import safe_open

    with safe_open(str(a), framework="pt") as f:
        meta = json.loads(f.metadata()["flowforge"])
    assert meta["config"]["seed"] == 3 and meta["rom_md5"] == atari.rom_md5() and meta["actions"] == list(ACTIONS)


def test_clip_layout_and_split_by_episode(clips):
    n = clips.frames.shape[0]
    assert clips.frames.dtype == torch.uint8 and clips.frames.shape[1:] == (32, 32)
    assert clips.actions.shape == (n,) and set(clips.actions.tolist()) <= {0, 1, 2}
    train, held = clips.split("train"), clips.split("heldout")
    assert len(train) > 0 and len(held) > 0 and len(train) + len(held) == len(clips.clip_starts)
    episode_of = clips.episode[clips.clip_starts]
    assert set(episode_of[train].tolist()).isdisjoint(episode_of[held].tolist())
    assert set(episode_of[held].tolist()) == {1, 3}  # e % heldout_every == heldout_every - 1
    video, actions = clips.clips(train[:3])
    assert video.shape == (3, 1, 8, 32, 32) and actions.shape == (3, 8)
    assert 0.0 <= float(video.min()) and float(video.max()) <= 1.0
    # a clip never crosses an episode boundary
    steps = clips.clip_starts[:, None] + torch.arange(8)
    assert bool((clips.episode[steps] == clips.episode[steps[:, :1]]).all())
    with pytest.raises(ValueError, match="allowed"):
        clips.split("test")


def _hold(ale, table, action, steps):
    xs = []
    for _ in range(steps):
        atari.step(ale, action, 4, table)
        frame = torch.from_numpy(atari.downsample(ale.getScreenGrayscale())).float() / 255.0
        xs.append(float(atari.paddle_position(frame)))
    return xs


def test_tracker_on_real_frames_left_moves_left_right_moves_right():
    ale = atari.make_ale(0)
    table = atari.ale_actions(ale)
    start = float(atari.paddle_position(torch.from_numpy(atari.downsample(ale.getScreenGrayscale())) / 255.0))
    right = _hold(ale, table, 2, 3)
    left = _hold(ale, table, 1, 6)
    assert not np.isnan([start, *right, *left]).any()
    assert right[0] > start and right[1] > right[0] and right[2] > right[1]  # accelerating right
    assert all(b < a for a, b in zip(left[1:], left[2:]))  # held LEFT: moving left (after the game's delay)
    assert left[-1] < right[-1] - 8


def test_tracker_prefers_the_paddle_over_the_ball_and_reports_absence():
    frame = torch.zeros(2, 32, 32)
    frame[0, -1, 20:24] = 0.7  # the paddle
    frame[0, -1, 5] = 0.35  # the ball passing through the paddle row
    pos = atari.paddle_position(frame)
    assert abs(float(pos[0]) - 21.5) < 1e-5 and torch.isnan(pos[1])


def test_paddle_rule_true_actions_agree_shuffled_do_not(clips):
    video, actions = clips.clips(torch.arange(len(clips.clip_starts)))
    x = atari.paddle_position(video[:, 0])
    true = atari.paddle_agreement(x, actions)
    assert true.shape == (len(actions), 6)
    shuffled = atari.paddle_agreement(x, actions.roll(1, dims=0))
    assert float(true.float().mean()) >= 0.9
    assert float(shuffled.float().mean()) < float(true.float().mean()) - 0.15
    with pytest.raises(ValueError, match="F >= 3"):
        atari.paddle_agreement(x[:, :2], actions[:, :2])


def test_prompt_file_round_trips_through_the_prompt_loader(clips, tmp_path):
    from flowforge.data.prompts import load_prompts

    held = clips.split("heldout")[:2]
    path = atari.write_prompt_file(clips, held, tmp_path, "heldout")
    records = load_prompts(path)
    assert len(records) == 2 and records[0].metadata["task"] == "i2v"
    assert records[0].prompt.split() == records[0].metadata["actions"]
    assert set(records[0].prompt.split()) <= set(ACTIONS)


def test_config_validation():
    with pytest.raises(ValueError, match="breakout"):
        AtariDataConfig(game="pong")
    with pytest.raises(ValueError):
        AtariDataConfig(frames=2)
    assert atari.action_ids(["left", "NOOP"]) == [1, 0]
    with pytest.raises(ValueError, match="allowed"):
        atari.action_ids(["UP"])
