"""Rollout: the one denoising loop (sample, replay, generate), the noise-seed slots it draws from, and the decode of
its clean latents into media for the rewards."""

from flowforge.media import video_frames
from flowforge.rollout.loop import (ALL, RolloutSpec, Trajectory, denoise, generate, generated_index, replay_log_prob,
                                    rollout, rollout_chunked, rollout_grouped, sigmas_for, with_condition)
from flowforge.rollout.media import decode_audio, decode_media, decode_needed
from flowforge.rollout.noise import candidate_noise, candidate_randint

__all__ = ["ALL", "RolloutSpec", "Trajectory", "candidate_noise", "candidate_randint", "decode_audio", "decode_media",
           "decode_needed", "denoise", "generate", "generated_index", "replay_log_prob", "rollout", "rollout_chunked",
           "rollout_grouped", "sigmas_for", "video_frames", "with_condition"]
