"""The embedded world-model demo: Breakout start frames as prompts, the inverse-dynamics judge, the shipped files.

================================  ==================================================================================
name / file                       what
================================  ==================================================================================
``demo:world``                    ``weights/world/``: the tiny world model after ``flowforge sft
                                  examples/worldmodel/sft.yaml`` (:mod:`flowforge.train.sft.world`)
``demo:world-train``              ``prompts/world-train.jsonl``: :data:`TRAIN_STARTS` training clips (first frame +
                                  the clip's real actions), evenly spaced over the train split
``demo:world-eval``               ``prompts/world-eval.jsonl``: :data:`EVAL_STARTS` held-out clips (other episodes)
``weights/world_idm.safetensors``  the inverse-dynamics judge (:class:`InverseDynamicsNet`)
``weights/world_reward_idm...``    the training reward's inverse-dynamics model, another architecture, seed and
                                  recording (:mod:`flowforge.demo.world_reward`, scorer ``action_idm``)
================================  ==================================================================================

Every prompt row also names ``real_clip``: a PNG strip of the real clip's ``F`` frames side by side, in the
directory of its ``image``, the real future that realism (PSNR / SSIM) is measured against.

**Inverse-dynamics judge** (a second, independent judge of action following, for evaluation): a small CNN reads
three consecutive frames ``(t - 1, t, t + 1)`` (the paddle's velocity and acceleration are visible in them) and
predicts the action held at frame ``t`` (NOOP / LEFT / RIGHT). It is trained on the real training clips with their
recorded actions (cross-entropy, AdamW), so it learns the game's dynamics from data rather than from the paddle
rule of :func:`flowforge.data.atari.paddle_agreement`; its score of a video is the fraction of transitions
``1..F-2`` whose predicted action is the commanded one.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from flowforge.data.atari import ACTIONS, AtariClips, AtariDataConfig, load_atari_clips, write_prompt_file
from flowforge.demo.nets import load_weights, save_weights, seeded, train_classifier

IDM_PATH = pathlib.Path(__file__).resolve().parent / "weights" / "world_idm.safetensors"
PROMPTS_DIR = pathlib.Path(__file__).resolve().parent / "prompts"
TRAIN_STARTS = 128
EVAL_STARTS = 32
IDM_SEED = 1


def spaced(indices: Tensor, count: int) -> Tensor:
    """``count`` of ``indices`` (all when fewer), evenly spaced from the first to the last."""
    return indices[torch.linspace(0, len(indices) - 1, min(count, len(indices))).round().long()]


def write_world_prompt_sets(directory: str | pathlib.Path = PROMPTS_DIR, cache_dir: str = ".cache/flowforge",
                            clips: AtariClips | None = None) -> list[pathlib.Path]:
    """Write ``world-train.jsonl`` / ``world-eval.jsonl`` (and their PNGs) into ``directory`` from the default
    :class:`~flowforge.data.atari.AtariDataConfig` clips; returns the two JSONL paths."""
    clips = load_atari_clips(AtariDataConfig(), cache_dir) if clips is None else clips
    out = []
    for name, split, count in (("world-train", "train", TRAIN_STARTS), ("world-eval", "heldout", EVAL_STARTS)):
        out.append(write_prompt_file(clips, spaced(clips.split(split), count), directory, name))
    return out


class InverseDynamicsNet(nn.Module):
    """Frames ``[N, 3, H, W]`` (grey frames ``t - 1, t, t + 1`` as channels, in [0, 1]) -> action logits ``[N, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.LazyLinear(64), nn.ReLU(), nn.Linear(64, len(ACTIONS)))

    def forward(self, frames: Tensor) -> Tensor:
        return self.head(self.features(frames))


def triplets(video: Tensor) -> Tensor:
    """Grey video ``[B, F, H, W]`` -> ``[B, F - 2, 3, H, W]``: frames ``(t - 1, t, t + 1)`` for ``t = 1..F-2``."""
    return torch.stack([video[:, :-2], video[:, 1:-1], video[:, 2:]], dim=2)


def train_inverse_dynamics(clips: AtariClips, *, steps: int = 1500, batch_size: int = 128, lr: float = 2e-3,
                           seed: int = IDM_SEED) -> InverseDynamicsNet:
    """Train :class:`InverseDynamicsNet` on the train split of ``clips`` (transitions ``1..F-2`` of every clip with
    their recorded actions), AdamW, ``steps`` steps of ``batch_size`` transitions drawn with ``seed``."""
    video, actions = clips.clips(clips.split("train"))
    x = triplets(video[:, 0]).flatten(0, 1)  # [N (F-2), 3, H, W]
    y = actions[:, 1:-1].flatten()

    def build() -> InverseDynamicsNet:
        model = InverseDynamicsNet()
        model(x[:1])  # materialise the lazy layer (seeded too)
        return model

    return train_classifier(seeded(build, seed), x, y, steps=steps, batch_size=batch_size, lr=lr,
                            gen=torch.Generator().manual_seed(seed))


@torch.no_grad()
def inverse_dynamics_accuracy(model: InverseDynamicsNet, video: Tensor, actions: Tensor) -> Tensor:
    """``[B]`` float32: the fraction of transitions ``1..F-2`` of grey ``video [B, F, H, W]`` in [0, 1] whose
    predicted action equals ``actions [B, F]``'s."""
    b, f = video.shape[:2]
    pred = model(triplets(video.float()).flatten(0, 1)).argmax(-1).view(b, f - 2)
    return (pred == actions[:, 1:-1].to(pred.device)).float().mean(1)


def command_lift(probs: Tensor, actions: Tensor) -> Tensor:
    """``[B]`` float32 in [-1, 1]: the agreement of per-transition action probabilities ``probs [B, F - 2, 3]``
    (transitions ``1..F-2``; one-hot predictions give accuracy) with the commands ``actions [B, F]``, minus its
    mean over every reordering of each clip's own commands: ``mean_t q_t(a_t) - mean_t sum_a f(a) q_t(a)`` with
    ``f`` the clip's command histogram over those transitions (a permutation null).

    Chance is 0: a video whose predictions do not change over time (still, parked) scores exactly 0 on every clip,
    one whose motion does not depend on the commands 0 in expectation; a clip whose commands are all one action
    scores 0 whatever the video.

    Raises:
        ValueError: shapes that do not match.
    """
    if probs.ndim != 3 or actions.ndim != 2 or probs.shape[:2] != (actions.shape[0], actions.shape[1] - 2):
        raise ValueError(f"probs must be [B, F - 2, {len(ACTIONS)}] for actions [B, F], got {tuple(probs.shape)} and "
                         f"{tuple(actions.shape)}")
    cmd = nn.functional.one_hot(actions[:, 1:-1].long().to(probs.device), len(ACTIONS)).float()  # [B, T, 3]
    agree = (probs.float() * cmd).sum(-1).mean(1)
    null = (probs.float() * cmd.mean(1, keepdim=True)).sum(-1).mean(1)
    return agree - null


@torch.no_grad()
def inverse_dynamics_lift(model: InverseDynamicsNet, video: Tensor, actions: Tensor) -> Tensor:
    """``[B]`` float32: :func:`inverse_dynamics_accuracy` minus its mean over reorderings of each clip's commands
    (:func:`command_lift` of the one-hot predictions; chance 0)."""
    b, f = video.shape[:2]
    pred = model(triplets(video.float()).flatten(0, 1)).argmax(-1).view(b, f - 2)
    return command_lift(nn.functional.one_hot(pred, len(ACTIONS)).float(), actions)


def save_inverse_dynamics(model: InverseDynamicsNet, path: str | pathlib.Path = IDM_PATH) -> None:
    """Write the judge's weights (safetensors, metadata: its seed and training data)."""
    save_weights(model, path, {"seed": str(IDM_SEED),
                               "data": json.dumps({"clips": "AtariDataConfig()", "split": "train"})})


def load_inverse_dynamics(path: str | pathlib.Path = IDM_PATH) -> InverseDynamicsNet:
    """The shipped judge (eval mode).

    Raises:
        FileNotFoundError: no weights at ``path`` (``python -m flowforge.demo.world`` writes them).
    """
    model = InverseDynamicsNet()
    model(torch.zeros(1, 3, 32, 32))
    return load_weights(model, path, what="inverse-dynamics", module="flowforge.demo.world")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m flowforge.demo.world``: write the prompt sets and train + save the inverse-dynamics judge,
    printing its held-out accuracy (true actions vs another clip's)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--cache-dir", default=".cache/flowforge")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    clips = load_atari_clips(AtariDataConfig(), args.cache_dir)
    for path in write_world_prompt_sets(PROMPTS_DIR, clips=clips):
        print(f"wrote {path}")
    model = train_inverse_dynamics(clips)
    save_inverse_dynamics(model)
    video, actions = clips.clips(clips.split("heldout"))
    true = inverse_dynamics_accuracy(model, video[:, 0], actions).mean()
    other = inverse_dynamics_accuracy(model, video[:, 0], actions.roll(1, 0)).mean()
    print(f"inverse dynamics, held-out clips: true actions {float(true):.3f}, another clip's {float(other):.3f}")


if __name__ == "__main__":
    main()
