"""EMA and old-policy decay schedules: hand-computed warm-up values, parity with NVlabs DiffusionNFT's formulas
(transcribed here), the reference presets, errors."""
import math

import pytest

from flowforge.algorithms.ema import (
    EMA_SCHEDULES,
    NFT_DECAY_TYPES,
    OLD_DECAY_SCHEDULES,
    ema_decay,
    old_policy_decay,
)


def _nvlabs_ema_decay(optimization_step, decay):
    """NVlabs/DiffusionNFT ``flow_grpo/ema.py`` ``EMAModuleWrapper.get_current_decay``, transcribed."""
    return min((1 + optimization_step) / (10 + optimization_step), decay)


def _nvlabs_return_decay(step, decay_type):
    """NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` ``return_decay``, transcribed."""
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


def test_ema_warmup_hand_computed():
    assert ema_decay(0, schedule="warmup", decay=0.9) == 1 / 10  # (1 + 0) / (10 + 0)
    assert ema_decay(1, schedule="warmup", decay=0.9) == 2 / 11  # the first update (n counts it): 0.1818
    assert ema_decay(10, schedule="warmup", decay=0.9) == 11 / 20  # 0.55
    assert ema_decay(100, schedule="warmup", decay=0.9) == 0.9  # 101 / 110 = 0.918 > cap
    assert ema_decay(100, schedule="warmup", decay=0.999) == 101 / 110
    assert ema_decay(79, schedule="warmup", decay=0.9) == 80 / 89 < 0.9  # the cap binds from n = 80
    assert ema_decay(80, schedule="warmup", decay=0.9) == 0.9
    for n in (0, 1, 10, 100, 10_000):
        assert ema_decay(n, decay=0.9) == 0.9 and ema_decay(n, schedule="constant", decay=0.9) == 0.9


def test_ema_warmup_matches_nvlabs_and_forgets_the_base():
    for n in range(0, 300):
        for cap in (0.9, 0.99, 0.0):
            assert ema_decay(n, schedule="warmup", decay=cap) == _nvlabs_ema_decay(n, cap)
    # Weight the base keeps after 10 updates (n = 1..10): 0.9^10 = 0.35 with the constant decay, 6.0e-5 warmed up.
    keep_const = math.prod(ema_decay(n, decay=0.9) for n in range(1, 11))
    keep_warm = math.prod(ema_decay(n, schedule="warmup", decay=0.9) for n in range(1, 11))
    assert keep_const == pytest.approx(0.3486784401, rel=1e-12)
    assert keep_warm == pytest.approx(math.factorial(11) * math.factorial(10) / math.factorial(20), rel=1e-12)


def test_old_policy_decay_schedules_hand_computed():
    assert old_policy_decay(0) == 0.0 and old_policy_decay(100) == pytest.approx(0.1) and old_policy_decay(2000) == 0.5
    kw = dict(schedule="flat_ramp", flat_steps=75, decay_rate=0.0075, decay_max=0.999)
    assert old_policy_decay(0, **kw) == 0.0 and old_policy_decay(74, **kw) == 0.0 and old_policy_decay(75, **kw) == 0.0
    assert old_policy_decay(76, **kw) == 0.0075
    assert old_policy_decay(100, **kw) == pytest.approx(25 * 0.0075)  # 0.1875
    assert old_policy_decay(208, **kw) == pytest.approx(0.9975)  # 133 * 0.0075
    assert old_policy_decay(209, **kw) == 0.999  # 134 * 0.0075 = 1.005 -> the cap


def test_old_policy_decay_matches_nvlabs_return_decay_for_every_decay_type():
    for decay_type, preset in NFT_DECAY_TYPES.items():
        for n in (0, 1, 2, 10, 74, 75, 76, 100, 208, 209, 499, 500, 501, 1000, 5000):
            assert old_policy_decay(n, **preset) == _nvlabs_return_decay(n, decay_type), (decay_type, n)
    # "linear" is exactly the expression flowforge's old-policy decay has used: min(decay_rate * n, decay_max).
    for n in range(0, 700, 7):
        assert old_policy_decay(n, decay_rate=0.001, decay_max=0.5) == min(0.001 * n, 0.5)


def test_decay_schedule_errors():
    assert EMA_SCHEDULES == ("constant", "warmup") and OLD_DECAY_SCHEDULES == ("linear", "flat_ramp")
    with pytest.raises(ValueError, match="constant"):
        ema_decay(1, schedule="cosine", decay=0.9)
    with pytest.raises(ValueError, match="decay"):
        ema_decay(1, decay=1.5)
    with pytest.raises(ValueError, match="int >= 0"):
        ema_decay(-1, decay=0.9)
    with pytest.raises(ValueError, match="int >= 0"):
        ema_decay(1.5, decay=0.9)
    with pytest.raises(ValueError, match="flat_ramp"):
        old_policy_decay(3, schedule="type2")
    with pytest.raises(ValueError, match="flat_ramp"):
        old_policy_decay(3, flat_steps=75)  # a flat start needs the flat_ramp schedule
    with pytest.raises(ValueError, match="decay_rate"):
        old_policy_decay(3, decay_rate=-0.1)
    with pytest.raises(ValueError, match="decay_max"):
        old_policy_decay(3, decay_max=1.1)
    with pytest.raises(ValueError, match="int >= 0"):
        old_policy_decay(3, schedule="flat_ramp", flat_steps=-1)
