"""The world-model demo's training reward (flowforge.demo.world_reward): the shipped inverse-dynamics model of the
paddle band is independent of the eval judge (architecture, seed, recording), its permutation-null score gives
chance 0 to every video whose predictions do not depend on the commands, and on real clips of a recording neither
model was trained on it tells the true actions from another clip's."""

import json

import pytest
import torch
from safetensors import safe_open

from flowforge.data import atari
from flowforge.data.atari import ACTIONS, AtariDataConfig
from flowforge.demo import world, world_reward
from flowforge.rewards.registry import build_scorer


def test_shipped_reward_model_is_small_and_independent_of_the_judge():
    path = world_reward.REWARD_IDM_PATH
    assert path.stat().st_size < 1_000_000  # shipped like the other demo weights
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["flowforge"])
    assert meta["seed"] == world_reward.REWARD_SEED != world.IDM_SEED
    assert meta["data"]["seed"] != AtariDataConfig().seed  # another recording than the judge's and the prompts'
    reward, judge = world_reward.load_band_idm(), world.load_inverse_dynamics()
    assert type(reward) is not type(judge)
    assert {k: tuple(v.shape) for k, v in reward.state_dict().items()} != \
        {k: tuple(v.shape) for k, v in judge.state_dict().items()}


def test_command_lift_is_zero_for_predictions_that_ignore_time():
    actions = torch.tensor([[0, 1, 1, 2, 0, 2, 1, 0], [1, 2, 2, 2, 2, 2, 2, 1]])
    constant = torch.tensor([0.2, 0.5, 0.3]).expand(2, 6, 3)
    assert torch.allclose(world.command_lift(constant, actions), torch.zeros(2), atol=1e-7)
    perfect = torch.nn.functional.one_hot(actions[:, 1:-1], 3).float()
    lift = world.command_lift(perfect, actions)
    # clip 0 commands 1 1 2 0 2 1 over transitions 1..6: 1 - sum f^2 = 1 - (9 + 4 + 1) / 36; clip 1 is all RIGHT
    assert lift.tolist() == pytest.approx([1 - 14 / 36, 0.0])
    with pytest.raises(ValueError, match="probs must be"):
        world.command_lift(constant[:, :5], actions)


def test_training_is_reproducible():
    clips = atari.record_clips(AtariDataConfig(episodes=2, heldout_every=2, max_steps=24, seed=7))
    a = world_reward.train_band_idm(clips, steps=3, batch_size=8)
    b = world_reward.train_band_idm(clips, steps=3, batch_size=8)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_band_triplets_refuses_other_shapes():
    with pytest.raises(ValueError, match="grey"):
        world_reward.band_triplets(torch.zeros(2, 3, 8, 32, 32))


def test_scorer_takes_whole_videos_and_frame_rows_alike():
    clips = atari.record_clips(AtariDataConfig(episodes=2, heldout_every=2, max_steps=24, seed=5))
    video, actions = clips.clips(torch.arange(len(clips.clip_starts)))
    media = video.repeat(1, 3, 1, 1, 1)
    names = [" ".join(ACTIONS[a] for a in row) for row in actions.tolist()]
    scorer = build_scorer("action_idm")
    assert scorer.takes_video and not scorer.needs_group
    whole = scorer(media, names, [{} for _ in names])
    f = media.shape[2]
    rows = media.transpose(1, 2).flatten(0, 1)  # [B * F, 3, H, W]
    flat = scorer(rows, [n for n in names for _ in range(f)], [{} for _ in range(rows.shape[0])])
    assert torch.allclose(flat, whole.repeat_interleave(f))
    assert float(whole.min()) >= -1.0 and float(whole.max()) <= 1.0
