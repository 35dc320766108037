"""Action following: does the generated game video obey the commanded joystick? A rule from the game, not a model.

For each generated Breakout clip the paddle is located in every frame by the game's own layout
(:func:`flowforge.data.paddle.paddle_position`: a paddle-wide run in every row of the paddle band) and each
transition's motion is compared with the commanded action (:func:`flowforge.data.paddle.paddle_agreement`: LEFT /
RIGHT accelerate the paddle that way, NOOP lets it come to rest; a motion that fits several actions, such as resting
at a wall, scores ``1 / (number it fits)``). The reward is the mean over the clip's ``F - 2`` read transitions, in
[0, 1]; a frame without a visible paddle makes its transitions score 0. On the demo's real held-out clips the true
actions score ~0.85 and another clip's actions ~0.30; a video whose paddle ignores the commands (parked at a wall,
still, random) scores at most the most frequent command's share (~0.42), its chance level.

Inputs: ``media [B, 3, F, H, W]`` (whole videos) or the trainer's frame-flattened ``[B * F, 3, H, W]`` (each video's
frames consecutive and every frame carrying its video's metadata; then each frame row returns its video's score, so
the per-frame mean the trainer takes is the video's score). Actions come from ``metadata[i]["actions"]`` (names or
ids, one per frame) or, without that key, from the prompt (space-separated names, the world model's prompt format).

``action_idm`` (:class:`InverseDynamicsReward`) is the learned alternative with the same inputs: an inverse-dynamics
model of the paddle band trained on real clips of another recording (:mod:`flowforge.demo.world_reward`), scored
against a within-clip shuffle of the commands (chance 0; a video whose predicted actions never change scores 0).
The eval judge ``inverse_dynamics`` (:mod:`flowforge.rewards.scorers.world_eval`) is a model of another
architecture, seed and recording.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowforge.data.atari import ACTIONS, action_ids
from flowforge.data.paddle import paddle_agreement, paddle_position
from flowforge.rewards.base import check_media


def commanded_actions(prompt: str, metadata: dict[str, Any]) -> list[int]:
    """Action ids of one video: ``metadata["actions"]`` (names or ints) or the prompt's space-separated names.

    Raises:
        ValueError: an unknown name or an id outside ``0..len(ACTIONS)-1``.
    """
    raw = metadata.get("actions") if isinstance(metadata, dict) else None
    if raw is None:
        return action_ids(prompt.split())
    if all(isinstance(a, int) and not isinstance(a, bool) for a in raw):
        if any(not 0 <= a < len(ACTIONS) for a in raw):
            raise ValueError(f"action ids {list(raw)} outside 0..{len(ACTIONS) - 1}")
        return list(raw)
    return action_ids([str(a) for a in raw])


class VideoActionScorer:
    """Base of the scorers that judge a whole clip's action following: takes whole videos or the trainer's
    frame-flattened rows (module docstring) and hands :meth:`score_clips` grey clips with their commanded action
    ids."""

    name = "video_action"
    needs_group: ClassVar[bool] = False
    takes_video: ClassVar[bool] = True  # scores whole clips: give it [B, 3, F, H, W] when the caller can

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, F, H, W]`` (or frame-flattened ``[B * F, 3, H, W]``) in [0, 1] -> ``[B]`` (``[B * F]``)
        float32 on ``media``'s device.

        Raises:
            ValueError: bad shapes; prompts / metadata not one per row; actions not one per frame; flattened rows
                that do not form whole videos.
        """
        if isinstance(media, Tensor) and media.dim() == 5:
            return self.score_videos(media, prompts, metadata)
        rows = check_media(media)
        if len(prompts) != rows or len(metadata) != rows:
            raise ValueError(f"need one prompt and one metadata entry per frame row ({rows})")
        if rows == 0:
            return torch.empty(0, device=media.device)
        frames = len(commanded_actions(prompts[0], metadata[0]))
        if frames < 3 or rows % frames:
            raise ValueError(f"{rows} frame rows do not split into whole videos of {frames} frames (make "
                             "reward.batch_size a multiple of the frame count, or pass [B, 3, F, H, W])")
        for start in range(0, rows, frames):
            if any(metadata[r] != metadata[start] or prompts[r] != prompts[start] for r in range(start, start + frames)):
                raise ValueError(f"frame rows {start}..{start + frames - 1} do not share one video's metadata")
        video = media.view(rows // frames, frames, *media.shape[1:]).transpose(1, 2)
        scores = self.score_videos(video, prompts[::frames], metadata[::frames])
        return scores.repeat_interleave(frames)

    @torch.no_grad()
    def score_videos(self, video: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``video [B, 3, F, H, W]`` in [0, 1] -> ``[B]`` float32 (:meth:`score_clips` of its grey frames).

        Raises:
            ValueError: not ``[B, 3, F >= 3, H, W]``; lengths; a video whose actions are not ``F``.
        """
        if video.dim() != 5 or video.shape[1] != 3 or video.shape[2] < 3 or not video.is_floating_point():
            raise ValueError(f"video must be a float [B, 3, F >= 3, H, W] tensor in [0, 1], got {tuple(video.shape)}")
        b, _, f = video.shape[:3]
        if len(prompts) != b or len(metadata) != b:
            raise ValueError(f"need one prompt and one metadata entry per video ({b})")
        actions = [commanded_actions(p, m) for p, m in zip(prompts, metadata)]
        if any(len(a) != f for a in actions):
            raise ValueError(f"every video needs one action per frame ({f}); got {sorted({len(a) for a in actions})}")
        grey = video.float().mean(dim=1).cpu()  # [B, F, H, W]
        return self.score_clips(grey, torch.tensor(actions, dtype=torch.long)).to(video.device)

    def score_clips(self, grey: Tensor, actions: Tensor) -> Tensor:
        """Grey clips ``[B, F, H, W]`` in [0, 1] (CPU) and action ids ``[B, F]`` -> ``[B]`` float32."""
        raise NotImplementedError


class ActionFollowingScorer(VideoActionScorer):
    """Reward = fraction of transitions whose paddle motion agrees with the commanded action (module docstring)."""

    name = "action_following"

    def score_clips(self, grey: Tensor, actions: Tensor) -> Tensor:
        """The mean paddle-rule agreement of transitions ``1..F-2``, in [0, 1]."""
        agree = paddle_agreement(paddle_position(grey), actions, size=grey.shape[-1])
        return agree.mean(dim=1)


class InverseDynamicsReward(VideoActionScorer):
    """``action_idm``: the inverse-dynamics training reward (:mod:`flowforge.demo.world_reward`): the paddle-band
    model's probability of each commanded action minus its mean over the clip's commands reordered, in [-1, 1];
    chance is 0 and a video whose predicted actions do not change over time scores exactly 0. ``weights``: its
    safetensors file (default the shipped ``flowforge/demo/weights/world_reward_idm.safetensors``)."""

    name = "action_idm"

    def __init__(self, weights: str | None = None):
        from flowforge.demo.world_reward import REWARD_IDM_PATH, load_band_idm

        self.model = load_band_idm(weights or REWARD_IDM_PATH)

    def score_clips(self, grey: Tensor, actions: Tensor) -> Tensor:
        """:func:`flowforge.demo.world_reward.idm_reward` of the model's action probabilities."""
        from flowforge.demo.world_reward import action_probabilities, idm_reward

        return idm_reward(action_probabilities(self.model, grey), actions)
