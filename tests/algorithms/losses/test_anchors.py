"""Anchor-loss math (flowforge.algorithms.losses.anchors): hand-computed values, the training schedule, refusals."""

import math

import pytest
import torch

from flowforge.algorithms.losses import anchors


def test_training_schedule_is_its_own_1000_sigmas():
    s = anchors.training_sigmas()
    assert s.shape == (1000,) and float(s[0]) == 1.0 and float(s[-1]) == pytest.approx(1e-3)
    assert bool((s[1:] < s[:-1]).all()) and bool((s > 0).all())
    gen = torch.Generator().manual_seed(0)
    drawn = anchors.draw_training_sigmas(s, 64, gen)
    assert drawn.shape == (64,) and all(float(d) in set(s.tolist()) for d in drawn)


def test_fm_loss_by_hand_and_noised():
    x0 = torch.tensor([[1.0, -1.0], [0.0, 0.5]])
    noise = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    v = torch.tensor([[-1.0, 2.0], [0.0, 0.0]])
    loss, m = anchors.anchor_fm_loss(v, x0, noise)
    # target noise - x0 = [[-1, 2], [1, 0.5]]: clip errors 0 and (1 + 0.25) / 2
    assert float(loss) == pytest.approx(0.3125) and float(m["fm_loss_max"]) == pytest.approx(0.625)
    x = anchors.noised(x0, noise, torch.tensor([0.25, 1.0]))
    assert torch.allclose(x, torch.tensor([[0.75, -0.5], [1.0, 1.0]]))
    with pytest.raises(ValueError, match="share"):
        anchors.anchor_fm_loss(v, x0[:1], noise)


def test_row_weights_and_the_weighted_fm_loss_by_hand():
    w = anchors.row_weights(4, 1, 5.0)  # [1, 1, 1, 5] / 2
    assert w.tolist() == [0.5, 0.5, 0.5, 2.5] and float(w.mean()) == 1.0
    assert torch.equal(anchors.row_weights(4, 0, 5.0), torch.ones(4))
    assert torch.equal(anchors.row_weights(4, 2, 1.0), torch.ones(4))
    for rows, weight in ((5, 2.0), (-1, 2.0), (1, 0.0)):
        with pytest.raises(ValueError, match="rows"):
            anchors.row_weights(4, rows, weight)
    # clip 0: errors 1 on row 0 and 4 on row 1 (2 columns each); clip 1: 0 everywhere
    x0, noise = torch.zeros(2, 2, 2), torch.zeros(2, 2, 2)
    v = torch.zeros(2, 2, 2)
    v[0, 0], v[0, 1] = 1.0, 2.0
    weight = anchors.row_weights(2, 1, 3.0).view(1, 2, 1)  # [0.5, 1.5]
    loss, m = anchors.anchor_fm_loss(v, x0, noise, weight)
    assert float(m["fm_loss_max"]) == pytest.approx((0.5 * 1 + 1.5 * 4) / 2)  # per-clip mean over 4 elements
    assert float(loss) == pytest.approx((0.5 * 1 + 1.5 * 4) / 4)
    assert torch.equal(anchors.anchor_fm_loss(v, x0, noise, torch.ones(1, 2, 1))[0], anchors.anchor_fm_loss(v, x0, noise)[0])
    with pytest.raises(ValueError, match="broadcast"):
        anchors.anchor_fm_loss(v, x0, noise, torch.ones(3, 1, 1))


def test_transition_ce_by_hand():
    logits = torch.zeros(1, 1, 2, 3)
    logits[0, 0, 0] = torch.tensor([2.0, 0.0, 0.0])
    labels = torch.tensor([[[0, 2]]])
    loss, m = anchors.transition_ce_loss(logits, labels)
    ce0 = -math.log(math.exp(2) / (math.exp(2) + 2))
    assert float(loss) == pytest.approx((ce0 + math.log(3)) / 2, rel=1e-6)
    assert float(m["trans_accuracy"]) == 0.5  # token 0 right; token 1 argmax 0 (a tie) != 2
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        anchors.transition_ce_loss(logits, labels + 5)


def test_combine_skips_absent_and_zero_weight_terms():
    a, b = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0)
    loss, m = anchors.combine_anchor_terms({"fm": a, "trans": b, "ref": None}, {"fm": 0.1, "trans": 0.0, "ref": 1.0})
    assert float(loss.detach()) == pytest.approx(0.2) and set(m) == {"fm"} and loss.requires_grad
    loss, m = anchors.combine_anchor_terms({"fm": None}, {"fm": 0.1})
    assert float(loss) == 0.0 and m == {}
    with pytest.raises(ValueError, match="weight"):
        anchors.combine_anchor_terms({"fm": a}, {})
