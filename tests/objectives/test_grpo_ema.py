"""EMA for GRPO (flow_grpo's train.ema): grpo.ema_decay builds the policy bank's EMA slot, updated after every
optimizer step; held-out evals use it."""

import pytest
import torch

from flowforge.config import ConfigError, load_config
from flowforge.train.trainer import Trainer
from tests.train.test_trainer import tiny_cfg


def test_grpo_ema_tracks_live_and_is_what_evals_see(tiny_model_dir, tmp_path, encode_cache_dir):
    trainer = Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, "train.algorithm=grpo",
                               "grpo.ema_decay=0.5", "train.steps=1"), progress=False)
    assert trainer.objective.eval_policy == "ema" and trainer.policy.has("ema")
    before = {k: v.clone() for k, v in trainer.policy.named_weights("ema").items()}
    trainer.train()
    live, ema = trainer.policy.named_weights("live"), trainer.policy.named_weights("ema")
    moved = [k for k in ema if not torch.equal(ema[k], before[k])]
    assert moved, "the EMA never moved"
    # strictly between the start and live: d = 0.5 blends, it does not copy
    assert any(not torch.equal(ema[k], live[k]) for k in moved)


def test_grpo_without_ema_has_no_ema_slot_and_bad_values_are_refused(tiny_model_dir, tmp_path, encode_cache_dir):
    trainer = Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, "train.algorithm=grpo"), progress=False)
    assert trainer.objective.eval_policy == "live" and not trainer.policy.has("ema")
    with pytest.raises(ConfigError, match=r"grpo.ema_decay=1.0 must be in \[0, 1\)"):
        load_config(None, ["grpo.ema_decay=1.0"])
    with pytest.raises(ConfigError, match=r"grpo.ema_schedule"):
        load_config(None, ["grpo.ema_schedule=linear"])
