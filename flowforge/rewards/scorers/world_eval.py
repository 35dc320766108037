"""Evaluation scorers of the world-model demo: a second action-following judge and realism against the real future.

=========================  ===========================================================================================
name                       score of a generated clip ``[3, F, H, W]`` (in [0, 1]; the lift in [-1, 1])
=========================  ===========================================================================================
``inverse_dynamics``       fraction of transitions ``1..F-2`` whose action, as predicted by the inverse-dynamics
                           judge trained on real clips (:class:`flowforge.demo.world.InverseDynamicsNet`), is the
                           commanded one: an action-following judge independent of the paddle rule
``inverse_dynamics_lift``  the same judge's accuracy minus its mean over every reordering of the clip's own
                           commands (:func:`flowforge.demo.world.inverse_dynamics_lift`): chance 0, and a video whose
                           predicted actions never change (still, parked at a wall) scores exactly 0, where its
                           accuracy can exceed the shuffled-action null (parked at the right wall the judge reads
                           LEFT, the most frequent command)
``ball_track``             the share of frames ``1..F-1`` on which a learned ball locator (trained on the emulator's
                           RAM, :mod:`flowforge.demo.world_ball`) reads the clip and the real future alike: both
                           without a ball, or both with one within a pixel: a ball-path judge independent of the
                           pipeline teacher's detector
``world_psnr``             PSNR (dB) against the real clip, the mean over frames ``1..F-1`` (frame 0 is the given
                           condition) -- :func:`flowforge.algorithms.video_metrics.psnr`
``world_ssim``             SSIM against the real clip, the mean over frames ``1..F-1``
                           (:func:`flowforge.algorithms.video_metrics.ssim`)
=========================  ===========================================================================================

All take whole videos (``takes_video``). The real clip of a prompt is ``metadata["real_clip"]``: the file name, in
the directory of ``metadata["image"]``, of a grey PNG strip of its ``F`` frames side by side
(:func:`flowforge.data.atari.write_prompt_file`); a row without one scores NaN (not applicable). Commanded actions come
from ``metadata["actions"]`` or the prompt (:func:`~flowforge.rewards.scorers.action_following.commanded_actions`).
Used as ``eval.scorers`` (monitors), never as training rewards in the examples.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowforge.algorithms.video_metrics import psnr, ssim
from flowforge.rewards.scorers.action_following import commanded_actions


def _check_video(video: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> int:
    if not isinstance(video, Tensor) or video.dim() != 5 or video.shape[1] != 3 or video.shape[2] < 3:
        raise ValueError(f"video must be a float [B, 3, F >= 3, H, W] tensor in [0, 1], got "
                         f"{tuple(video.shape) if isinstance(video, Tensor) else type(video).__name__}")
    if len(prompts) != video.shape[0] or len(metadata) != video.shape[0]:
        raise ValueError(f"need one prompt and one metadata entry per video ({video.shape[0]})")
    return video.shape[0]


def load_real_clip(metadata: dict[str, Any], frames: int) -> Tensor | None:
    """The real clip ``[F, H, W]`` float32 in [0, 1] named by ``metadata["real_clip"]`` (None without one).

    Raises:
        ValueError: the strip is not ``F`` square frames wide.
    """
    from PIL import Image
    import numpy as np

    name, image = metadata.get("real_clip"), metadata.get("image")
    if not name or not image:
        return None
    path = pathlib.Path(str(image)).parent / str(name)
    strip = torch.from_numpy(np.asarray(Image.open(path).convert("L"), dtype=np.float32) / 255.0)
    h, w = strip.shape
    if w != frames * h:
        raise ValueError(f"{path}: a {h}x{w} strip is not {frames} frames of {h}x{h}")
    return strip.view(h, frames, h).permute(1, 0, 2)


class _RealismScorer:
    needs_group: ClassVar[bool] = False
    takes_video: ClassVar[bool] = True
    metadata_keys: ClassVar[tuple[str, ...]] = ("real_clip", "image")  # the real clip is a file named there
    metric = staticmethod(psnr)

    def score(self, grey: Tensor, real: Tensor) -> Tensor:
        """One grey clip and its real future ``[F, H, W]`` -> a 0-d score: :attr:`metric` over frames ``1..F-1``."""
        return self.metric(grey[1:], real[1:]).mean()

    @torch.no_grad()
    def __call__(self, video: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``video [B, 3, F, H, W]`` -> ``[B]`` float32 (NaN for rows without a real clip).

        Raises:
            ValueError: bad shapes; a real clip of another size.
        """
        b = _check_video(video, prompts, metadata)
        grey = video.float().mean(1).cpu()
        out = torch.full((b,), float("nan"))
        for i, meta in enumerate(metadata):
            real = load_real_clip(meta, grey.shape[1])
            if real is not None:
                if real.shape != grey[i].shape:
                    raise ValueError(f"real clip {tuple(real.shape)} does not match the video {tuple(grey[i].shape)}")
                out[i] = self.score(grey[i], real)
        return out.to(video.device)


class WorldPSNR(_RealismScorer):
    """Mean PSNR (dB) of frames ``1..F-1`` against the real clip (module table)."""

    name = "world_psnr"
    metric = staticmethod(psnr)


class WorldSSIM(_RealismScorer):
    """Mean SSIM of frames ``1..F-1`` against the real clip (module table)."""

    name = "world_ssim"
    metric = staticmethod(ssim)


class InverseDynamicsScorer:
    """Action following judged by the inverse-dynamics model (module table); ``weights``: its safetensors file
    (default the shipped ``flowforge/demo/weights/world_idm.safetensors``)."""

    name = "inverse_dynamics"
    needs_group: ClassVar[bool] = False
    takes_video: ClassVar[bool] = True

    def __init__(self, weights: str | None = None):
        from flowforge.demo.world import IDM_PATH, load_inverse_dynamics

        self.model = load_inverse_dynamics(weights or IDM_PATH)

    @staticmethod
    def judge(model, grey: Tensor, actions: Tensor) -> Tensor:
        """Grey clips ``[B, F, H, W]`` and action ids ``[B, F]`` -> ``[B]``: the judge's accuracy."""
        from flowforge.demo.world import inverse_dynamics_accuracy

        return inverse_dynamics_accuracy(model, grey, actions)

    @torch.no_grad()
    def __call__(self, video: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``video [B, 3, F, H, W]`` in [0, 1] -> ``[B]`` float32 (accuracy in [0, 1], lift in [-1, 1]).

        Raises:
            ValueError: bad shapes; actions not one per frame.
        """
        _check_video(video, prompts, metadata)
        f = video.shape[2]
        actions = [commanded_actions(p, m) for p, m in zip(prompts, metadata)]
        if any(len(a) != f for a in actions):
            raise ValueError(f"every video needs one action per frame ({f})")
        grey = video.float().mean(1).cpu()
        return self.judge(self.model, grey, torch.tensor(actions, dtype=torch.long)).to(video.device)


class InverseDynamicsLift(InverseDynamicsScorer):
    """The inverse-dynamics judge's accuracy over the within-clip shuffle of the commands, in [-1, 1], chance 0
    (module table)."""

    name = "inverse_dynamics_lift"

    @staticmethod
    def judge(model, grey: Tensor, actions: Tensor) -> Tensor:
        """Grey clips ``[B, F, H, W]`` and action ids ``[B, F]`` -> ``[B]``: the judge's lift over the null."""
        from flowforge.demo.world import inverse_dynamics_lift

        return inverse_dynamics_lift(model, grey, actions)


class BallPathScorer(_RealismScorer):
    """The ball's path against the real future, read by a learned locator (module table); ``weights``: its
    safetensors file (default the shipped ``flowforge/demo/weights/world_ball.safetensors``)."""

    name = "ball_track"

    def __init__(self, weights: str | None = None):
        from flowforge.demo.world_ball import BALL_PATH, load_ball_locator

        self.model = load_ball_locator(weights or BALL_PATH)

    def score(self, grey: Tensor, real: Tensor) -> Tensor:
        """One grey clip and its real future ``[F, H, W]`` -> a 0-d score in [0, 1]
        (:func:`flowforge.demo.world_ball.ball_path_score`)."""
        from flowforge.demo.world_ball import ball_path_score

        return ball_path_score(self.model, grey[None], real[None])[0]
