"""The Breakout paddle tracker and rule (flowforge.data.paddle) on real frames: true actions agree, another clip's
do not, and videos whose paddle ignores the commands (parked at a wall, still, random, a bar) score at or below
chance (the most frequent command's share)."""

import numpy as np
import pytest
import torch

from flowforge.data import atari
from flowforge.data.atari import AtariDataConfig
from flowforge.data.paddle import paddle_action_sets, paddle_agreement, paddle_position

SMALL = AtariDataConfig(episodes=4, heldout_every=2, max_steps=40, frames=8, stride=4, seed=3)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    c = atari.load_atari_clips(SMALL, tmp_path_factory.mktemp("atari"))
    return c.clips(torch.arange(len(c.clip_starts)))


def chance(actions):
    """The most frequent command's share over the read transitions 1..F-2: what a command-blind video can reach."""
    counts = torch.bincount(actions[:, 1:-1].flatten(), minlength=3).float()
    return float(counts.max() / counts.sum())


def _hold(ale, table, action, steps, size, crop_top):
    xs = []
    for _ in range(steps):
        atari.step(ale, action, 4, table)
        frame = torch.from_numpy(atari.downsample(ale.getScreenGrayscale(), size, crop_top)).float() / 255.0
        xs.append(float(paddle_position(frame, crop_top=crop_top)))
    return xs


@pytest.mark.parametrize("size,crop_top", [(32, 33), (48, 97)])
def test_tracker_on_real_frames_left_moves_left_right_moves_right(size, crop_top):
    ale = atari.make_ale(0)
    table = atari.ale_actions(ale)
    screen = atari.downsample(ale.getScreenGrayscale(), size, crop_top)
    start = float(paddle_position(torch.from_numpy(screen) / 255.0, crop_top=crop_top))
    right = _hold(ale, table, 2, 3, size, crop_top)
    left = _hold(ale, table, 1, 6, size, crop_top)
    assert not np.isnan([start, *right, *left]).any()
    assert right[0] > start and right[1] > right[0] and right[2] > right[1]  # accelerating right
    assert all(b < a for a, b in zip(left[1:], left[2:]))  # held LEFT: moving left (after the game's delay)
    assert left[-1] < right[-1] - size / 4


def test_tracker_wants_a_paddle_not_the_ball_nor_a_bar():
    frame = torch.zeros(4, 32, 32)
    frame[0, -1, 20:24] = 0.7  # the paddle
    frame[0, -1, 5] = 0.35  # the ball passing through the paddle row
    frame[1, -1, :] = 0.8  # a bar across the frame
    frame[2, -1, 9] = 0.9  # a lone bright pixel
    pos = paddle_position(frame)
    assert abs(float(pos[0]) - 21.5) < 1e-5 and bool(torch.isnan(pos[1:]).all())
    big = torch.zeros(2, 48, 48)
    big[0, -2:, 10:16] = 0.8  # at 48 (crop from row 97) the paddle fills the two bottom rows
    big[1, -1, 10:16] = 0.8  # a one-row line is not a paddle there
    pos = paddle_position(big, crop_top=97)
    assert abs(float(pos[0]) - 12.5) < 1e-5 and bool(torch.isnan(pos[1]))


def test_motion_table():
    # columns: positions of 3 frames -> transition 1 reads v_0 and v_1
    x = torch.tensor([[10.0, 15.0, 20.0],  # moving right
                      [20.0, 15.0, 10.0],  # moving left
                      [10.0, 15.0, 17.0],  # slowing right
                      [15.0, 15.0, 15.0],  # at rest in the middle
                      [1.3, 1.3, 1.3],  # at rest at the left wall
                      [29.7, 29.7, 29.7],  # at rest at the right wall
                      [10.0, 15.0, 15.0],  # stopped after moving right (a reversal may look like this)
                      [10.0, float("nan"), 12.0]])  # a frame without a paddle
    sets = paddle_action_sets(x, size=32).int().tolist()  # (NOOP, LEFT, RIGHT)
    assert sets == [[[0, 0, 1]], [[0, 1, 0]], [[1, 0, 0]], [[1, 0, 0]], [[1, 1, 0]], [[1, 1, 1]], [[1, 1, 0]],
                    [[0, 0, 0]]]
    scores = paddle_agreement(x, torch.tensor([[0, 0, 0]] * 8), size=32)[:, 0].tolist()  # NOOP commanded
    assert scores == pytest.approx([0, 0, 1, 1, 0.5, 1 / 3, 0.5, 0])
    with pytest.raises(ValueError, match="F >= 3"):
        paddle_agreement(x[:, :2], torch.zeros(8, 2, dtype=torch.long))


def degenerate_videos(video):
    """``{name: [n, F, H, W]}`` command-blind videos built from real clips ``video [n, 1, F, H, W]``: the first frame
    held (still), the paddle parked at either wall, uniform noise, a bright bar in the paddle row
    (:func:`flowforge.demo.world_reward.command_blind_videos`)."""
    from flowforge.demo.world_reward import command_blind_videos

    return command_blind_videos(video[:, 0])


def test_true_actions_agree_and_command_blind_videos_score_at_most_chance(clips):
    video, actions = clips
    x = paddle_position(video[:, 0])
    true = float(paddle_agreement(x, actions).mean())
    other = float(paddle_agreement(x, actions.roll(1, dims=0)).mean())
    level = chance(actions)
    assert other <= level < true - 0.25  # the null (real motion, unrelated commands) is at chance, far below
    for name, fake in degenerate_videos(video).items():
        score = float(paddle_agreement(paddle_position(fake), actions).mean())
        assert score <= level, (name, score, level)
