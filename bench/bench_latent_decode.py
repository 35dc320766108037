"""What a latent reward saves: a video family's training rollout with and without the VAE decode.

    python bench/bench_latent_decode.py [--repeats 5] [--height 32] [--width 32] [--frames 9]

A tiny random Wan pipeline (the test fixture's architecture, ``tests/models/tiny_families.py``: a 1-layer
transformer, ``AutoencoderKLWan`` with base width 4) is saved and loaded through the trainer (``model.adapter=wan``,
t2v, 2 prompts x 4 candidates, 4 sampling steps). One step's rollout (:meth:`Trainer.sample`) is then followed by the
rollout boundary's :func:`~flowforge.rollout.decode_needed` as a training step runs it:

* **pixels**: a pixel scorer is weighted (``needs = {"pixels"}``): every candidate is VAE-decoded;
* **latents**: only latent scorers are weighted (``needs = {"latents"}``): nothing is decoded.

The arms alternate in one process (one warm-up each) and the printed ratio is pixels / latents, with the VAE decode
calls of one step counted by wrapping ``vae.decode``; the decode alone is timed after them. The ratio is that of these
tiny models (a 1-layer transformer beside a full VAE): a real model's depends on its transformer / VAE cost ratio and
the number of sampling steps, so it is not a prediction for one.
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from common import interleave, timed
from flowforge.config import load_config
from flowforge.rollout import decode_needed
from flowforge.train.trainer import Trainer
from tests.models import tiny_families as tiny

PROMPTS = ["a red cat", "two dogs under a tree", "a blue car on a road", "a small boat on the sea"]


def build(root: Path, height: int, width: int, frames: int) -> Trainer:
    """A Trainer on a freshly saved tiny Wan pipeline under ``root``."""
    import diffusers

    tiny.WORDS = list(tiny.WORDS) + [f"w{i}" for i in range(1000)]  # past the loaders' placeholder-tokenizer guard
    diffusers.WanPipeline(**tiny.wan_components(0)).save_pretrained(str(root / "wan"))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "metadata": {"task": "t2v", "sample_id": f"s{i}"}}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    cfg = load_config(None, [
        "model.adapter=wan", f"model.path={root / 'wan'}", f"model.height={height}", f"model.width={width}",
        f"model.frames={frames}", "model.task=t2v", f"run.output_dir={root / 'runs'}", "run.name=bench",
        f"data.cache_dir={root / 'cache'}", f"data.prompts={prompts}", f"data.eval_prompts={prompts}",
        "data.prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "sampler.num_sde_steps=2",
        "sampler.schedule=wan", "train.micro_batch_size=2", "eval.every=0", "run.num_threads=1",
        "reward.weights={jpeg_compressibility: 1.0}"])
    return Trainer(cfg, progress=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--height", type=int, default=32)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--frames", type=int, default=9)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tr = build(Path(tmp), args.height, args.width, args.frames)
        batch = tr.next_prompts()
        vae, calls = tr.adapter.vae, [0]
        decode = vae.decode

        def counting(*a, **k):
            calls[0] += 1
            return decode(*a, **k)

        vae.decode = counting
        bs = tr.cfg.reward.batch_size

        def step(needs):
            traj, _ = tr.sample(batch, 0)
            return decode_needed(tr.adapter, traj.final, bs, needs)

        traj, _ = tr.sample(batch, 0)
        calls[0] = 0
        media, _ = decode_needed(tr.adapter, traj.final, bs, {"pixels"})
        with_decode = calls[0]
        calls[0] = 0
        decode_needed(tr.adapter, traj.final, bs, {"latents"})
        without = calls[0]
        pixels, latents = interleave(lambda: step({"pixels"}), lambda: step({"latents"}), args.repeats)
        decode_only = timed(lambda: decode_needed(tr.adapter, traj.final, bs, {"pixels"}), args.repeats)
        mp, ml, md = statistics.median(pixels), statistics.median(latents), statistics.median(decode_only)
        print(f"tiny Wan t2v {args.height}x{args.width}x{args.frames} frames, latents {tuple(traj.final.shape)}, "
              f"media {tuple(media.shape)}, {len(batch.records)} candidates, {len(tr.sigmas) - 1} steps, "
              f"{torch.get_num_threads()} threads")
        print(f"VAE decode calls per step: pixels arm {with_decode}, latents arm {without}")
        print(f"rollout + decode (pixel scorer) {mp * 1e3:.1f} ms, rollout alone (latent scorers) {ml * 1e3:.1f} ms "
              f"(median of {args.repeats}); decode alone {md * 1e3:.1f} ms; ratio pixels / latents {mp / ml:.3f}")


if __name__ == "__main__":
    main()
