"""The ``clap`` scorer on a tiny random-init CLAP (``tests/rewards/scorers/tiny_clap.py``): registered, loaded from
a local directory offline, its preprocessing exactly the official ``ClapProcessor``'s, its score exactly the cosine
of ``ClapModel.get_audio_features`` and ``get_text_features`` computed here independently. (Random weights say
nothing about which text matches which sound, so no ranking is asserted.)"""

import numpy as np
import pytest
import torch
from scipy.signal import resample_poly

from flowforge.rewards.base import AudioBatch
from flowforge.rewards.registry import SCORERS, build_scorer
from flowforge.rewards.scorers.clap import ClapScore
from tests.rewards.scorers.tiny_clap import build_clap_dir

PROMPTS = ["a dog barks twice", "rain on a tin roof", "a dog barks twice"]


@pytest.fixture(scope="module")
def clap_dir(tmp_path_factory):
    return build_clap_dir(tmp_path_factory.mktemp("tiny_clap"))


def sounds(rate, seconds, channels=2, seed=0):
    """``AudioBatch`` of three clips: a tone, noise, and the tone again in its other channel order."""
    t = torch.arange(int(rate * seconds)) / rate
    g = torch.Generator().manual_seed(seed)
    tone = torch.stack([torch.sin(2 * torch.pi * 440 * t), 0.5 * torch.sin(2 * torch.pi * 660 * t)])[:channels]
    noise = 0.3 * torch.randn(channels, t.numel(), generator=g)
    return AudioBatch(torch.stack([tone, noise, tone.flip(0)]), rate)


def official(clap_dir, prompts, waves):
    """The official processor applied by hand to mono 48 kHz numpy clips."""
    from transformers import ClapProcessor

    processor = ClapProcessor.from_pretrained(str(clap_dir), local_files_only=True)
    sound = processor.feature_extractor(list(waves), sampling_rate=48_000, return_tensors="pt")
    text = processor.tokenizer(list(prompts), padding=True, truncation=True, return_tensors="pt")
    return sound, text


def test_clap_is_registered_and_loads_offline_from_a_local_dir(clap_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert SCORERS["clap"] is ClapScore
    scorer = build_scorer("clap", model_path=str(clap_dir))
    assert scorer.takes_audio and not scorer.needs_group and scorer.sampling_rate == 48_000
    out = scorer(torch.zeros(3, 3, 2, 8, 8), PROMPTS, [{}] * 3, audio=sounds(48_000, 0.5))
    assert out.shape == (3,) and out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    assert out[0] != out[1]  # different sounds, different scores
    with pytest.raises(ValueError, match="model_path=.*no CLAP model found locally.*huggingface-cli download"):
        build_scorer("clap", model_path=str(clap_dir.parent / "missing"))


@pytest.mark.parametrize("rate", [48_000, 16_000])
def test_preprocessing_is_the_official_processor(clap_dir, rate):
    """Mono (channel mean), resampled to 48 kHz with scipy's resample_poly (by hand here), then the official
    feature extractor and tokenizer: max abs difference 0."""
    scorer = ClapScore(str(clap_dir))
    audio = sounds(rate, 0.75)
    mono = audio.waveform.mean(dim=1).numpy()
    waves = mono if rate == 48_000 else resample_poly(mono, 3, 1, axis=-1).astype(np.float32)
    sound, text = official(clap_dir, PROMPTS, waves)
    ours_sound, ours_text = scorer.features(PROMPTS, audio)
    assert float((ours_sound["input_features"] - sound["input_features"]).abs().max()) == 0.0
    assert torch.equal(ours_sound["is_longer"], sound["is_longer"])
    assert torch.equal(ours_text["input_ids"], text["input_ids"])
    assert torch.equal(ours_text["attention_mask"], text["attention_mask"])


def test_a_clip_longer_than_the_window_is_cut_to_its_start_not_at_random(clap_dir):
    """The official extractor crops a long clip at a random offset; the scorer gives it the first window, so the
    same sound scores the same every time."""
    scorer = ClapScore(str(clap_dir))
    audio = sounds(48_000, 1.6)  # the tiny model's window is 1 s
    first = scorer.features(PROMPTS, audio)[0]["input_features"]
    start, _ = official(clap_dir, PROMPTS, audio.waveform.mean(dim=1).numpy()[:, :48_000])
    assert float((first - start["input_features"]).abs().max()) == 0.0
    scores = [scorer(torch.zeros(3), PROMPTS, [{}] * 3, audio=audio) for _ in range(3)]
    assert all(torch.equal(scores[0], s) for s in scores)


def test_score_is_the_cosine_of_clap_audio_and_text_features(clap_dir):
    from transformers import ClapModel

    scorer = ClapScore(str(clap_dir), batch_size=2)  # two forwards: 2 + 1 rows
    audio = sounds(24_000, 0.5)
    out = scorer(torch.zeros(3), PROMPTS, [{}] * 3, audio=audio)
    model = ClapModel.from_pretrained(str(clap_dir), local_files_only=True).eval()
    waves = resample_poly(audio.waveform.mean(dim=1).numpy(), 2, 1, axis=-1).astype(np.float32)
    sound, text = official(clap_dir, PROMPTS, waves)
    with torch.no_grad():
        a = model.get_audio_features(**sound).pooler_output
        t = model.get_text_features(**text).pooler_output
    cosine = (a * t).sum(-1) / (a.norm(dim=-1) * t.norm(dim=-1))
    torch.testing.assert_close(out, cosine, atol=1e-6, rtol=0)
    assert out.abs().max() <= 1.0


def test_clap_needs_audio(clap_dir):
    scorer = ClapScore(str(clap_dir))
    with pytest.raises(ValueError, match="audio=AudioBatch"):
        scorer(torch.zeros(3), PROMPTS, [{}] * 3)
    with pytest.raises(ValueError, match="one audio row"):
        scorer(torch.zeros(2), PROMPTS[:2], [{}] * 2, audio=sounds(48_000, 0.2))


def test_the_processor_hands_clap_the_sound(clap_dir):
    from flowforge.rewards.processor import RewardProcessor

    scorer = ClapScore(str(clap_dir))
    audio = sounds(48_000, 0.5)
    video = torch.rand(3, 3, 2, 8, 8)
    components, metrics = RewardProcessor({"clap": scorer}, {"clap": 1.0}, batch_size=2)(
        video, PROMPTS, [{}] * 3, audio=audio)
    torch.testing.assert_close(components["clap"], scorer(video, PROMPTS, [{}] * 3, audio=audio), atol=1e-6, rtol=0)
    assert "reward/clap_mean" in metrics
