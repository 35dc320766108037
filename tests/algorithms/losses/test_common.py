"""The losses package's public surface and its shared pieces: re-exports, input checks, the per-sample broadcast,
advantage preparation, the PPO clip and ratio metrics, the equal-std Gaussian KL, group indexing.
"""
import pytest
import torch

import flowforge.algorithms.losses as losses
from flowforge.algorithms import common, sde
from flowforge.algorithms.losses import _common
from tests.algorithms.losses.helpers import F64, randn

# Every public name of the former single-module flowforge.algorithms.losses (functions, constants, type aliases).
FORMER_NAMES = [
    "grpo_clip_loss", "nft_loss", "velocity_mse_kl", "transition_mean_kl", "NFT_MODES", "awm_loss", "AWM_WEIGHTINGS",
    "dgpo_loss", "DGPO_MODES", "grpo_guard_loss", "GUARD_STEP_WEIGHTS", "diffusion_dpo_loss", "best_worst_pairs",
    "crd_loss", "CRD_LOSS_TYPES", "cfg_velocity", "Metrics", "GroupIds",
]


def test_former_public_names_are_re_exported_from_their_algorithm_modules():
    added = ["dppo_loss", "flow_grpo_kl", "anchor_fm_loss", "transition_ce_loss", "combine_anchor_terms",
             "dmd_gradient", "dmd_loss", "fake_score_loss", "gan_generator_loss", "gan_discriminator_loss"]
    for name in FORMER_NAMES + added:
        assert hasattr(losses, name), name
    assert set(losses.__all__) == set(FORMER_NAMES + added)
    from flowforge.algorithms.losses import awm, crd, dgpo, dpo, dppo, grpo, grpo_guard, nft
    assert losses.grpo_clip_loss is grpo.grpo_clip_loss and losses.transition_mean_kl is grpo.transition_mean_kl
    assert losses.flow_grpo_kl is grpo.flow_grpo_kl
    assert losses.grpo_guard_loss is grpo_guard.grpo_guard_loss and losses.dppo_loss is dppo.dppo_loss
    assert losses.nft_loss is nft.nft_loss and losses.velocity_mse_kl is nft.velocity_mse_kl
    assert losses.awm_loss is awm.awm_loss and losses.dgpo_loss is dgpo.dgpo_loss
    assert losses.diffusion_dpo_loss is dpo.diffusion_dpo_loss and losses.best_worst_pairs is dpo.best_worst_pairs
    assert losses.crd_loss is crd.crd_loss and losses.cfg_velocity is crd.cfg_velocity
    assert losses.NFT_MODES == ("reference", "paper_velocity_mse") and losses.CRD_LOSS_TYPES == ("mse", "bce")
    assert losses.AWM_WEIGHTINGS == ("uniform", "t", "t**2", "huber", "ghuber")
    assert losses.DGPO_MODES == ("reference", "paper") and losses.GUARD_STEP_WEIGHTS == ("inv_dt", "none")


def test_one_per_sample_broadcast_helper_for_sde_and_losses():
    assert not hasattr(sde, "_per_sample") and not hasattr(_common, "_step_stat")
    t = common.per_sample(0.5, "sigma", (3,), F64, torch.device("cpu"))
    assert t.shape == (3,) and t.dtype == F64 and t.tolist() == [0.5] * 3
    t = common.per_sample(torch.tensor(2), "dt", (2, 3), torch.float32, torch.device("cpu"))
    assert t.shape == (2, 3) and t.dtype == torch.float32
    same = torch.arange(3.0)
    assert torch.equal(common.per_sample(same, "x", (3,), torch.float32, torch.device("cpu")), same)
    with pytest.raises(ValueError, match=r"sigma must be a float, a 0-d tensor or shape \[B\]=\[3\]"):
        common.per_sample(torch.ones(2), "sigma", (3,), F64, torch.device("cpu"))
    with pytest.raises(ValueError, match="of log_prob"):
        _common.step_stat(torch.ones(3), "std", torch.zeros(3, 2), F64)
    with pytest.raises(ValueError, match="float"):
        common.per_sample(torch.tensor([True, False]), "sigma", (2,), F64, torch.device("cpu"))


def test_compute_dtype():
    assert common.compute_dtype(torch.zeros(1, dtype=torch.bfloat16)) == torch.float32
    assert common.compute_dtype(torch.zeros(1), torch.zeros(1, dtype=F64)) == F64


def test_prepared_advantages_is_the_inline_clamp_bit_for_bit():
    adv = torch.randn(7, generator=torch.Generator().manual_seed(0)) * 4
    for clip in (None, 2.0):
        inline = adv.detach().to(torch.float32)
        if clip is not None:
            inline = inline.clamp(-clip, clip)
        assert torch.equal(_common.prepared_advantages(adv, clip, torch.float32, 1), inline)
    assert _common.prepared_advantages(adv, None, F64, 2).shape == (7, 1)
    assert _common.prepared_advantages(adv[:, None].expand(7, 3), None, F64, 2).shape == (7, 3)


def test_ppo_clip_and_ratio_metrics():
    ratio = torch.tensor([0.5, 0.95, 1.0, 1.5], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0], dtype=F64)
    per = _common.ppo_clip(ratio, adv, 0.1, 0.2)
    assert per.tolist() == [-0.5, 0.95, -2.0, -1.2]
    log_ratio = torch.log(ratio)
    m = _common.ratio_metrics(ratio, log_ratio, 0.1, 0.2)
    assert list(m) == ["ratio_mean", "ratio_std", "ratio_min", "ratio_max", "clip_fraction", "approx_kl"]
    assert m["clip_fraction"].item() == 0.5
    m = _common.ratio_metrics(ratio, log_ratio)
    assert list(m) == ["ratio_mean", "ratio_std", "ratio_min", "ratio_max", "approx_kl"]
    assert m["approx_kl"].item() == pytest.approx(0.5 * (log_ratio**2).mean().item())


def test_gaussian_mean_kl_matches_torch_distributions_per_step():
    mean, old = randn(0, 2, 3, 4, 5), randn(1, 2, 3, 4, 5)
    std = 0.2 + torch.rand(2, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    kl = _common.gaussian_mean_kl(mean, old, std, F64)
    s = std.view(2, 3, 1, 1)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(old, s), torch.distributions.Normal(mean, s))
    torch.testing.assert_close(kl, ref.mean(dim=(2, 3)), rtol=1e-12, atol=0)
    torch.testing.assert_close(kl, _common.gaussian_mean_kl(old, mean, std, F64), rtol=1e-15, atol=0)  # symmetric


def test_checks_raise_with_the_allowed_shapes():
    with pytest.raises(ValueError, match="clip_low and clip_high"):
        _common.check_clip(0.1, -1.0)
    assert _common.check_clip(0.1, None) == 0.1
    with pytest.raises(ValueError, match="adv_clip"):
        _common.check_adv_clip(0.0)
    with pytest.raises(ValueError, match="share"):
        _common.check_ratio_inputs(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2), None)
    with pytest.raises(ValueError, match=r"\[B, S, \*latent\]"):
        _common.check_step_means(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="v_old"):
        _common.check_velocity_like("v", torch.zeros(2, 3), v_old=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"\[B\]=\[2\]"):
        _common.check_per_sample("advantages", torch.zeros(3), 2)


def test_group_index_and_group_sum():
    inv, g, labels = common.group_index(["b", "a", "b", "c"], 4, torch.device("cpu"))
    assert inv.tolist() == [0, 1, 0, 2] and g == 3 and labels == ("b", "a", "c")
    inv, g, labels = common.group_index(torch.tensor([5, 2, 5]), 3, torch.device("cpu"))
    assert inv.tolist() == [1, 0, 1] and labels == (2, 5)
    assert _common.group_sum(torch.tensor([1.0, 2.0, 3.0]), inv, g).tolist() == [2.0, 4.0]
    with pytest.raises(ValueError, match="integer"):
        common.group_index(torch.tensor([0.0, 1.0]), 2, torch.device("cpu"))
