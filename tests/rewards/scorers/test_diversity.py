"""group_diversity: hand-computed distances, the pool=1 link to the eval metric, pooling damps speckle, refusals,
and whole groups through the reward processor."""

import pytest
import torch

from flowforge.rewards.processor import RewardProcessor
from flowforge.rewards.registry import build_scorer
from flowforge.rewards.scorers.diversity import GroupDiversity
from flowforge.train.metrics import within_group_diversity


def _meta(k):
    return ["p"] * k, [{}] * k


def test_hand_computed_three_constant_images():
    # constant images 0, 0.5, 1: RMS distances 0.5 / 1.0 / 0.5 -> leave-one-out means 0.75, 0.5, 0.75
    media = torch.stack([torch.full((3, 4, 4), v) for v in (0.0, 0.5, 1.0)])
    scores = GroupDiversity(pool=2)(media, *_meta(3))
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor([0.75, 0.5, 0.75]))


def test_pool_one_group_mean_is_the_eval_metric():
    g = torch.Generator().manual_seed(0)
    media = torch.rand(5, 3, 8, 8, generator=g)
    scores = GroupDiversity(pool=1)(media, *_meta(5))
    metric = within_group_diversity(media, torch.zeros(5, dtype=torch.long))
    torch.testing.assert_close(scores.mean(), metric)


def test_pooling_damps_checkerboard_speckle_but_keeps_shape_changes():
    base = torch.zeros(2, 3, 8, 8)
    speckle = base.clone()
    speckle[1, :, ::2, ::2] = 1.0  # one lit pixel in every 2x2 block: big pixel distance, flat after pooling
    shape = base.clone()
    shape[1, :, :4, :] = 0.25  # a half-image change, uniform within every 2x2 block
    raw = GroupDiversity(pool=1)
    pooled = GroupDiversity(pool=2)
    assert raw(speckle, *_meta(2))[0] == pytest.approx(0.5)
    assert pooled(speckle, *_meta(2))[0] == pytest.approx(0.25)  # block means 0.25 everywhere
    assert pooled(shape, *_meta(2))[0] == pytest.approx(raw(shape, *_meta(2))[0])  # blocks already uniform


def test_group_of_one_is_nan_and_bad_inputs_refused():
    assert torch.isnan(GroupDiversity()(torch.rand(1, 3, 4, 4), *_meta(1))).all()
    with pytest.raises(ValueError, match="pool"):
        GroupDiversity(pool=0)
    with pytest.raises(ValueError, match="divide"):
        GroupDiversity(pool=3)(torch.rand(2, 3, 4, 4), *_meta(2))
    with pytest.raises(ValueError, match="one group"):
        GroupDiversity()(torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}])


def test_processor_calls_it_once_per_group():
    torch.manual_seed(0)
    media = torch.rand(6, 3, 4, 4)
    prompts = ["a"] * 3 + ["b"] * 3
    proc = RewardProcessor({"group_diversity": build_scorer("group_diversity", pool=2)}, {"group_diversity": 1.0})
    components, metrics = proc(media, prompts, [{}] * 6, torch.tensor([0, 0, 0, 1, 1, 1]))
    expect = torch.cat([GroupDiversity(pool=2)(media[:3], *_meta(3)), GroupDiversity(pool=2)(media[3:], *_meta(3))])
    torch.testing.assert_close(components["group_diversity"], expect)
    assert metrics["reward/group_diversity_groups_scored"] == 2
