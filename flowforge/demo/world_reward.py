"""The world-model demo's training reward: an inverse-dynamics model of the paddle band, scored against a
within-clip shuffle of the commands, so that a video that ignores its commands earns nothing.

=======================================  ===========================================================================
name / file                              what
=======================================  ===========================================================================
``weights/world_reward_idm.safetensors``  :class:`BandInverseDynamicsNet` (73 k parameters, 293 KB), written by
                                         ``python -m flowforge.demo.world_reward`` (:func:`train_band_idm` on the
                                         recording :data:`REWARD_DATA`, one thread, seed :data:`REWARD_SEED`)
scorer ``action_idm``                    :func:`idm_reward` of a generated clip, the training reward
                                         (:class:`flowforge.rewards.scorers.action_following.InverseDynamicsReward`)
=======================================  ===========================================================================

**Model.** :class:`BandInverseDynamicsNet` reads only the bottom :data:`BAND_ROWS` rows of three consecutive frames
``(t - 1, t, t + 1)`` (where the paddle and the ball near it are) as ``3 x BAND_ROWS`` channels of a 1-D
convolution along the columns, then a linear head over every column (position matters: at a wall a held action
leaves the paddle still), and predicts the action held at frame ``t`` (NOOP / LEFT / RIGHT). Its receptive field
in time is exactly ``t - 1 .. t + 1``: a wider one would learn the recording policy's habit of holding an action
for several steps rather than the game.

**Independent of the eval judge** (:class:`flowforge.demo.world.InverseDynamicsNet`, ``inverse_dynamics``): another
architecture (band-only 1-D convolution vs a strided 2-D CNN over whole frames), another seed (:data:`REWARD_SEED`
= 2 vs 1), another recording (:data:`REWARD_DATA`: ``AtariDataConfig(seed=1)``, all 64 episodes, whose emulator and
policy seeds differ from the demo recording's; the judge trains on the demo recording's train episodes and both
are measured on its held-out episodes, the ``demo:world-eval`` prompts), and brightness augmentation (each training
triplet scaled by a gain drawn from :data:`GAIN_RANGE` and given Gaussian noise of std :data:`NOISE_STD`: the
world base this reward was built against drew its paddle fainter than the game; the judge sees clean frames only).

**Score** (:func:`idm_reward`). With ``q_t`` the model's probabilities for transition ``t = 1..F-2`` and ``f`` the
clip's own histogram of commands over those transitions, a clip scores

    ``mean_t q_t(a_t) - mean_t sum_a f(a) q_t(a)``

the agreement with the commands minus its mean over every reordering of the clip's commands (a permutation
null). So a video whose predicted actions do not change over time (a still video, a paddle parked anywhere)
scores exactly 0 on every clip, and any video whose motion does not depend on the commands (noise included) scores
0 in expectation; a clip whose commands are all one action scores 0 whatever the video (nothing to tell apart;
~9 % of the demo's clips). The score lies in ``[-1, 1]``; on real held-out clips the true actions score ~0.6.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flowforge.data.atari import ACTIONS, AtariClips, AtariDataConfig, load_atari_clips
from flowforge.demo.nets import load_weights, require_weights, save_weights, seeded, train_classifier
from flowforge.demo.world import command_lift

REWARD_IDM_PATH = pathlib.Path(__file__).resolve().parent / "weights" / "world_reward_idm.safetensors"
REWARD_SEED = 2
REWARD_DATA = AtariDataConfig(seed=1)
"""The reward model's recording: the demo's settings with seed 1 (other episodes, other emulator and policy seeds)."""
BAND_ROWS = 4  # the bottom rows read: at 32 x 32 the paddle's row plus three above it (the ball near the paddle)
GAIN_RANGE = (0.3, 1.0)  # brightness gain of a training triplet (the world base it was built for drew a faint paddle)
NOISE_STD = 0.03  # Gaussian pixel noise added to a training triplet


class BandInverseDynamicsNet(nn.Module):
    """Paddle bands ``[N, 3, BAND_ROWS, W]`` (grey frames ``t - 1, t, t + 1``, in [0, 1]) -> action logits ``[N, 3]``.

    ``width`` is the frame width ``W`` (32 for the demo)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.width = width
        self.features = nn.Sequential(
            nn.Conv1d(3 * BAND_ROWS, 32, 5, padding=2), nn.ReLU(), nn.Conv1d(32, 32, 5, padding=2), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * width, 64), nn.ReLU(), nn.Linear(64, len(ACTIONS)))

    def forward(self, bands: Tensor) -> Tensor:
        return self.head(self.features(bands.flatten(1, 2)))


def band_triplets(video: Tensor) -> Tensor:
    """Grey video ``[B, F, H, W]`` -> ``[B, F - 2, 3, BAND_ROWS, W]``: the bottom rows of frames ``(t - 1, t, t + 1)``
    for ``t = 1..F-2``.

    Raises:
        ValueError: not ``[B, F >= 3, H >= BAND_ROWS, W]``.
    """
    if video.ndim != 4 or video.shape[1] < 3 or video.shape[2] < BAND_ROWS:
        raise ValueError(f"video must be grey [B, F >= 3, H >= {BAND_ROWS}, W], got {tuple(video.shape)}")
    band = video[:, :, -BAND_ROWS:, :]
    return torch.stack([band[:, :-2], band[:, 1:-1], band[:, 2:]], dim=2)


def train_band_idm(clips: AtariClips, *, steps: int = 2000, batch_size: int = 128, lr: float = 2e-3,
                   seed: int = REWARD_SEED) -> BandInverseDynamicsNet:
    """Train :class:`BandInverseDynamicsNet` on every clip of ``clips`` (transitions ``1..F-2`` with their recorded
    actions; the whole recording: it is not the demo's), AdamW, ``steps`` steps of ``batch_size`` triplets drawn
    with ``seed``, each scaled by a gain in :data:`GAIN_RANGE` and given noise of std :data:`NOISE_STD`
    (module docstring)."""
    video, actions = clips.clips(torch.arange(len(clips.clip_starts)))
    x = band_triplets(video[:, 0]).flatten(0, 1)  # [N (F-2), 3, R, W]
    lo, hi = GAIN_RANGE

    def augment(batch: Tensor, gen: torch.Generator) -> Tensor:
        gain = lo + (hi - lo) * torch.rand(batch.shape[0], 1, 1, 1, generator=gen)
        return (batch * gain + NOISE_STD * torch.randn(batch.shape, generator=gen)).clamp(0, 1)

    return train_classifier(seeded(lambda: BandInverseDynamicsNet(x.shape[-1]), seed), x, actions[:, 1:-1].flatten(),
                            steps=steps, batch_size=batch_size, lr=lr, gen=torch.Generator().manual_seed(seed),
                            augment=augment)


@torch.no_grad()
def action_probabilities(model: BandInverseDynamicsNet, video: Tensor) -> Tensor:
    """``[B, F - 2, 3]`` float32: the model's action probabilities for transitions ``1..F-2`` of grey ``video [B, F,
    H, W]`` in [0, 1]."""
    b, f = video.shape[:2]
    return model(band_triplets(video.float()).flatten(0, 1)).softmax(-1).view(b, f - 2, len(ACTIONS))


def idm_reward(probs: Tensor, actions: Tensor) -> Tensor:
    """``[B]`` float32 in [-1, 1]: :func:`flowforge.demo.world.command_lift` of the reward model's probabilities
    ``probs [B, F - 2, 3]`` (transitions ``1..F-2``) for the commands ``actions [B, F]`` (module docstring)."""
    return command_lift(probs, actions)


def save_band_idm(model: BandInverseDynamicsNet, path: str | pathlib.Path = REWARD_IDM_PATH, *,
                  steps: int = 2000) -> None:
    """Write the reward model's weights (safetensors; one metadata key, so the bytes are fixed: seed, recording,
    steps, augmentation)."""
    import dataclasses

    meta = {"flowforge": json.dumps({"seed": REWARD_SEED, "data": dataclasses.asdict(REWARD_DATA), "split": "all",
                                     "steps": steps, "band_rows": BAND_ROWS, "gain_range": list(GAIN_RANGE),
                                     "noise_std": NOISE_STD, "width": model.width}, sort_keys=True)}
    save_weights(model, path, meta)


def load_band_idm(path: str | pathlib.Path = REWARD_IDM_PATH) -> BandInverseDynamicsNet:
    """The shipped reward model (eval mode).

    Raises:
        FileNotFoundError: no weights at ``path`` (``python -m flowforge.demo.world_reward`` writes them).
    """
    from safetensors import safe_open

    names = {"what": "inverse-dynamics reward", "module": "flowforge.demo.world_reward"}
    require_weights(path, **names)  # before the width is read from it
    with safe_open(str(path), framework="pt") as f:
        width = int(json.loads(f.metadata()["flowforge"])["width"])
    return load_weights(BandInverseDynamicsNet(width), path, **names)


def _shuffled(actions: Tensor) -> Tensor:
    """Another clip's actions for every clip (the next one's): the shuffled-action null."""
    return actions.roll(1, dims=0)


@torch.no_grad()
def generate_clips(adapter: Any, video: Tensor, actions: Tensor, *, seed: int, num_steps: int, shift: float,
                   batch_size: int = 32) -> tuple[Tensor, list[str]]:
    """``(generations [N, 3, F, H, W] in [0, 1], prompts)`` of a world-model ``adapter`` from the first frames of
    ``video [N, 1, F, H, W]`` and ``actions [N, F]`` (prompts: the action names, ``adapter.action_names``): fixed
    noise ``torch.randn`` seeded ``seed``, ``num_steps`` Euler ODE steps at static shift ``shift`` (the world SFT's
    evaluation, :func:`flowforge.train.sft.world.evaluate_world`, and :func:`generate_world`)."""
    import dataclasses

    from flowforge.algorithms.schedules import flow_match_sigmas
    from flowforge.rollout import generate

    sigmas = flow_match_sigmas(num_steps, shift)
    x_T = torch.randn(video.shape, generator=torch.Generator().manual_seed(seed))
    names = [" ".join(adapter.action_names[a] for a in row) for row in actions.tolist()]
    outs = []
    for s in range(0, video.shape[0], batch_size):
        cond = adapter.encode(names[s:s + batch_size])
        x0 = adapter.encode_video(video[s:s + batch_size])
        cond = dataclasses.replace(cond, image=x0[:, :, :1])
        outs.append(adapter.decode(generate(adapter, cond, x_T[s:s + batch_size], sigmas)))
    return torch.cat(outs), names


@torch.no_grad()
def generate_world(path: str, video: Tensor, actions: Tensor, *, seed: int, num_steps: int = 10,
                   shift: float = 3.0, batch_size: int = 32) -> Tensor:
    """:func:`generate_clips` of the world model at ``path`` (loaded as ``model.adapter: world_model``, i2v)."""
    from flowforge.models import build_adapter

    adapter = build_adapter("world_model", path, task="i2v")
    adapter.transformer.eval()
    return generate_clips(adapter, video, actions, seed=seed, num_steps=num_steps, shift=shift,
                          batch_size=batch_size)[0]


def measure(reward: BandInverseDynamicsNet, video: Tensor, actions: Tensor) -> dict[str, float]:
    """Mean (and standard error) of every action judge on grey ``video [N, F, H, W]`` with ``actions [N, F]`` and
    with another clip's: ``reward`` (:func:`idm_reward`, chance 0), the eval judge (:mod:`flowforge.demo.world`:
    ``judge`` its accuracy, ``judge_lift`` its accuracy over the within-clip shuffle, chance 0), the game rule
    (:mod:`flowforge.data.paddle`); ``reward_argmax_accuracy``: how often the reward model's likeliest action is the
    commanded one."""
    from flowforge.data.paddle import paddle_agreement, paddle_position
    from flowforge.demo.world import inverse_dynamics_accuracy, inverse_dynamics_lift, load_inverse_dynamics

    judge = load_inverse_dynamics()
    probs = action_probabilities(reward, video)
    x = paddle_position(video)
    out = {}
    for tag, acts in (("", actions), ("_other", _shuffled(actions))):
        for name, s in (("reward", idm_reward(probs, acts)), ("judge", inverse_dynamics_accuracy(judge, video, acts)),
                        ("judge_lift", inverse_dynamics_lift(judge, video, acts)),
                        ("rule", paddle_agreement(x, acts, size=video.shape[-1]).mean(1))):
            out[name + tag] = float(s.mean())
            out[name + tag + "_se"] = float(s.std() / s.numel() ** 0.5)
    out["reward_argmax_accuracy"] = float((probs.argmax(-1) == actions[:, 1:-1]).float().mean())
    return out


def command_blind_videos(video: Tensor) -> dict[str, Tensor]:
    """``{name: [n, F, H, W]}`` videos that ignore the commands, built from grey real clips ``video [n, F, H, W]``:
    the first frame held (``still``), the paddle row cleared and a paddle drawn at either wall in every frame
    (``parked_left`` / ``parked_right``), uniform noise (``random``, generator seed 0), the real clip with a bright
    bar across the paddle row (``bar``)."""
    first = video[:, :1].expand_as(video).clone()
    out = {"still": first}
    for name, cols in (("parked_left", slice(0, 4)), ("parked_right", slice(-4, None))):
        parked = first.clone()
        parked[..., -1, :] = 0.0
        parked[..., -1, cols] = 0.69
        out[name] = parked
    out["random"] = torch.rand(video.shape, generator=torch.Generator().manual_seed(0))
    bar = video.clone()
    bar[..., -1, :] = 0.8
    out["bar"] = bar
    return out


def blind_table(reward: BandInverseDynamicsNet, video: Tensor, actions: Tensor, shifts: int = 10) -> dict[str, dict]:
    """``reward`` (:func:`idm_reward`), the judge's accuracy and its lift on grey real clips ``video [n, F, H, W]``
    with ``actions [n, F]``, with another clip's (mean of ``shifts`` shifts: the shuffled-action null) and on each
    of :func:`command_blind_videos` (plus ``max_share``: the most frequent command's share of transitions 1..F-2,
    the most a command-blind video's accuracy reaches in expectation)."""
    from flowforge.demo.world import inverse_dynamics_accuracy, inverse_dynamics_lift, load_inverse_dynamics

    judge = load_inverse_dynamics()

    def row(v: Tensor, a: Tensor) -> dict[str, float]:
        return {"reward": float(idm_reward(action_probabilities(reward, v), a).mean()),
                "judge": float(inverse_dynamics_accuracy(judge, v, a).mean()),
                "judge_lift": float(inverse_dynamics_lift(judge, v, a).mean())}

    nulls = [row(video, actions.roll(k, dims=0)) for k in range(1, shifts + 1)]
    out = {"true actions": row(video, actions), "shuffled null": {k: sum(n[k] for n in nulls) / shifts
                                                                   for k in nulls[0]}}
    out.update({name: row(fake, actions) for name, fake in command_blind_videos(video).items()})
    counts = torch.bincount(actions[:, 1:-1].flatten(), minlength=len(ACTIONS)).float()
    out["max_share"] = {"judge": float(counts.max() / counts.sum())}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m flowforge.demo.world_reward``: train + save the reward model on :data:`REWARD_DATA`, then print
    the command-blind table (:func:`blind_table`) on every held-out clip of the demo recording and every action
    judge on 64 of them (real, and the generations of ``--world``, default ``demo:world``, with
    ``--measure-seeds`` noise seeds, with their PSNR in dB against the real future), each with the true actions and
    another clip's."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--cache-dir", default=".cache/flowforge")
    p.add_argument("--out", default=str(REWARD_IDM_PATH))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--skip-train", action="store_true", help="measure the weights at --out without training")
    p.add_argument("--clips", type=int, default=64, help="held-out clips measured (evenly spaced)")
    p.add_argument("--measure-seeds", default="0,1", help="noise seeds of --world's generations ('' = none)")
    p.add_argument("--world", default="demo:world", help="the world model measured: demo:world or a directory")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one thread: the same bytes on every machine of the same torch build
    if not args.skip_train:
        model = train_band_idm(load_atari_clips(REWARD_DATA, args.cache_dir), steps=args.steps)
        save_band_idm(model, args.out, steps=args.steps)
        print(f"wrote {args.out}")
    model = load_band_idm(args.out)
    demo = load_atari_clips(AtariDataConfig(), args.cache_dir)
    held = demo.split("heldout")
    held = held[torch.linspace(0, len(held) - 1, min(args.clips, len(held))).long()]
    video, actions = demo.clips(held)
    every_video, every_action = demo.clips(demo.split("heldout"))
    for name, r in blind_table(model, every_video[:, 0], every_action).items():
        print(json.dumps({"held-out clips": len(every_action), "videos": name, **{k: round(v, 4) for k, v in r.items()}}))
    rows = {"real": measure(model, video[:, 0], actions)}
    from flowforge.algorithms.video_metrics import psnr
    from flowforge.demo.paths import resolve_demo_path

    for seed in [int(s) for s in args.measure_seeds.split(",") if s.strip()]:
        grey = generate_world(str(resolve_demo_path(args.world)), video, actions, seed=seed).mean(1)
        rows[f"{args.world} seed {seed}"] = {**measure(model, grey, actions),
                                             "psnr": float(psnr(grey, video[:, 0])[:, 1:].mean())}
    for name, r in rows.items():
        print(json.dumps({"videos": name, **{k: round(v, 4) for k, v in r.items()}}))


if __name__ == "__main__":
    main()
