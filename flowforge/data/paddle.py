"""The Breakout paddle in a frame of :mod:`flowforge.data.atari`, and the game rule that reads its motion.

Breakout's joystick drives the paddle's *acceleration*. Measured on the recorded clips at 48 x 48 (one step = 4
emulator frames, 3 screen columns per pixel): held LEFT / RIGHT moves the paddle 7.3-8 pixels per step (2.3-4 on the
step it starts or reverses), released (NOOP) it slows to at most 3.7 and then stops; at the left wall a held LEFT
leaves it still, at the right wall a held LEFT leaves it still for up to two steps (the game's quirk), and a
reversal can show as one step at rest. So the action of transition ``t`` (frame ``t`` to ``t + 1``) is read from
the velocity ``v_t = x_{t+1} - x_t`` and the previous one ``v_{t-1}``, and some motions fit more than one action:

============================  ================  ===============================================================
motion (pixels at 48)          actions it fits   where it is ambiguous
============================  ================  ===============================================================
moving right, not slowing      RIGHT
moving left, not slowing       LEFT
slowing (|v| down >= 1.5)      NOOP              + the action towards the wall it is reaching
stopped after moving right     NOOP, LEFT        + RIGHT at the right wall
stopped after moving left      NOOP, RIGHT       (NOOP, LEFT at the left wall)
at rest                        NOOP              + LEFT at the left wall; + LEFT, RIGHT at the right wall
no paddle in a frame           none
============================  ================  ===============================================================

A transition scores ``1 / |S|`` when the commanded action is in the set ``S`` it fits, else 0
(:func:`paddle_agreement`). Splitting ties this way keeps every video whose motion does not depend on the commands
at or below chance: with command frequencies ``p``, a transition that fits ``S`` scores ``sum_{a in S} p_a / |S|
<= max_a p_a`` in expectation, so a paddle parked at a wall (``S`` = NOOP, LEFT or all three every step), a still
video and a random one score at most the majority command's frequency. (The rule this replaces let a paddle at
either wall agree with LEFT and RIGHT alike and read one pixel row, so a parked paddle or any bright bar scored 1.)
On the recorded clips the true actions score ~0.87 and another clip's actions ~0.36.

The tracker (:func:`paddle_position`) reads the bottom :func:`paddle_band_rows` rows of the frame; a paddle is a run
of bright pixels present in every row of that band and as wide as a paddle can be (:func:`paddle_widths`).
"""

from __future__ import annotations

import torch

CROP_BOTTOM = 193  # screen row below the paddle (its rows are 189..192): every view ends here
CROP_TOP = 33  # default first screen row of the view: the whole playfield below the top wall (160 rows)
CROP_COLS = (8, 152)  # screen columns between the side walls (144)
PADDLE_SCREEN_ROWS = 4  # the paddle's height in screen rows (189..192)
PADDLE_SCREEN_WIDTH = 16  # the paddle's width in screen columns (8 after the ball first reaches the top wall)

STILL = 0.5  # |v| at or below this many pixels (at 48) is at rest
SLOWING = 1.5  # a speed drop of at least this many pixels (at 48) is slowing down (sub-pixel jitter is ~0.7)
WALL = 1.5  # a paddle edge within this many pixels (at 48) of the frame's edge is at that wall


def paddle_band_rows(height: int, crop_top: int = CROP_TOP) -> int:
    """Output rows the paddle fills at the bottom of a ``height``-row frame of the view from ``crop_top``: its four
    screen rows at ``(CROP_BOTTOM - crop_top) / height`` screen rows per output row, at least 1 (2 at 48)."""
    return max(1, int(PADDLE_SCREEN_ROWS * height / (CROP_BOTTOM - crop_top)))


def paddle_width(width: int) -> float:
    """The full paddle's width in pixels of a ``width``-pixel frame (``16 * width / 144``: 5.3 at 48)."""
    return PADDLE_SCREEN_WIDTH * width / (CROP_COLS[1] - CROP_COLS[0])


def paddle_widths(width: int) -> tuple[int, int]:
    """``(lo, hi)`` pixels a paddle may span in a ``width``-pixel frame: 0.5x to 1.6x the full paddle (2 to 6 at 32,
    3 to 9 at 48; the half paddle spans 2-3 and 3); a run outside is not a paddle (the ball, a bar across the
    frame)."""
    full = paddle_width(width)
    return max(1, int(0.5 * full + 0.5)), max(2, round(1.6 * full))


def paddle_position(frames: torch.Tensor, *, crop_top: int = CROP_TOP, threshold: float = 0.25) -> torch.Tensor:
    """Horizontal position of the paddle in ``frames [..., H, W]`` float in [0, 1]: ``[...]`` float32 pixels (column
    index of the centre, 0 = left edge pixel), NaN where no paddle is visible.

    The paddle band (the bottom :func:`paddle_band_rows` rows) is reduced to its darkest value per column (a paddle
    fills every row of the band; a one-row line does not), cut into runs brighter than ``threshold``; the run with
    the most brightness is the candidate and its position its brightness-weighted centroid. A candidate narrower or
    wider than :func:`paddle_widths` allows (the ball, a bar across the frame) counts as absent.
    """
    rows = paddle_band_rows(frames.shape[-2], crop_top)
    band = frames[..., -rows:, :].float().amin(dim=-2)
    lead, width = band.shape[:-1], band.shape[-1]
    band = band.reshape(-1, width)
    on = band > threshold
    starts = on & ~torch.nn.functional.pad(on, (1, 0))[:, :-1]
    run_id = torch.cumsum(starts.long(), dim=1) * on  # 0 = off, 1.. = run number within the row
    mass = torch.zeros(band.shape[0], width + 1).scatter_add_(1, run_id, band * on)
    mass[:, 0] = 0.0
    best = mass.argmax(dim=1, keepdim=True)
    pick = (run_id == best) & on
    weights = band * pick
    total = weights.sum(1)
    span = pick.sum(1)
    lo, hi = paddle_widths(width)
    centre = (weights * torch.arange(width, dtype=torch.float32)).sum(1) / total.clamp_min(1e-12)
    ok = (total > 0) & (span >= lo) & (span <= hi)
    centre = torch.where(ok, centre, torch.full_like(centre, float("nan")))
    return centre.reshape(lead)


def paddle_action_sets(positions: torch.Tensor, size: int = 48) -> torch.Tensor:
    """The actions each transition's paddle motion fits (the module table).

    Args:
        positions: ``[B, F]`` paddle positions in pixels (:func:`paddle_position`; NaN = no paddle), ``F >= 3``.
        size: frame width in pixels (scales the thresholds, given at 48).

    Returns:
        ``[B, F - 2, 3]`` bool over (NOOP, LEFT, RIGHT) for transitions ``t = 1..F-2`` (``v_{-1}`` is not in the
        clip); all False where a frame of the transition has no paddle.

    Raises:
        ValueError: not ``[B, F >= 3]``.
    """
    if positions.ndim != 2 or positions.shape[1] < 3:
        raise ValueError(f"positions must be [B, F >= 3], got {tuple(positions.shape)}")
    s = size / 48.0
    still, slowing = STILL * s, SLOWING * s
    margin = paddle_width(size) / 2 + WALL * s
    x = positions.float()
    v = x[:, 1:] - x[:, :-1]  # [B, F-1]
    vt, vp = v[:, 1:], v[:, :-1]  # transitions 1..F-2 and their predecessors
    x0, x1 = x[:, 1:-1], x[:, 2:]
    wall_l = (x0 <= margin) | (x1 <= margin)
    wall_r = (x0 >= size - 1 - margin) | (x1 >= size - 1 - margin)
    stopped = vt.abs() <= still
    slow_r = (vp > still) & (vt > still) & (vt < vp - slowing)
    slow_l = (vp < -still) & (vt < -still) & (vt > vp + slowing)
    move_r = (vt > still) & ~slow_r
    move_l = (vt < -still) & ~slow_l
    after_r, after_l = stopped & (vp > still), stopped & (vp < -still)
    noop = slow_r | slow_l | stopped
    left = move_l | (slow_l & wall_l) | after_r | (stopped & (wall_l | wall_r))
    right = move_r | (slow_r & wall_r) | (after_l & ~wall_l) | (stopped & wall_r)
    seen = ~torch.isnan(vt) & ~torch.isnan(vp)
    return torch.stack([noop, left, right], dim=-1) & seen[..., None]


def paddle_agreement(positions: torch.Tensor, actions: torch.Tensor, size: int = 48) -> torch.Tensor:
    """Per-transition agreement of paddle motion with the commanded actions: ``1 / |S|`` when the action is in the
    set ``S`` the motion fits (:func:`paddle_action_sets`), else 0 (module docstring).

    Args:
        positions: ``[B, F]`` paddle positions in pixels (NaN = no paddle).
        actions: ``[B, F]`` action ids (NOOP, LEFT, RIGHT), ``actions[:, t]`` taken at frame ``t``.
        size: frame width in pixels.

    Returns:
        ``[B, F - 2]`` float32 in {0, 1/3, 1/2, 1} for transitions ``t = 1..F-2``.

    Raises:
        ValueError: shapes differ or ``F < 3``.
    """
    if positions.shape != actions.shape or positions.ndim != 2 or positions.shape[1] < 3:
        raise ValueError(f"positions and actions must both be [B, F >= 3], got {tuple(positions.shape)} and "
                         f"{tuple(actions.shape)}")
    sets = paddle_action_sets(positions, size)
    hit = sets.gather(-1, actions[:, 1:-1].long().unsqueeze(-1)).squeeze(-1)
    return hit.float() / sets.sum(-1).clamp_min(1).float()
