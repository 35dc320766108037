"""An independent ball-path judge for the world-model demo: does the generated ball go where the real one went?

The world pipeline's teacher (:mod:`flowforge.orchestrate.world_judge`) also grades the ball's path, with a
hand-written detector (a brightness residual below the bricks, thresholds, an argmax). This judge measures the same
construct with none of that code or those features: a small CNN, :class:`BallLocatorNet`, **learned** to find the
ball in a ``32 x 32`` frame from the emulator's own record of where the ball was (RAM bytes 99 / 101,
:func:`flowforge.data.atari.ball_position`), never from a detector's output. It is trained on the training episodes'
frames (every recorded step, not only clip starts) and never trains a policy.

Score of a clip (``ball_track``, in [0, 1]): over frames ``1..F-1`` (frame 0 is the given condition), the share of
frames on which the locator reads the generated frame and the real future's frame alike -- both without a ball, or
both with one no more than :data:`TOLERANCE` pixels apart on each axis. Its nulls are printed by ``python -m
flowforge.demo.world_ball`` (the real future scores 1 by construction; another clip's real future, and the first
frame held still, are the chance levels); the locator's own held-out accuracy against the RAM is printed beside.

Shipped weights: ``flowforge/demo/weights/world_ball.safetensors`` (``python -m flowforge.demo.world_ball`` rewrites
them from the default :class:`~flowforge.data.atari.AtariDataConfig` recording, seed :data:`BALL_SEED`).
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from flowforge.data.atari import AtariDataConfig, record_episode
from flowforge.demo.nets import load_weights, save_weights, seeded, train_classifier

BALL_PATH = pathlib.Path(__file__).resolve().parent / "weights" / "world_ball.safetensors"
BALL_SEED = 3
TOLERANCE = 1.0  # pixels (of 32) on each axis: the same or a neighbouring cell
SIZE = 32


class BallLocatorNet(nn.Module):
    """Grey frames ``[N, 1, H, W]`` in [0, 1] -> logits ``[N, H W + 1]``: one per pixel (the ball's centre is there)
    and a last one for "no ball in view". Fully convolutional over the frame plus two coordinate channels (where a
    bright blob is -- the paddle's row, the bricks' band -- says whether it can be the ball)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=2, dilation=2), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU())
        self.cell = nn.Conv2d(width, 1, 1)
        self.absent = nn.Linear(2 * width, 1)

    def forward(self, frames: Tensor) -> Tensor:
        n, _, h, w = frames.shape
        ys = torch.linspace(-1.0, 1.0, h, device=frames.device).view(1, 1, h, 1).expand(n, 1, h, w)
        xs = torch.linspace(-1.0, 1.0, w, device=frames.device).view(1, 1, 1, w).expand(n, 1, h, w)
        feats = self.features(torch.cat([frames.float(), ys, xs], dim=1))
        pooled = torch.cat([feats.mean((2, 3)), feats.amax((2, 3))], dim=1)
        return torch.cat([self.cell(feats).flatten(1), self.absent(pooled)], dim=1)


def targets(ball: Tensor, size: int = SIZE) -> Tensor:
    """Ball centres ``[N, 2]`` ``(x, y)`` (NaN: none) in ``size x size`` frames (square, as the recording's) -> class
    ids ``[N]`` int64: ``row * size + col`` of the pixel holding the centre, ``size * size`` for no ball."""
    seen = ~torch.isnan(ball[:, 0])
    cell = torch.full((ball.shape[0],), size * size, dtype=torch.long)
    col = ball[seen, 0].floor().long().clamp(0, size - 1)
    row = ball[seen, 1].floor().long().clamp(0, size - 1)
    cell[seen] = row * size + col
    return cell


def record_ball_frames(config: AtariDataConfig, split: str) -> tuple[Tensor, Tensor]:
    """Every recorded step of the episodes of ``split`` (``"train"`` / ``"heldout"``, :class:`AtariDataConfig`'s
    rule): grey frames ``[N, size, size]`` uint8 and the RAM's ball centres ``[N, 2]`` float64 (NaN: none).

    Raises:
        ValueError: another split name.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split {split!r}; allowed: ['train', 'heldout']")
    frames, balls = [], []
    for e in range(config.episodes):
        if config.is_heldout(e) == (split == "heldout"):
            f, _, b = record_episode(config, e, ball=True)
            frames.append(torch.from_numpy(f))
            balls.append(torch.from_numpy(b))
    return torch.cat(frames), torch.cat(balls)


def train_ball_locator(frames: Tensor, ball: Tensor, *, steps: int = 2000, batch_size: int = 128, lr: float = 2e-3,
                       seed: int = BALL_SEED) -> BallLocatorNet:
    """Train :class:`BallLocatorNet` on grey frames ``[N, H, W]`` uint8 and RAM ball centres ``[N, 2]``
    (cross-entropy over the ``H W + 1`` classes of :func:`targets`), AdamW, ``steps`` batches drawn with ``seed``."""
    x = frames.float().div(255.0).unsqueeze(1)
    return train_classifier(seeded(BallLocatorNet, seed), x, targets(ball, frames.shape[-1]), steps=steps,
                            batch_size=batch_size, lr=lr, gen=torch.Generator().manual_seed(seed))


@torch.no_grad()
def locate(model: BallLocatorNet, grey: Tensor) -> Tensor:
    """Grey frames ``[..., H, W]`` in [0, 1] -> the ball's located centre ``[..., 2]`` float32 ``(x, y)`` in pixels
    (the centre of the most likely pixel), NaN where "no ball" is the most likely class."""
    lead, (h, w) = grey.shape[:-2], grey.shape[-2:]
    idx = model(grey.reshape(-1, 1, h, w).float()).argmax(-1)
    out = torch.stack([(idx % w).float() + 0.5, (idx // w).float() + 0.5], dim=-1)
    out[idx == h * w] = float("nan")
    return out.view(*lead, 2)


def near(a: Tensor, b: Tensor, tolerance: float = TOLERANCE) -> Tensor:
    """Centres ``[..., 2]`` -> ``[...]`` bool: within ``tolerance`` pixels on each axis (False where either is NaN)."""
    return ((a - b).abs() <= tolerance).all(-1)


def path_agreement(candidate: Tensor, real: Tensor, tolerance: float = TOLERANCE) -> Tensor:
    """Located centres ``[B, T, 2]`` of a candidate and of the real future (NaN: no ball) -> ``[B]`` float32: the
    share of the ``T`` frames where both have no ball, or both have one within ``tolerance`` pixels on each axis."""
    c_seen, r_seen = ~torch.isnan(candidate[..., 0]), ~torch.isnan(real[..., 0])
    return ((~c_seen & ~r_seen) | (c_seen & r_seen & near(candidate, real, tolerance))).float().mean(-1)


@torch.no_grad()
def ball_path_score(model: BallLocatorNet, video: Tensor, real: Tensor) -> Tensor:
    """Grey clips ``video``, ``real`` ``[B, F, H, W]`` in [0, 1] -> ``[B]`` float32 in [0, 1]: :func:`path_agreement`
    of the located balls over frames ``1..F-1``.

    Raises:
        ValueError: the two shapes differ, or fewer than 2 frames.
    """
    if video.shape != real.shape or video.dim() != 4 or video.shape[1] < 2:
        raise ValueError(f"need two grey clips [B, F >= 2, H, W] of one shape, got {tuple(video.shape)} and "
                         f"{tuple(real.shape)}")
    return path_agreement(locate(model, video[:, 1:]), locate(model, real[:, 1:]))


def save_ball_locator(model: BallLocatorNet, path: str | pathlib.Path = BALL_PATH) -> None:
    """Write the locator's weights (safetensors; metadata: its seed and training data)."""
    save_weights(model, path, {"seed": str(BALL_SEED), "data": json.dumps(
        {"clips": "AtariDataConfig()", "split": "train", "labels": "RAM bytes 99 / 101"})})


def load_ball_locator(path: str | pathlib.Path = BALL_PATH) -> BallLocatorNet:
    """The shipped locator (eval mode).

    Raises:
        FileNotFoundError: no weights at ``path`` (``python -m flowforge.demo.world_ball`` writes them).
    """
    with torch.device("meta"):  # no initialisation: building a judge draws nothing from the run's random stream
        model = BallLocatorNet()
    return load_weights(model, path, what="ball locator", module="flowforge.demo.world_ball")


@torch.no_grad()
def locator_accuracy(model: BallLocatorNet, frames: Tensor, ball: Tensor) -> dict[str, float]:
    """The locator against the RAM on grey frames ``[N, H, W]`` uint8: ``presence`` (ball / no ball read right),
    ``within_tolerance`` (of the frames with a ball: located within :data:`TOLERANCE` on each axis; NaN when none
    has one) and their counts."""
    found = locate(model, frames.float().div(255.0))
    seen = ~torch.isnan(ball[:, 0])
    got = ~torch.isnan(found[:, 0])
    close = near(found[seen], ball[seen].float())
    return {"frames": int(len(ball)), "with_ball": int(seen.sum()),
            "presence": float((seen == got).float().mean()), "within_tolerance": float(close.float().mean())}


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m flowforge.demo.world_ball``: record the default clips' episodes with the RAM's ball positions,
    train + save the locator on the train episodes, print its held-out accuracy and the judge's nulls on the
    held-out clips."""
    import argparse

    from flowforge.data.atari import load_atari_clips

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--out", default=str(BALL_PATH))
    p.add_argument("--cache-dir", default=".cache/flowforge")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    config = AtariDataConfig()
    frames, ball = record_ball_frames(config, "train")
    model = train_ball_locator(frames, ball)
    save_ball_locator(model, args.out)
    print(f"wrote {args.out}")
    held_frames, held_ball = record_ball_frames(config, "heldout")
    print("locator vs RAM, held-out episodes:", json.dumps(locator_accuracy(model, held_frames, held_ball)))
    clips = load_atari_clips(config, args.cache_dir)
    video = clips.clips(clips.split("heldout"))[0][:, 0]
    still = video[:, :1].expand_as(video)
    nulls = (("another clip's real future", video.roll(len(video) // 2, 0)), ("the first frame held still", still))
    for name, cand in nulls:
        s = ball_path_score(model, cand, video)
        print(f"ball_track null, {name}: {float(s.mean()):.3f} +- {float(s.std() / math.sqrt(len(s))):.3f} "
              f"({len(s)} held-out clips)")


if __name__ == "__main__":
    main()
