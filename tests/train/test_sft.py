"""Flow-matching SFT: loss definition, determinism (a short run is a prefix of a longer one), outputs loadable."""
import json
from dataclasses import replace

import pytest
import torch

from flowforge.demo.model import build_tiny_sd3, test_sd3_config
from flowforge.models.base import Conditioning
from flowforge.models.sd3.adapter import SD3Adapter, load_sd3
from flowforge.config import DataConfig, RunConfig, SFTConfig
from flowforge.algorithms.schedules import sample_sigmas
from flowforge.train.sft import flow_matching_loss, run_sft


def test_flow_matching_loss_target_is_noise_minus_x0():
    adapter = SD3Adapter(build_tiny_sd3(test_sd3_config(), seed=0))
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 1, 32, 32, generator=g), torch.randn(2, 1, 32, 32, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    cond = Conditioning(torch.randn(2, 16, 384, generator=g), torch.randn(2, 384, generator=g))
    x_sigma = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
    with torch.no_grad():
        expected = (adapter.velocity(x_sigma, sigma, cond, 1.0) - (noise - x0)).square().mean()
        torch.testing.assert_close(flow_matching_loss(adapter, x0, noise, sigma, cond), expected)


def test_sigma_sampling():
    g = torch.Generator().manual_seed(0)
    s = sample_sigmas(20000, g, kind="logit_normal")
    assert 0 < s.min() and s.max() < 1 and abs(s.mean().item() - 0.5) < 0.01
    assert s.std().item() < sample_sigmas(20000, g, kind="uniform").std().item()  # concentrated mid-range
    with pytest.raises(ValueError, match="uniform"):
        sample_sigmas(2, g, kind="beta")


def test_short_run_is_prefix_and_output_loads(tmp_path):
    kw = dict(run=RunConfig(seed=5), data=DataConfig(cache_dir=str(tmp_path / "cache"), eval_prompts="demo:eval"),
              model_config=test_sd3_config())
    sft = SFTConfig(batch_size=8, lr=1e-3, warmup_steps=2)
    long_hist = run_sft(replace(sft, output=str(tmp_path / "long"), steps=3, eval_every=2), **kw)
    short_hist = run_sft(replace(sft, output=str(tmp_path / "short"), steps=2, eval_every=0, save_checkpoints=False),
                         **kw)
    assert [h["step"] for h in long_hist] == [0, 2, 3] and [h["step"] for h in short_hist] == [0, 2]
    assert all(0.0 <= h["digit_eval"] <= 1.0 for h in long_hist)
    assert short_hist[1]["loss"] == long_hist[1]["loss"]
    from safetensors.torch import load_file

    a = load_file(tmp_path / "long" / "checkpoints" / "step_000002" / "diffusion_pytorch_model.safetensors")
    b = load_file(tmp_path / "short" / "diffusion_pytorch_model.safetensors")
    c = load_file(tmp_path / "long" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # step 3 moved the weights
    assert json.loads((tmp_path / "long" / "sft_history.json").read_text())[-1]["step"] == 3
    adapter = load_sd3(tmp_path / "short")
    assert adapter.text_encoder.max_length == 16 and not adapter.transformer.training
    assert (tmp_path / "long" / "samples" / "step_000000.png").is_file()


def test_sft_section_checks_its_values_and_old_files_load():
    """``run_sft``'s former keyword checks live in the ``sft`` section (all problems at once); a config written
    before the section grew its optional keys still loads with the defaults ``flowforge sft`` always used."""
    from flowforge.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        SFTConfig(steps=-1, batch_size=0, cond_dropout=1.0, sigma_sampling="beta")
    text = "\n".join(err.value.problems)
    assert len(err.value.problems) == 4
    assert "sft.steps=-1 must be >= 0" in text and "sft.batch_size=0 must be > 0" in text
    assert "sft.cond_dropout=1.0 must be in [0, 1)" in text
    assert "sft.sigma_sampling='beta' is not one of ['logit_normal', 'uniform']" in text
    cfg = load_config(None, ["sft={steps: 5, output: x}"])
    assert (cfg.sft.weight_decay, cfg.sft.grad_clip, cfg.sft.sigma_sampling, cfg.sft.eval_samples_per_prompt,
            cfg.sft.eval_seed, cfg.sft.save_checkpoints) == (0.0, 1.0, "logit_normal", 1, 1234, True)
