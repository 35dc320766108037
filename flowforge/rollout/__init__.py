"""Rollout: the one denoising loop (sample, replay, generate) and the noise-seed slots it draws from."""

from flowforge.rollout.loop import (ALL, RolloutSpec, Trajectory, denoise, generate, generated_index, replay_log_prob,
                                    rollout, rollout_chunked, sigmas_for, with_condition)
from flowforge.rollout.noise import candidate_noise, candidate_randint

__all__ = ["ALL", "RolloutSpec", "Trajectory", "candidate_noise", "candidate_randint", "denoise", "generate",
           "generated_index", "replay_log_prob", "rollout", "rollout_chunked", "sigmas_for", "with_condition"]
