"""Real Breakout futures from ale-py for the world pipeline's teacher and student tests: a seeded emulator warmed up
with random moves, then the commanded moves played out (the real future, also the reference) and the same moves with
LEFT and RIGHT swapped (a future with the wrong paddle moves, every frame a real one)."""

from __future__ import annotations

import numpy as np
import torch

NAMES = ("NOOP", "LEFT", "RIGHT")
RUNS = ([1, 1, 1, 1, 2, 2, 2, 2], [2, 2, 2, 0, 0, 1, 1, 1], [0, 2, 2, 2, 2, 1, 1, 0])
SHUFFLE = [0, 5, 2, 7, 1, 4, 3, 6]  # frame 0 (the condition) stays first


def _futures(seed: int, warm: int, sequences: list[list[int]], size: int = 32) -> list[torch.Tensor]:
    """From the state after ``warm`` random steps of a seeded Breakout, each action sequence played out: ``[3, F,
    size, size]`` float32 in [0, 1] per sequence (frame t is the screen before action t)."""
    from flowforge.data.atari import ale_actions, downsample, make_ale, step

    ale = make_ale(seed)
    table, rng = ale_actions(ale), np.random.default_rng(seed)
    for _ in range(warm):
        step(ale, int(rng.integers(0, 3)), 4, table)
    state, out = ale.cloneState(), []
    for actions in sequences:
        ale.restoreState(state)
        frames = []
        for action in actions:
            frames.append(downsample(ale.getScreenGrayscale(), size))
            step(ale, action, 4, table)
        grey = torch.from_numpy(np.stack(frames)).float() / 255.0
        out.append(grey[None].expand(3, -1, -1, -1).contiguous())
    return out


def save_png(frames: torch.Tensor, path) -> str:
    """A ``[3, H, W]`` frame, or a ``[3, F, H, W]`` clip as its frames side by side (the prompt rows' strip
    layout), in [0, 1] -> a greyscale PNG at ``path``; its file name."""
    from PIL import Image

    grey = frames[0].permute(1, 0, 2).flatten(1) if frames.dim() == 4 else frames[0]  # [H, F W] or [H, W]
    Image.fromarray((grey * 255).round().to(torch.uint8).numpy(), mode="L").save(path)
    return path.name


def real_starts(n: int = 6) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``n`` real starts where the game is running: ``(prompt, real future, wrong-moves future)``. A start whose real
    future stands still (between lives the screen freezes) tells no future from another, so it is skipped."""
    out, seed = [], 0
    while len(out) < n:
        actions = RUNS[seed % len(RUNS)]
        wrong = [{0: 0, 1: 2, 2: 1}[a] for a in actions]
        real, bad = _futures(seed, 40 + 5 * seed, [actions, wrong])
        if (real[:, 1:] != real[:, :-1]).flatten(1).any(1).all():  # every frame moved
            out.append((" ".join(NAMES[a] for a in actions), real, bad))
        seed += 1
    return out
