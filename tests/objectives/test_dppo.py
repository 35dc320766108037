"""Flow-DPPO on the real loop (tiny random SD3): stored means, first ratio exactly 1, the mask, its section."""

import math

import pytest

from flowforge.config import ConfigError, load_config
from tests.train.test_trainer import one_step, read_jsonl, train_batch


def test_dppo_first_update_ratio_is_one_and_nothing_masked(make):
    trainer = make("train.algorithm=dppo")
    sb, traj, cond, adv, total = one_step(trainer)
    assert traj.means is not None and traj.means.shape == traj.latents.shape
    m = trainer.objective.optimize(train_batch(sb, traj, cond, adv, total))
    assert float(m["first_update_ratio_dev"]) == 0.0
    # the second update moved the weights: the metrics of both updates are averaged, the mask is reported
    assert "masked_fraction" in m and 0.0 <= float(m["masked_fraction"]) <= 1.0


def test_dppo_tiny_delta_masks_the_second_update(make):
    """With a threshold far below any real step's KL, every second-update step that moves further in its
    advantage's direction is masked; with delta=inf nothing is."""
    tight = make("train.algorithm=dppo", "dppo.delta=1e-30", "train.lr=1e-2", name="tight")
    sb, traj, cond, adv, total = one_step(tight)
    m = tight.objective.optimize(train_batch(sb, traj, cond, adv, total))
    assert float(m["masked_fraction"]) > 0.0
    loose = make("train.algorithm=dppo", "dppo.delta=.inf", "train.lr=1e-2", name="loose")
    sb, traj, cond, adv, total = one_step(loose)
    m = loose.objective.optimize(train_batch(sb, traj, cond, adv, total))
    assert float(m["masked_fraction"]) == 0.0


def test_dppo_trains_two_steps(make):
    run_dir = make("train.algorithm=dppo", name="run").train()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    assert rows[0]["train/first_update_ratio_dev"] == 0.0


@pytest.mark.parametrize("override, key", [("dppo.delta=0", "dppo.delta"), ("dppo.delta=-1", "dppo.delta"),
                                           ("dppo.adv_clip=0", "dppo.adv_clip")])
def test_dppo_section_validates_itself(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["train.algorithm=dppo", override])
