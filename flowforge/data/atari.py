"""Real Atari 2600 game clips for the world-model demo.

The emulator and the Breakout ROM ship inside the ``ale-py`` wheel (the Arcade Learning Environment, Bellemare et
al., JAIR 2013), so the clips are real game frames made offline. One recorded *step* is the grey screen seen before
an action, then that action held for ``frame_skip`` emulator frames (ALE's standard frame skip of 4). Clips are
``F`` consecutive steps of one episode; the split is by episode, so no held-out clip shares an episode with a train
clip.

Frames
------
The playfield between the side walls (screen rows ``crop_top``..192, columns 8..151 of the 210x160 grey screen;
by default rows 33..192, the whole playfield below the top wall) is area-averaged to ``size x size`` pixels (exact
box weights: at the default 32, rows x5 and columns x4.5) and brightened by :data:`GAIN` (the game's brightest grey
is 148 / 255, so x2 spreads it over [0, 1]), stored as uint8. The crop ends below the paddle's four screen rows
(189..192), so the paddle lies in the last output rows: at the default 32 x 32 it is one faint row of 3-4 pixels
(what ``demo:world`` is trained on). ``crop_top=97, size=48`` is the lower 96 rows at 2 screen rows x 3 columns per
pixel: the paddle is a bright 2 x 5-6 pixel block that moves up to 8 pixels per step, the ball a dimmer 1 x 2
block, the bricks (screen rows 57..92) above the view.

Actions
-------
The reduced action set :data:`ACTIONS` = NOOP, LEFT, RIGHT (ids 0, 1, 2). A NOOP step presses FIRE, which only
launches a new ball and never moves the paddle, so a ball lost by the policy is relaunched. Per episode the policy is
uniform random (fraction ``random_policy_fraction``) or scripted runs: hold one action for 1-5 steps (NOOP 0.2,
LEFT 0.4, RIGHT 0.4), turning away from a wall once the paddle is in the outer quarter.

The paddle tracker and the game rule that reads it live in :mod:`flowforge.data.paddle`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from flowforge.data.paddle import CROP_BOTTOM, CROP_COLS, CROP_TOP, PADDLE_SCREEN_ROWS, paddle_position
from flowforge.models.world_model.config import ACTIONS  # the reduced action set the world model is conditioned on

GAME = "breakout"
GAIN = 2.0

_ALE_ACTION = {0: "FIRE", 1: "LEFT", 2: "RIGHT"}  # NOOP steps press FIRE: it launches a ball and never moves the paddle
_RUN_PROBS = (0.2, 0.4, 0.4)  # scripted runs: NOOP, LEFT, RIGHT
_CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class AtariDataConfig:
    """How the clips are recorded. Every field enters the cache key; the same config gives the same bytes."""

    game: str = GAME
    episodes: int = 64  # episodes recorded
    heldout_every: int = 8  # episode e is held out when e % heldout_every == heldout_every - 1
    max_steps: int = 256  # recorded steps per episode at most (fewer at game over)
    frames: int = 8  # F: steps per clip
    stride: int = 4  # steps between the starts of consecutive clips of one episode
    size: int = 32  # output frames are size x size
    crop_top: int = CROP_TOP  # first screen row of the view (the view ends below the paddle, screen row 192)
    frame_skip: int = 4  # emulator frames per step (the action is held for all of them)
    random_policy_fraction: float = 0.25  # episodes played uniformly at random; the rest play scripted runs
    seed: int = 0

    def __post_init__(self) -> None:
        if self.game != GAME:
            raise ValueError(f"game={self.game!r}: the paddle rule is Breakout's; allowed: [{GAME!r}]")
        if self.episodes < 2 or self.heldout_every < 2 or self.episodes < self.heldout_every:
            raise ValueError(f"need episodes >= heldout_every >= 2, got {self.episodes}, {self.heldout_every}")
        if self.frames < 3 or self.stride < 1 or self.max_steps < self.frames or self.frame_skip < 1:
            raise ValueError("need frames >= 3, stride >= 1, max_steps >= frames, frame_skip >= 1")
        if self.size < 8 or not 0.0 <= self.random_policy_fraction <= 1.0:
            raise ValueError(f"need size >= 8 and random_policy_fraction in [0, 1], got {self.size}, "
                             f"{self.random_policy_fraction}")
        if not 33 <= self.crop_top <= CROP_BOTTOM - PADDLE_SCREEN_ROWS:
            raise ValueError(f"crop_top={self.crop_top} must be in [33, {CROP_BOTTOM - PADDLE_SCREEN_ROWS}] (screen "
                             "rows of the playfield above the paddle)")

    def is_heldout(self, episode: int) -> bool:
        """Whether episode ``episode`` is in the held-out split (``episode % heldout_every == heldout_every - 1``)."""
        return episode % self.heldout_every == self.heldout_every - 1


@dataclasses.dataclass(frozen=True)
class AtariClips:
    """Recorded episodes and the clips cut from them (episodes concatenated along the step axis ``N``)."""

    frames: torch.Tensor  # [N, size, size] uint8 grey frame seen at each step
    actions: torch.Tensor  # [N] int64 action id taken at each step (index into ACTIONS)
    episode: torch.Tensor  # [N] int64 episode of each step
    clip_starts: torch.Tensor  # [C] int64 step index of each clip's first frame
    heldout: torch.Tensor  # [C] bool: the clip's episode is held out
    config: AtariDataConfig

    def split(self, name: str) -> torch.Tensor:
        """Indices ``[n]`` int64 of the clips of split ``"train"`` or ``"heldout"``.

        Raises:
            ValueError: another name.
        """
        if name not in ("train", "heldout"):
            raise ValueError(f"split {name!r}; allowed: ['train', 'heldout']")
        return torch.nonzero(self.heldout if name == "heldout" else ~self.heldout).flatten()

    def clips(self, indices: torch.Tensor | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Clips ``indices``: video ``[n, 1, F, size, size]`` float32 in [0, 1] and actions ``[n, F]`` int64."""
        starts = self.clip_starts[torch.as_tensor(indices, dtype=torch.long)]
        steps = starts[:, None] + torch.arange(self.config.frames)
        video = self.frames[steps].float().div(255.0).unsqueeze(1)
        return video, self.actions[steps]


def action_ids(names: list[str] | tuple[str, ...]) -> list[int]:
    """Action names (case-insensitive, :data:`ACTIONS`) -> ids.

    Raises:
        ValueError: an unknown name (the allowed ones are listed).
    """
    out = []
    for name in names:
        key = str(name).upper()
        if key not in ACTIONS:
            raise ValueError(f"unknown action {name!r}; allowed: {list(ACTIONS)}")
        out.append(ACTIONS.index(key))
    return out


def _box_weights(size_in: int, size_out: int) -> np.ndarray:
    """``[size_out, size_in]`` area-averaging weights: output cell ``i`` covers input ``[i, i + 1) * size_in /
    size_out`` and each input pixel contributes the length of its overlap."""
    edges = np.arange(size_out + 1) * (size_in / size_out)
    lo, hi = edges[:-1, None], edges[1:, None]
    pix = np.arange(size_in)[None, :]
    overlap = np.clip(np.minimum(hi, pix + 1) - np.maximum(lo, pix), 0.0, None)
    return overlap / overlap.sum(1, keepdims=True)


def downsample(screen: np.ndarray, size: int = 48, crop_top: int = CROP_TOP) -> np.ndarray:
    """ALE grey screen ``[210, 160]`` uint8 -> frame ``[size, size]`` uint8 (crop rows ``crop_top``..192, box average,
    :data:`GAIN`; see the module docstring)."""
    crop = screen[crop_top:CROP_BOTTOM, CROP_COLS[0]:CROP_COLS[1]].astype(np.float64)
    rows = _box_weights(crop.shape[0], size)
    cols = _box_weights(crop.shape[1], size)
    out = rows @ crop @ cols.T * GAIN
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def make_ale(seed: int):
    """A Breakout ``ALEInterface`` (ROM from the ale-py wheel), deterministic: ``repeat_action_probability = 0``."""
    from ale_py import ALEInterface, LoggerMode, roms

    ALEInterface.setLoggerMode(LoggerMode.Error)
    ale = ALEInterface()
    ale.setInt("random_seed", int(seed))
    ale.setFloat("repeat_action_probability", 0.0)
    ale.loadROM(roms.get_rom_path(GAME))
    return ale


def ale_actions(ale) -> dict[int, object]:
    """Our action ids -> the emulator's action values (FIRE stands for NOOP, see the module docstring)."""
    from ale_py import Action

    return {i: getattr(Action, name) for i, name in _ALE_ACTION.items()}


def step(ale, action: int, frame_skip: int, table: dict[int, object]) -> None:
    """Hold action id ``action`` for ``frame_skip`` emulator frames."""
    for _ in range(frame_skip):
        ale.act(table[action])


def _policy_action(rng: np.random.Generator, random_policy: bool, run: list[int], x: float, size: int) -> int:
    """Next action of the episode's policy; ``run = [action, steps left]`` is the scripted run's state."""
    if random_policy:
        return int(rng.integers(0, len(ACTIONS)))
    if run[1] <= 0:
        action = int(rng.choice(len(ACTIONS), p=_RUN_PROBS))
        if action == 1 and x < size / 4:  # turn away from the left wall
            action = 2
        elif action == 2 and x > size - 1 - size / 4:
            action = 1
        run[0], run[1] = action, int(rng.integers(1, 6))
    run[1] -= 1
    return run[0]


def ball_position(ram: np.ndarray, size: int, crop_top: int = CROP_TOP) -> tuple[float, float]:
    """The ball's centre ``(x, y)`` in the pixel coordinates of a ``size x size`` frame (:func:`downsample`; the
    centre of pixel ``(i, j)`` is ``(j + 0.5, i + 0.5)``), read from the emulator's RAM, not from the screen; NaNs
    when no ball is in play or it is outside the view.

    Breakout keeps the ball's horizontal position in RAM byte 99 and its vertical one in byte 101, 0 while no ball is
    in play (the AtariARI annotation, Anand et al., NeurIPS 2019). Measured here against the screen (the ball's 2 x 4
    pixels below the bricks, 432 frames of 4 episodes): its centre is at screen column ``ram[99] - 48`` and row
    ``ram[101] + 11`` (431 and 428 of 432 exactly; the rest within half a pixel)."""
    if int(ram[101]) == 0:
        return float("nan"), float("nan")
    col, row = float(ram[99]) - 48.0, float(ram[101]) + 11.0
    x = (col - CROP_COLS[0]) * size / (CROP_COLS[1] - CROP_COLS[0])
    y = (row - crop_top) * size / (CROP_BOTTOM - crop_top)
    if not (0.0 <= x < size and 0.0 <= y < size):
        return float("nan"), float("nan")
    return x, y


def record_episode(config: AtariDataConfig, episode: int,
                   ball: bool = False) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Play episode ``episode`` of ``config``: frames ``[n, size, size]`` uint8 and actions ``[n]`` int64, ``n <=
    max_steps``; with ``ball``, also the ball's centre in each frame, ``[n, 2]`` float64 ``(x, y)`` from the RAM
    (:func:`ball_position`, NaN when not in view; the frames and actions are the same either way). Deterministic in
    (config, episode): the emulator is seeded with ``seed * 100003 + episode`` and the policy's generator with
    ``[seed, episode]``; 0-29 NOOP steps first (ALE's no-op starts) vary the start."""
    ale = make_ale(config.seed * 100003 + episode)
    table = ale_actions(ale)
    rng = np.random.default_rng([config.seed, episode])
    random_policy = bool(rng.random() < config.random_policy_fraction)
    for _ in range(int(rng.integers(0, 30))):
        step(ale, 0, config.frame_skip, table)
    frames, actions, balls, run = [], [], [], [0, 0]
    while len(frames) < config.max_steps and not ale.game_over():
        frame = downsample(ale.getScreenGrayscale(), config.size, config.crop_top)
        if ball:
            balls.append(ball_position(ale.getRAM(), config.size, config.crop_top))
        x = float(paddle_position(torch.from_numpy(frame).float().div(255.0), crop_top=config.crop_top))
        action = _policy_action(rng, random_policy, run, config.size / 2 if np.isnan(x) else x, config.size)
        frames.append(frame)
        actions.append(action)
        step(ale, action, config.frame_skip, table)
    if ball:
        return np.stack(frames), np.asarray(actions, dtype=np.int64), np.asarray(balls, dtype=np.float64)
    return np.stack(frames), np.asarray(actions, dtype=np.int64)


def record_clips(config: AtariDataConfig) -> AtariClips:
    """Record every episode of ``config`` and cut clips of ``frames`` steps every ``stride`` steps (episodes shorter
    than one clip give none)."""
    frames, actions, episode, starts, heldout = [], [], [], [], []
    offset = 0
    for e in range(config.episodes):
        f, a = record_episode(config, e)
        frames.append(f)
        actions.append(a)
        episode.append(np.full(len(a), e, dtype=np.int64))
        for s in range(0, len(a) - config.frames + 1, config.stride):
            starts.append(offset + s)
            heldout.append(config.is_heldout(e))
        offset += len(a)
    return AtariClips(frames=torch.from_numpy(np.concatenate(frames)),
                      actions=torch.from_numpy(np.concatenate(actions)),
                      episode=torch.from_numpy(np.concatenate(episode)),
                      clip_starts=torch.as_tensor(starts, dtype=torch.long),
                      heldout=torch.as_tensor(heldout, dtype=torch.bool), config=config)


def rom_md5() -> str:
    """md5 of the Breakout ROM inside the installed ale-py (recorded in the cache)."""
    from ale_py import roms

    return hashlib.md5(Path(roms.get_rom_path(GAME)).read_bytes()).hexdigest()


def cache_path(config: AtariDataConfig, cache_dir: str | Path) -> Path:
    """``<cache_dir>/atari/<game>-<sha256(config, cache version)[:16]>.safetensors``."""
    key = json.dumps({"config": dataclasses.asdict(config), "version": _CACHE_VERSION}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir) / "atari" / f"{config.game}-{digest}.safetensors"


def prepare_atari_clips(config: AtariDataConfig, cache_dir: str | Path) -> Path:
    """Record the clips of ``config`` once and cache them (safetensors: ``frames``, ``actions``, ``episode``,
    ``clip_starts``, ``heldout``; metadata ``flowforge``: JSON of the config, the ROM md5, the ale-py version and the
    action names). An existing file is
    reused; a new one is written to a temporary name and renamed into place. Returns its path."""
    import ale_py
    from safetensors.torch import save_file

    path = cache_path(config, cache_dir)
    if path.is_file():
        return path
    clips = record_clips(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"frames": clips.frames, "actions": clips.actions, "episode": clips.episode,
               "clip_starts": clips.clip_starts, "heldout": clips.heldout.to(torch.uint8)}
    # One metadata key: safetensors writes a metadata map in arbitrary order, a single entry keeps the bytes fixed.
    meta = {"flowforge": json.dumps({"config": dataclasses.asdict(config), "rom_md5": rom_md5(),
                                     "ale_py": ale_py.__version__, "actions": list(ACTIONS)}, sort_keys=True)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_atari_clips(config: AtariDataConfig | None = None, cache_dir: str | Path = ".cache/flowforge") -> AtariClips:
    """The clips of ``config`` (default :class:`AtariDataConfig`), recorded on the first call and read from the cache
    (:func:`prepare_atari_clips`) afterwards.

    Raises:
        ValueError: the cached file was written for another config.
    """
    from safetensors import safe_open

    config = AtariDataConfig() if config is None else config
    path = prepare_atari_clips(config, cache_dir)
    with safe_open(str(path), framework="pt") as f:
        stored = json.loads(f.metadata()["flowforge"])["config"]
        if stored != dataclasses.asdict(config):
            raise ValueError(f"{path}: cached for config {stored}, asked for {dataclasses.asdict(config)}")
        t = {k: f.get_tensor(k) for k in f.keys()}
    return AtariClips(frames=t["frames"], actions=t["actions"], episode=t["episode"], clip_starts=t["clip_starts"],
                      heldout=t["heldout"].bool(), config=config)


def write_prompt_file(clips: AtariClips, indices: torch.Tensor | list[int], directory: str | Path,
                      name: str) -> Path:
    """Write clips ``indices`` as i2v prompts: ``<directory>/<name>.jsonl`` (one row per clip: ``prompt`` = the
    action names joined by spaces, ``metadata`` = task ``i2v``, ``sample_id``, ``image`` = the first frame's PNG,
    ``actions`` = the names, ``clip`` = the clip index, ``episode`` = its episode (split by it: a clip's neighbours
    share it), ``cluster`` = ``"episode:<episode>"`` (a condition's cluster, :mod:`flowforge.data.clusters`: a
    pipeline student's train / held-out split keeps each episode whole), ``real_clip`` = the file name, in the
    image's directory, of
    the real clip's frames side by side), ``<directory>/<name>/<clip>.png`` (RGB, ``size x size``) and
    ``<directory>/<name>/<clip>-clip.png`` (grey, ``size x F size``). Returns the JSONL path."""
    from PIL import Image

    root = Path(directory)
    (root / name).mkdir(parents=True, exist_ok=True)
    video, acts = clips.clips(indices)
    lines = []
    for i, clip in enumerate(torch.as_tensor(indices).tolist()):
        png = root / name / f"{clip:06d}.png"
        frames = (video[i, 0] * 255.0).round().to(torch.uint8)  # [F, size, size]
        Image.fromarray(frames[0].numpy(), mode="L").convert("RGB").save(png)
        strip = root / name / f"{clip:06d}-clip.png"  # the real clip, frames side by side: the real future
        Image.fromarray(frames.permute(1, 0, 2).flatten(1).numpy(), mode="L").save(strip)
        names = [ACTIONS[a] for a in acts[i].tolist()]
        episode = int(clips.episode[clips.clip_starts[clip]])
        meta = {"task": "i2v", "sample_id": f"atari-{name}-{clip:06d}", "image": f"{name}/{png.name}",
                "actions": names, "clip": clip, "episode": episode, "cluster": f"episode:{episode}",
                "real_clip": strip.name}
        lines.append(json.dumps({"prompt": " ".join(names), "metadata": meta}))
    path = root / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
