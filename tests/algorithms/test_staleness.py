"""Bounded staleness: the version bound, and the clipped ratio of a stale batch against its sampling policy."""

import math

import pytest
import torch

from flowforge.algorithms import grpo_clip_loss, policy_staleness


def test_staleness_is_the_version_lag_within_the_bound():
    assert policy_staleness(5, 5, 0) == 0
    assert policy_staleness(5, 4, 1) == 1
    assert policy_staleness(5, 3, 2) == 2
    with pytest.raises(ValueError, match="train.max_staleness=1 allows 0..1"):
        policy_staleness(5, 3, 1)
    with pytest.raises(ValueError, match="newer than the trainer's"):
        policy_staleness(5, 6, 3)
    with pytest.raises(ValueError, match="max_staleness=-1 must be >= 0"):
        policy_staleness(5, 5, -1)


def test_stale_ratio_is_against_the_sampling_policy_log_probs_reference_arithmetic():
    """A batch sampled by version k-1 (its recorded log-probs) and trained by version k: the ratio is
    exp(log p_k - log p_{k-1}) per element, clipped to [1 - eps, 1 + eps], computed here by hand. The version k-1
    log-probs are what the loss sees; the version k log-probs at sampling time (the on-policy old) would give 1."""
    eps = 1e-3
    recorded = [[-0.5000, -0.2500], [0.1000, 0.3000]]  # log p_{k-1}: the sampling policy, recorded at rollout
    live = [[-0.4995, -0.2520], [0.1002, 0.3000]]  # log p_k: the policy being trained
    adv = [1.0, -2.0]
    assert policy_staleness(7, 6, 1) == 1
    loss, m = grpo_clip_loss(torch.tensor(live, dtype=torch.float64), torch.tensor(recorded, dtype=torch.float64),
                             torch.tensor(adv, dtype=torch.float64), eps)
    terms, ratios = [], []
    for i in range(2):
        for j in range(2):
            r = math.exp(live[i][j] - recorded[i][j])
            ratios.append(r)
            clipped = min(max(r, 1 - eps), 1 + eps)
            terms.append(max(-adv[i] * r, -adv[i] * clipped))
    assert loss.item() == pytest.approx(sum(terms) / 4, abs=1e-15)
    assert m["ratio_max"].item() == pytest.approx(max(ratios), abs=1e-15)
    assert m["ratio_min"].item() == pytest.approx(min(ratios), abs=1e-15)
    # exp(-0.002) and exp(0.0005): one element below the band, the other inside
    assert m["clip_fraction"].item() == pytest.approx(sum(abs(r - 1) > eps for r in ratios) / 4)
    on_policy, m0 = grpo_clip_loss(torch.tensor(live, dtype=torch.float64), torch.tensor(live, dtype=torch.float64),
                                   torch.tensor(adv, dtype=torch.float64), eps)
    assert m0["ratio_min"].item() == m0["ratio_max"].item() == 1.0 and on_policy.item() != loss.item()
