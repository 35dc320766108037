"""Flow-matching supervised fine-tuning: the digits recipe that makes the embedded default's base policy
(:mod:`.digits`, re-exported here) and the world model's (:mod:`.world`)."""

from __future__ import annotations

from flowforge.train.sft.digits import evaluate_digit_eval, flow_matching_loss, run_sft, run_sft_from_config

__all__ = ["evaluate_digit_eval", "flow_matching_loss", "run_sft", "run_sft_from_config"]
