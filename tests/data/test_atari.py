"""Real Breakout clips (flowforge.data.atari): deterministic cache, split by episode, prompt rows with episodes."""

import hashlib
import json

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


def test_prompt_file_round_trips_through_the_prompt_loader(clips, tmp_path):
    from flowforge.data.prompts import load_prompts

    held = clips.split("heldout")[:2]
    path = atari.write_prompt_file(clips, held, tmp_path, "heldout")
    records = load_prompts(path)
    assert len(records) == 2 and records[0].metadata["task"] == "i2v"
    assert records[0].prompt.split() == records[0].metadata["actions"]
    assert {r.metadata["episode"] for r in records} <= set(clips.episode[clips.clip_starts[held]].tolist())
    assert all(r.metadata["cluster"] == f"episode:{r.metadata['episode']}" for r in records)  # split by episode
    assert set(records[0].prompt.split()) <= set(ACTIONS)


def test_config_validation():
    with pytest.raises(ValueError, match="breakout"):
        AtariDataConfig(game="pong")
    with pytest.raises(ValueError):
        AtariDataConfig(frames=2)
    assert atari.action_ids(["left", "NOOP"]) == [1, 0]
    with pytest.raises(ValueError, match="allowed"):
        atari.action_ids(["UP"])
