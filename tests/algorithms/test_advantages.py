"""Group advantages, degenerate groups, component combination, NFT reward transform."""
import pytest
import torch

from flowforge.algorithms import (
    clip_advantages,
    combine_components,
    group_advantages,
    group_stats,
    nft_optimality,
)

F64 = torch.float64


def _slow_reference(rewards, groups, std_mode, eps, std_floor):
    """Loop reference written here, independent of the vectorized code."""
    r = rewards.tolist()
    out = []
    for i, g in enumerate(groups):
        members = [r[j] for j in range(len(r)) if groups[j] == g]
        mean = sum(members) / len(members)
        pool = members if std_mode == "group" else r
        pm = sum(pool) / len(pool)
        std = (sum((p - pm) ** 2 for p in pool) / len(pool)) ** 0.5
        out.append(r[i] - mean if std_mode == "none" else (r[i] - mean) / (max(std, std_floor) + eps))
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize("std_mode", ["group", "batch", "none"])
@pytest.mark.parametrize("std_floor", [0.0, 0.5])
def test_matches_slow_loop_reference(std_mode, std_floor):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=g, dtype=F64)
    groups = torch.randint(0, 5, (24,), generator=g).tolist()
    adv = group_advantages(rewards, torch.tensor(groups), std_mode=std_mode, std_floor=std_floor)
    torch.testing.assert_close(adv, _slow_reference(rewards, groups, std_mode, 1e-4, std_floor), rtol=0, atol=1e-12)
    adv_list = group_advantages(rewards, [f"prompt {k}" for k in groups], std_mode=std_mode, std_floor=std_floor)
    torch.testing.assert_close(adv_list, adv, rtol=0, atol=0)


def test_hand_computed_group():
    adv = group_advantages(torch.tensor([1.0, 3.0, 10.0, 10.0]), [0, 0, 1, 1], eps=0.0, std_floor=1e-8)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0]))


def test_near_tie_is_finite_and_bounded_eps_dominates():
    r = torch.tensor([0.3, 0.3, 0.3 + 1e-9], dtype=F64)
    adv = group_advantages(r, [0, 0, 0])
    assert bool(torch.isfinite(adv).all())
    # std ~ 4.7e-10 << eps: |A| <= |r - mean| / eps ~ 7e-6
    assert adv.abs().max().item() <= (2e-9 / 3) / 1e-4 * (1 + 1e-6)
    assert adv.abs().max().item() > 0


def test_all_tie_batch_gives_zeros_and_is_reported_degenerate():
    r = torch.tensor([0.5, 0.5, 0.2, 0.2, 0.9, 0.9])
    ids = ["a", "a", "b", "b", "c", "c"]
    for mode in ("group", "batch", "none"):
        assert torch.equal(group_advantages(r, ids, std_mode=mode), torch.zeros(6))
    stats = group_stats(r, ids)
    assert stats.labels == ("a", "b", "c")
    assert torch.equal(stats.degenerate, torch.tensor([True, True, True]))
    assert stats.degenerate_fraction.item() == 1.0
    mixed = group_stats(torch.tensor([0.5, 0.5, 0.2, 0.3]), ["a", "a", "b", "b"])
    assert mixed.degenerate_fraction.item() == 0.5
    assert torch.equal(mixed.size, torch.tensor([2, 2]))
    torch.testing.assert_close(mixed.std, torch.tensor([0.0, 0.05]))


def test_group_of_one_gives_zero():
    adv = group_advantages(torch.tensor([5.0, 1.0, 2.0]), [0, 1, 1])
    assert adv[0].item() == 0.0 and adv[1].item() < 0 < adv[2].item()


def test_nan_reward_raises_naming_the_group():
    r = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    with pytest.raises(ValueError, match="prompt-B"):
        group_advantages(r, ["prompt-A", "prompt-B", "prompt-B", "prompt-A"])
    with pytest.raises(ValueError, match=r"\[7\]"):
        group_advantages(r, torch.tensor([3, 7, 7, 3]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(std_mode="global"), "group"),
    (dict(eps=-1.0), "eps"),
    (dict(eps=0.0, std_floor=0.0), "eps"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.tensor([1.0, 2.0]), [0, 0], **kwargs)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="entries"):
        group_advantages(torch.tensor([1.0, 2.0]), [0])


def test_combine_weighted_sum_and_per_component():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, generator=g), 100 * torch.randn(8, generator=g)
    ids = [0, 0, 0, 0, 1, 1, 1, 1]
    comps = {"a": a, "b": b, "na": torch.full((8,), float("nan"))}
    ws = combine_components(comps, {"a": 1.0, "b": 0.5, "na": 0.0}, ids)
    torch.testing.assert_close(ws, group_advantages(a + 0.5 * b, ids))
    pc = combine_components(comps, {"a": 1.0, "b": 0.5}, ids, mode="per_component")
    torch.testing.assert_close(pc, group_advantages(a, ids) + 0.5 * group_advantages(b, ids))
    assert not torch.allclose(pc, ws)
    # one unit-weight component: both modes agree
    torch.testing.assert_close(combine_components(comps, {"a": 1.0}, ids, mode="per_component"),
                               combine_components(comps, {"a": 1.0}, ids))
    rn = combine_components(comps, {"a": 1.0, "b": 0.5}, ids, mode="per_component", renormalize=True)
    assert abs(rn.mean().item()) < 1e-5 and abs(rn.std(unbiased=False).item() - 1) < 1e-3
    ws_batch = combine_components(comps, {"a": 1.0}, ids, std_mode="batch")
    torch.testing.assert_close(ws_batch, group_advantages(a, ids, std_mode="batch"))


def test_combine_errors():
    ids = ["p", "p", "q", "q"]
    comps = {"clip": torch.tensor([1.0, 2.0, float("nan"), 0.0]), "ocr": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"'clip'.*\['q'\]"):
        combine_components(comps, {"clip": 1.0, "ocr": 1.0}, ids)
    combine_components(comps, {"clip": 0.0, "ocr": 1.0}, ids)  # NaN allowed in a zero-weight component
    with pytest.raises(ValueError, match="available"):
        combine_components(comps, {"aesthetic": 1.0}, ids)
    with pytest.raises(ValueError, match="weighted_sum"):
        combine_components(comps, {"ocr": 1.0}, ids, mode="gdpo")
    with pytest.raises(ValueError, match="nonzero"):
        combine_components(comps, {"ocr": 0.0}, ids)


def test_clip_and_nft_optimality():
    a = torch.tensor([-9.0, -5.0, -2.5, 0.0, 2.5, 5.0, 9.0])
    torch.testing.assert_close(clip_advantages(a, 5.0), torch.tensor([-5.0, -5.0, -2.5, 0.0, 2.5, 5.0, 5.0]))
    torch.testing.assert_close(nft_optimality(a, 5.0), torch.tensor([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]))
    with pytest.raises(ValueError, match="clip"):
        clip_advantages(a, 0.0)
    with pytest.raises(ValueError, match="adv_clip"):
        nft_optimality(a, -1.0)
