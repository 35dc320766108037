"""The world-model pipeline's teacher: a group video judge that grades a generated Breakout future against the real one.

A paid multimodal judge asked "which of these futures plays the game right, given the commanded moves and the real
future?" looks at the screen: where the paddle is in each frame, where the ball is, when the ball meets the paddle
or is lost. :class:`WorldMechanicsJudge` does that with hand-made screen reading of its own (it shares no code and
no learned feature with the evaluation judges of :mod:`flowforge.rewards.scorers.world_eval`, with the
inverse-dynamics model of ``action_idm`` or with the paddle rule of ``action_following``), so its marks are a
criterion the policy cannot get for free from a training reward.

Inputs, as ``flowforge serve judge --scorer flowforge.orchestrate.world_judge:WorldMechanicsJudge`` hands them on
(:class:`flowforge.serve.judge_backends.ScorerBackend`): the candidates' ordered frames ``[B, 3, F, H, W]`` in
[0, 1] (frame 0 is the given condition), the prompt -- the ``F`` commanded actions as words (``"NOOP LEFT RIGHT
..."``, the ``demo:world`` prompt text; the action of step ``t`` moves frame ``t`` to ``t + 1``) -- and
``metadata["reference_media"]``: the real future, either ``[3, F, H, W]`` (a directory of frames) or one image
``[3, H, F W]`` (the prompt rows' ``real_clip`` strip, frames side by side).

Screen reading, per grey frame (``s = W / 32`` scales every pixel tolerance):

=================  ===============================================================================================
paddle ``x_t``     intensity-weighted column of the brightest bottom rows (``max(1, H // 16)`` rows, above a
                   threshold ``0.3``): NaN when nothing is that bright there
ball ``b_t``       the playfield between the wall of bricks (the last row of the condition frame whose mean is
                   above 0.3) and the paddle rows: the centre of the brightest 3 x 3 window of what exceeds 0.06;
                   absent when that window holds less than 0.08
contact            the ball in the three playfield rows above the paddle turns from falling to rising at frame t
miss               the ball in those rows at frame t and absent in every later frame
=================  ===============================================================================================

Marks (each in [0, 1]; the candidate's score is their weighted mean, :data:`WEIGHTS`):

``command``     the commanded moves executed: per transition, ``0.5 exp(-|v_t - r_t| / 1.5 s)`` plus ``0.5`` when the
                candidate's paddle velocity ``v_t`` has the sign of the real future's ``r_t`` (dead zone ``0.5 s``;
                the real response to the same commands: at a wall a held move leaves the paddle still); a frame
                without a paddle scores 0
``paddle``      ``exp(-|x_t - x^ref_t| / 2 s)`` over frames ``1..F-1``
``ball_path``   per frame ``1..F-1``: ``exp(-|b_t - b^ref_t| / 3 s)`` when both show a ball, 1 when neither does, 0 when
                one does
``plausible``   the candidate's own ball path: per three consecutive sightings, each coordinate keeps its velocity
                (acceleration <= 1.5 s) or reflects (the sign flips, the speed kept within 1.5 s); a ball that
                vanishes and comes back counts a failure; no sighting at all scores 1 only when the real future
                has none either
``events``      the first contact / miss and its frame against the real future's: ``exp(-|dt|)`` for the same kind,
                1 when neither has one, 0 otherwise

Deliberately expensive, as a teacher worth replacing by a student: every mark is the mean over ``passes`` readings
of the frames under a fixed random perturbation (brightness gain 0.9-1.1, pixel noise of std 0.02, every threshold
scaled by 0.8-1.2; pass ``p`` draws from ``seed`` and ``p`` and applies the same draw to every candidate and the
reference, so a candidate's mark depends on it, its prompt and the reference only -- never on its group), and each
call sleeps ``latency_s`` first (a hosted judge's round trip).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from flowforge.media import reference_video

__all__ = ["WEIGHTS", "WorldMechanicsJudge", "commands_from_prompt", "read_screen"]

MOVES = {"NOOP": 0, "LEFT": -1, "RIGHT": 1}
"""The commanded action words and the paddle direction each asks for."""

WEIGHTS = {"command": 0.3, "paddle": 0.2, "ball_path": 0.2, "plausible": 0.15, "events": 0.15}
"""How the marks enter the score (they sum to 1)."""

PADDLE_LEVEL, BALL_LEVEL, BALL_MASS, WALL_LEVEL = 0.3, 0.06, 0.08, 0.3


def commands_from_prompt(prompt: str, frames: int) -> list[int]:
    """The prompt's action words -> ``frames`` directions in {-1, 0, 1} (LEFT, NOOP, RIGHT).

    Raises:
        ValueError: a word outside NOOP / LEFT / RIGHT, or not one word per frame.
    """
    words = prompt.upper().split()
    bad = sorted({w for w in words if w not in MOVES})
    if bad:
        raise ValueError(f"prompt {prompt!r}: {bad} are not actions; allowed: {sorted(MOVES)}")
    if len(words) != frames:
        raise ValueError(f"prompt {prompt!r} names {len(words)} actions for a video of {frames} frames")
    return [MOVES[w] for w in words]


def _grey(video: Tensor) -> Tensor:
    """``[3, F, H, W]`` (or the ``[3, H, F W]`` strip with ``frames``) -> ``[F, H, W]`` float32."""
    return video.float().mean(0)


def read_screen(grey: Tensor, wall_row: int, level: float = 1.0) -> tuple[Tensor, Tensor]:
    """Grey frames ``[F, H, W]`` -> ``(paddle x [F], ball [F, 2] as (x, y))`` float64, NaN where not seen.

    ``wall_row``: the last row of the bricks (the ball is looked for below it). ``level`` scales every threshold.
    """
    n, h, w = grey.shape
    band = max(1, h // 16)
    bottom = grey[:, h - band:].amax(1)  # [F, W]
    weight = (bottom - PADDLE_LEVEL * level).clamp(min=0).double()
    cols = torch.arange(w, dtype=torch.float64)
    mass = weight.sum(1)
    paddle = torch.where(mass > 0, (weight * cols).sum(1) / mass.clamp(min=1e-12), torch.nan)
    field = grey[:, wall_row + 1:h - band]  # [F, R, W]
    ball = torch.full((n, 2), torch.nan, dtype=torch.float64)
    if field.shape[1] >= 3:
        residual = (field - BALL_LEVEL * level).clamp(min=0)
        window = F.avg_pool2d(residual[:, None], 3, stride=1)[:, 0] * 9.0  # [F, R - 2, W - 2] 3 x 3 sums
        best, where = window.flatten(1).max(1)
        rows, cols_ = where // window.shape[-1], where % window.shape[-1]
        seen = best > BALL_MASS * level
        ball[seen, 0] = cols_[seen].double() + 1.0
        ball[seen, 1] = rows[seen].double() + 1.0 + wall_row + 1
    return paddle, ball


def _wall_row(condition: Tensor) -> int:
    """The last row of grey ``[H, W]`` whose mean exceeds :data:`WALL_LEVEL` in its upper half (-1: none)."""
    means = condition[: condition.shape[0] // 2].mean(1)
    rows = torch.nonzero(means > WALL_LEVEL).flatten()
    return int(rows[-1]) if len(rows) else -1


def _first_event(ball: Tensor, low_row: float) -> tuple[str, int] | None:
    """The first contact or miss (module docstring) as ``(kind, frame)``, or None."""
    n = len(ball)
    seen = ~torch.isnan(ball[:, 0])
    for t in range(n):
        if not seen[t] or ball[t, 1] < low_row:
            continue
        if 0 < t < n - 1 and seen[t - 1] and seen[t + 1]:
            if ball[t, 1] - ball[t - 1, 1] > 0 and ball[t + 1, 1] - ball[t, 1] < 0:
                return "contact", t
        if t < n - 1 and not seen[t + 1:].any():
            return "miss", t
    return None


def _plausible(ball: Tensor, tol: float) -> float | None:
    """Fraction of the ball path's checks that pass (module docstring); None when there is nothing to check."""
    seen = ~torch.isnan(ball[:, 0])
    checks: list[bool] = []
    idx = torch.nonzero(seen).flatten().tolist()
    for a, b in zip(idx, idx[1:]):
        if b - a > 1:
            checks.append(False)  # vanished and came back
    for t in range(1, len(ball) - 1):
        if not (seen[t - 1] and seen[t] and seen[t + 1]):
            continue
        v0, v1 = ball[t] - ball[t - 1], ball[t + 1] - ball[t]
        ok = True
        for c in range(2):
            keeps = abs(float(v1[c] - v0[c])) <= tol
            reflects = float(v0[c]) * float(v1[c]) < 0 and abs(abs(float(v1[c])) - abs(float(v0[c]))) <= tol
            ok = ok and (keeps or reflects)
        checks.append(ok)
    return sum(checks) / len(checks) if checks else None


def _marks(cand: tuple[Tensor, Tensor], ref: tuple[Tensor, Tensor], moves: list[int], scale: float,
           low_row: float) -> dict[str, float]:
    """The module docstring's marks of one candidate reading against the reference's."""
    px, pb = cand
    rx, rb = ref
    n = len(px)
    dead = 0.5 * scale
    command = []
    for t in range(n - 1):
        v, r = float(px[t + 1] - px[t]), float(rx[t + 1] - rx[t])
        if math.isnan(v):
            command.append(0.0)
            continue
        if math.isnan(r):  # the real future lost its paddle: judge by the command's direction alone
            want = moves[t]
            got = 0 if abs(v) <= dead else (1 if v > 0 else -1)
            command.append(float(got == want))
            continue
        sign_v = 0 if abs(v) <= dead else (1 if v > 0 else -1)
        sign_r = 0 if abs(r) <= dead else (1 if r > 0 else -1)
        command.append(0.5 * math.exp(-abs(v - r) / (1.5 * scale)) + 0.5 * float(sign_v == sign_r))
    paddle, ball_path = [], []
    for t in range(1, n):
        if not math.isnan(float(rx[t])):
            paddle.append(0.0 if math.isnan(float(px[t])) else math.exp(-abs(float(px[t] - rx[t])) / (2 * scale)))
        c_seen, r_seen = not math.isnan(float(pb[t, 0])), not math.isnan(float(rb[t, 0]))
        if c_seen and r_seen:
            ball_path.append(math.exp(-float((pb[t] - rb[t]).norm()) / (3 * scale)))
        else:
            ball_path.append(float(c_seen == r_seen))
    plausible = _plausible(pb, 1.5 * scale)
    if plausible is None:
        plausible = float(_plausible(rb, 1.5 * scale) is None)
    ev_c, ev_r = _first_event(pb, low_row), _first_event(rb, low_row)
    if ev_c is None or ev_r is None:
        events = float(ev_c is None and ev_r is None)
    else:
        events = math.exp(-abs(ev_c[1] - ev_r[1])) if ev_c[0] == ev_r[0] else 0.0
    return {"command": sum(command) / len(command), "paddle": sum(paddle) / len(paddle) if paddle else 1.0,
            "ball_path": sum(ball_path) / len(ball_path), "plausible": plausible, "events": events}


class WorldMechanicsJudge:
    """Ordered frames ``[B, 3, F, H, W]`` in [0, 1] + the commanded actions (prompt) + the real future
    (``metadata["reference_media"]``) -> ``[B]`` float32 in [0, 1]: how well each candidate plays Breakout's
    mechanics as the real future does (module docstring).

    Args:
        passes: perturbed readings per candidate (>= 1). latency_s: seconds slept per call (>= 0).
        seed: the perturbations' draw.

    Raises (``__call__``):
        ValueError: not a ``[B, 3, F >= 3, H, W]`` video; a prompt that is not one action word per frame; a
            missing or mis-shaped ``reference_media``.
    """

    name = "world_mechanics"
    needs_group: ClassVar[bool] = False
    takes_video: ClassVar[bool] = True
    metadata_keys: ClassVar[tuple[str, ...]] = ("reference_media",)

    def __init__(self, passes: int = 16, latency_s: float = 0.0, seed: int = 0) -> None:
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"passes must be an int >= 1, got {passes!r}")
        if not (isinstance(latency_s, (int, float)) and math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"latency_s must be a number >= 0, got {latency_s!r}")
        self.passes, self.latency_s, self.seed = passes, float(latency_s), int(seed)

    def marks(self, video: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> list[dict]:
        """Per candidate, each mark of the module docstring averaged over the passes (same arguments and errors
        as ``__call__``)."""
        if not isinstance(video, Tensor) or video.dim() != 5 or video.shape[1] != 3 or video.shape[2] < 3:
            raise ValueError(f"media must be a float [B, 3, F >= 3, H, W] video in [0, 1], got "
                             f"{tuple(video.shape) if isinstance(video, Tensor) else type(video).__name__}")
        b, _, n, h, w = video.shape
        if len(prompts) != b or len(metadata) != b:
            raise ValueError(f"need one prompt and one metadata entry per video ({b})")
        scale = w / 32.0
        out = []
        for i in range(b):
            reference = metadata[i].get("reference_media")
            if not isinstance(reference, Tensor):
                raise ValueError("metadata.reference_media (the real future) is required: send the group with a "
                                 "reference (prompt metadata 'reference')")
            moves = commands_from_prompt(prompts[i], n)
            cand = _grey(video[i].detach().cpu())
            ref = _grey(reference_video(reference.detach().cpu(), n, (h, w)))
            wall = _wall_row(ref[0])
            low_row = h - max(1, h // 16) - 3
            sums = dict.fromkeys(WEIGHTS, 0.0)
            for p in range(self.passes):
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + p)
                gain = 0.9 + 0.2 * float(torch.rand((), generator=gen))
                level = 0.8 + 0.4 * float(torch.rand((), generator=gen))
                noise = 0.02 * torch.randn((n, h, w), generator=gen)
                marks = _marks(read_screen((cand * gain + noise).clamp(0, 1), wall, level),
                               read_screen((ref * gain + noise).clamp(0, 1), wall, level), moves, scale, low_row)
                for k, v in marks.items():
                    sums[k] += v / self.passes
            out.append(sums)
        return out

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        if self.latency_s:
            time.sleep(self.latency_s)  # a hosted judge's round trip: what the student saves besides compute
        marks = self.marks(media, prompts, metadata)
        scores = [sum(WEIGHTS[k] * m[k] for k in WEIGHTS) for m in marks]
        return torch.tensor(scores, dtype=torch.float32, device=media.device)
