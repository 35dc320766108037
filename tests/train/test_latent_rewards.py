"""Latent rewards on the real loop: a run whose training scorers all read latents (``takes_latents``) runs no decode
in its rollout; a pixel scorer's run decodes; evaluation decodes (its grid and pixel scorers).

Decodes are counted by wrapping the adapter's ``decode`` (the tiny digits model is pixel-space: its decode is the
whole latents -> pixels step, the VAE's place), split into the calls made inside :meth:`Trainer.evaluate` and the
others (the rollout / scoring of the training steps)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from flowforge.demo.data import load_split
from flowforge.train.trainer import Trainer
from tests.train.test_trainer import read_jsonl, tiny_cfg


@pytest.fixture(scope="module")
def digit_means(tmp_path_factory):
    """The ten per-digit mean latents of the demo's ``reward`` split (pixel space: pixels in [-1, 1], [1, 32, 32]),
    as docs/guides/latent-and-audio-rewards.md builds them."""
    images, labels = load_split("reward")
    path = tmp_path_factory.mktemp("latent_ref") / "digit_means.safetensors"
    save_file({str(d): (images[labels == d].mean(0) * 2 - 1).contiguous() for d in range(10)}, str(path))
    return path


def counted_run(trainer, owner=None):
    """Train ``trainer`` with ``owner.decode`` counted (default: the adapter's): ``(run_dir, decodes outside
    evaluate, inside)``."""
    owner = trainer.adapter if owner is None else owner
    counts = {"train": 0, "eval": 0}
    where = ["train"]
    decode, evaluate = owner.decode, trainer.evaluate

    def counting_decode(*args, **kwargs):
        counts[where[0]] += 1
        return decode(*args, **kwargs)

    def counting_evaluate(step):
        where[0] = "eval"
        try:
            return evaluate(step)
        finally:
            where[0] = "train"

    owner.decode, trainer.evaluate = counting_decode, counting_evaluate
    run_dir = trainer.train()
    return run_dir, counts["train"], counts["eval"]


@pytest.mark.parametrize("weights", ["latent", "pixel"])
def test_latent_scorers_train_without_decode(tiny_model_dir, tmp_path, encode_cache_dir, digit_means, weights):
    options = json.dumps({"latent_reference": {"reference": str(digit_means), "key": "digit"}})
    reward = (['reward.weights=!{"latent_reference": 1.0}', "reward.required=[]", f"reward.options={options}"]
              if weights == "latent" else ['reward.weights=!{"digit": 1.0}', "reward.required=[digit]"])
    cfg = tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, f"run.name={weights}", *reward)
    run_dir, train_decodes, eval_decodes = counted_run(Trainer(cfg, progress=False))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    if weights == "latent":
        assert train_decodes == 0  # two steps rolled out, scored and trained on latents alone
        assert all(r["reward/latent_reference_mean"] < 0 for r in rows)  # -MSE to the requested digit's mean
        assert "train/diversity" not in rows[0]  # a pixel distance: nothing was decoded
    else:
        assert train_decodes > 0
        assert "train/diversity" in rows[0]
    assert eval_decodes > 0  # evaluation decodes: digit_eval (eval.scorers) and the grid read pixels
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert 0.0 <= evals[-1]["eval/digit_eval"] <= 1.0


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    """A tiny random Wan t2v pipeline (a real ``AutoencoderKLWan``) saved as the families' loop test saves it."""
    import diffusers

    from tests.train.test_families_loop import _components

    path = tmp_path_factory.mktemp("tiny_wan")
    diffusers.WanPipeline(**_components("wan")).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("weights, overlap", [("latent", False), ("latent", True), ("pixel", False)])
def test_a_latent_only_video_run_never_calls_the_vae_decode(wan_dir, tmp_path, weights, overlap):
    """Tiny Wan (16x16, 5 frames: latents [4, 2, 2, 2]), two GRPO steps scored by latent_reference alone (with and
    without reward.overlap): the VAE's decode is not called outside evaluation; evaluation calls it (its grid).
    Scored by jpeg_compressibility (pixels) instead, the training steps call it."""
    from tests.train.test_families_loop import family_cfg

    reference = tmp_path / "zero.safetensors"
    save_file({"zero": torch.zeros(4, 2, 2, 2)}, str(reference))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "metadata": {"task": "t2v", "sample_id": f"s{i}"}}) + "\n"
                               for i, p in enumerate(["a red cat", "two dogs", "a blue car", "a boat"])))
    options = json.dumps({"latent_reference": {"reference": str(reference)}})
    reward = (['reward.weights=!{"latent_reference": 1.0}', f"reward.options={options}"] if weights == "latent"
              else ['reward.weights=!{"jpeg_compressibility": 1.0}'])
    cfg = family_cfg("wan", wan_dir, tmp_path / "runs", tmp_path / "cache",
                     {("t2v", s): prompts for s in ("train", "eval")}, f"run.name=wan-{weights}-{overlap}", *reward,
                     f"reward.overlap={str(overlap).lower()}", "eval.scorers=[]")
    trainer = Trainer(cfg, progress=False)
    run_dir, train_calls, eval_calls = counted_run(trainer, trainer.adapter.vae)  # the real VAE's decode
    calls = {"train": train_calls, "eval": eval_calls}
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    if weights == "latent":
        assert all(r["reward/latent_reference_mean"] < 0 for r in rows)  # -MSE to the zero latent
        assert calls["train"] == 0
    else:
        assert calls["train"] > 0
    assert calls["eval"] > 0
