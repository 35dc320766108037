"""LTX-2 audio-video on the real training loop (``flowforge.train.trainer.Trainer``): a tiny random ``LTX2Pipeline``
saved with ``save_pretrained``, loaded through ``model.adapter=ltx2``; 2 steps of LoRA GRPO (with CFG: the first
update ratio exactly 1) and NFT over the joint video | audio latent (tests/train/test_families_loop.py's checks).
The generated sound reaches the reward: the built-in ``av_onset_sync`` is weighted, and :class:`AudioProbe` (a
``takes_audio`` scorer named by import path) records the waveform shape and sample rate it is handed; the eval grid
keeps each shown sample's WAV and the report plays it."""
from __future__ import annotations

import pytest
import torch

from flowforge.config import load_config
from tests.models import tiny_av_families
from tests.models import tiny_families as tiny
from tests.train.test_families_loop import EXTRA_WORDS, prompt_files, read_jsonl, train_and_check  # noqa: F401


class AudioProbe:
    """Records what a ``takes_audio`` scorer is given; scores 0."""

    name = "audio_probe"
    needs_group = False
    takes_video = True
    takes_audio = True
    seen: list = []

    def __call__(self, media, prompts, metadata, *, audio):
        AudioProbe.seen.append((tuple(media.shape), tuple(audio.waveform.shape), audio.sample_rate,
                                audio.waveform.dtype))
        return torch.zeros(media.shape[0])


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ltx2_dir(tmp_path_factory):
    from diffusers import LTX2Pipeline

    mp = pytest.MonkeyPatch()
    mp.setattr(tiny, "WORDS", list(tiny.WORDS) + EXTRA_WORDS)  # > 1000 tokens: passes the loader's guard
    try:
        components = tiny_av_families.ltx2_components()
    finally:
        mp.undo()
    path = tmp_path_factory.mktemp("tiny_ltx2")
    LTX2Pipeline(**components).save_pretrained(str(path))
    return path


def ltx2_cfg(model_dir, tmp_path, prompts, *extra):
    return load_config(None, [
        "model.adapter=ltx2", f"model.path={model_dir}", "model.height=32", "model.width=32", "model.frames=5",
        "model.task=t2v", f"run.output_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}",
        f"data.prompts={prompts['t2v', 'train']}", f"data.eval_prompts={prompts['t2v', 'eval']}",
        "data.prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "sampler.num_sde_steps=2",
        "sampler.schedule=dynamic", "train.micro_batch_size=2", "train.num_updates_per_batch=2", "train.steps=2",
        "train.lr=1e-2", "grpo.clip_low=1e-3", "eval.max_prompts=2", "eval.every=0",
        "reward.weights={jpeg_compressibility: 1.0, av_onset_sync: 0.5, 'tests.train.test_ltx2_loop:AudioProbe': 0.0}",
        *extra])


@pytest.mark.slow  # 15-30 s of training on 2 cores: CI runs it in the slow set (the default run stays near 10 min)
@pytest.mark.parametrize("algorithm", ["grpo", "nft"])
def test_ltx2_trains_on_the_real_loop(algorithm, ltx2_dir, prompt_files, tmp_path):
    from flowforge.train.trainer import Trainer

    guidance = 3.0 if algorithm == "grpo" else 1.0
    cfg = ltx2_cfg(ltx2_dir, tmp_path, prompt_files, f"run.name=ltx2-{algorithm}", f"train.algorithm={algorithm}",
                   f"sampler.guidance_scale={guidance}")
    trainer = Trainer(cfg, progress=False)
    assert type(trainer.adapter).__module__ == "flowforge.models.ltx2.adapter"
    assert trainer.latent_shape == (3 * 16 * 16 + 5, 4)  # video tokens | audio tokens
    torch.testing.assert_close(trainer.sigmas, trainer.adapter.pipeline_sigmas(4, 32, 32))
    AudioProbe.seen.clear()
    run_dir = train_and_check(trainer, algorithm)
    # 2 training steps x 8 samples and 2 evals x 2 prompts x 2 samples; 68 samples of stereo at 16 kHz = the pipeline's
    # waveform for 5 frames at 24 fps (5 audio latent frames through the tiny audio VAE and vocoder)
    assert sum(m[0] for m, *_ in AudioProbe.seen) == 2 * 8 + 2 * 2 * 2
    for media, wave, rate, dtype in AudioProbe.seen:
        assert media[1:] == (3, 5, 32, 32) and wave == (media[0], 2, 68) and rate == 16000
        assert dtype == torch.float32
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert all(-1.0 <= r["reward/av_onset_sync_mean"] <= 1.0 for r in rows)
    wavs = sorted((run_dir / "samples").glob("step_000002_audio_*.wav"))
    assert [w.name for w in wavs] == ["step_000002_audio_0.wav", "step_000002_audio_1.wav"]
    report = (run_dir / "report.html").read_text()
    assert report.count("<audio controls") >= 4 and "data:audio/wav;base64," in report


def test_audio_scorers_need_an_audio_model_and_no_overlap():
    """A takes_audio component is refused when the trainer starts on a model that makes no sound, or with
    reward.overlap (its score stream carries no audio); scorers that take no audio are unaffected."""
    from flowforge.rewards.scorers.av_sync import AVOnsetSync
    from flowforge.rewards.scorers.jpeg import JpegCompressibility
    from flowforge.runtime.errors import UserError
    from flowforge.train.scorer_checks import check_audio_scorers

    class Silent:
        pass

    class Sounding:
        def decode_audio(self, latents):
            return latents, 16000

    scorers = {"av_onset_sync": AVOnsetSync(), "jpeg_compressibility": JpegCompressibility()}
    with pytest.raises(UserError, match=r"model.adapter: Silent produces no audio.*\['av_onset_sync'\]"):
        check_audio_scorers(scorers, Silent(), False)
    with pytest.raises(UserError, match="reward.overlap"):
        check_audio_scorers(scorers, Sounding(), True)
    check_audio_scorers(scorers, Sounding(), False)
    check_audio_scorers({"jpeg_compressibility": JpegCompressibility()}, Silent(), True)


def test_preflight_refuses_audio_rewards_without_sound(prompt_files, tmp_path):
    """flowforge check / train's preflight: av_onset_sync on a model without sound, or with reward.overlap, is an
    error naming the component; on ltx2 without overlap it passes."""
    from flowforge.train.preflight import PreflightError, preflight

    def cfg(*extra):
        return load_config(None, [
            f"data.prompts={prompt_files['t2v', 'train']}", f"data.eval_prompts={prompt_files['t2v', 'eval']}",
            "model.height=32", "model.width=32", "model.frames=5", "model.task=t2v", "model.path=/nowhere",
            "reward.weights={jpeg_compressibility: 1.0, av_onset_sync: 0.5}", *extra])

    with pytest.raises(PreflightError, match=r"\['av_onset_sync'\] score audio, but model.adapter='wan'"):
        preflight(cfg("model.adapter=wan"), this_machine=False)
    with pytest.raises(PreflightError, match="reward.overlap: true"):
        preflight(cfg("model.adapter=ltx2", "reward.overlap=true"), this_machine=False)
    preflight(cfg("model.adapter=ltx2"), this_machine=False)


@pytest.mark.slow  # 15-30 s of training on 2 cores: CI runs it in the slow set (the default run stays near 10 min)
def test_ltx2_run_exports_and_verifies(ltx2_dir, prompt_files, tmp_path):
    """A 2-step LoRA NFT run exports as a diffusers LoRA (LTX2Pipeline.save_lora_weights) and as a merged
    transformer; both reload and match the trained policy's joint velocity (flowforge export --verify)."""
    import json

    from flowforge.tools.export import export_run
    from flowforge.train.trainer import Trainer

    cfg = ltx2_cfg(ltx2_dir, tmp_path, prompt_files, "run.name=ltx2-export", "train.algorithm=nft",
                   "checkpoint.every=2", "reward.weights={jpeg_compressibility: 1.0}")
    run_dir = Trainer(cfg, progress=False).train()
    for form, tolerance in (("adapter", 1e-5), ("merged", 1e-4)):
        out = export_run(run_dir, tmp_path / f"out_{form}", form=form, verify=True)
        report = json.loads((out / "flowforge_export.json").read_text())["verify"]
        assert report["passed"] and report["max_abs_diff"] <= tolerance and report["base_diff"] > 1e-3
