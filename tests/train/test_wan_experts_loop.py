"""Wan 2.2 A14B (two experts) on the real training loop: a saved tiny two-expert ``WanPipeline`` directory loaded by
the trainer through ``model.adapter=wan``; GRPO (first ratio exactly 1 with CFG) and NFT (forward process at random
per-row sigmas, so batches straddle the boundary) 2-step LoRA runs; the checkpoint keeps both experts' LoRA."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flowforge.models.wan_experts import EXPERTS, WanExperts
from tests.train.test_families_loop import (EXTRA_WORDS, GUIDANCE, family_cfg, prompt_files,  # noqa: F401 (fixture)
                                            train_and_check)
from tests.models import tiny_families as tiny

BOUNDARY = 0.8
"""The trainer's 4-step Wan schedule at shift 3 is sigma 1, 0.9, 0.75, 0.5: two steps per expert."""


@pytest.fixture(scope="module")
def experts_dir(tmp_path_factory):
    from diffusers import WanPipeline

    mp = pytest.MonkeyPatch()
    mp.setattr(tiny, "WORDS", list(tiny.WORDS) + EXTRA_WORDS)  # > 1000 tokens: passes the loader's guard
    try:
        c = tiny.wan_components(0)
        c["transformer_2"] = tiny.wan_components(1)["transformer"]
    finally:
        mp.undo()
    path = tmp_path_factory.mktemp("tiny_wan_a14b")
    WanPipeline(**c, boundary_ratio=BOUNDARY).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("algorithm", ["grpo", "nft"])
def test_two_expert_wan_trains_on_the_real_loop(algorithm, experts_dir, prompt_files, tmp_path):  # noqa: F811
    from flowforge.train.trainer import Trainer

    guidance = GUIDANCE["wan"] if algorithm == "grpo" else 1.0
    cfg = family_cfg("wan", experts_dir, tmp_path / "runs", tmp_path / "cache", prompt_files,
                     f"run.name=a14b-{algorithm}", f"train.algorithm={algorithm}",
                     f"sampler.guidance_scale={guidance}", "checkpoint.every=2")
    trainer = Trainer(cfg, progress=False)
    assert isinstance(trainer.adapter.transformer, WanExperts)
    assert trainer.adapter.transformer.expert_of(trainer.sigmas[:-1]) == [EXPERTS[0]] * 2 + [EXPERTS[1]] * 2
    run_dir = train_and_check(trainer, algorithm)
    weights = run_dir / "checkpoints" / "step_000002" / "weights" / "live.safetensors"
    keys = load_file(str(weights)).keys()
    assert {k.split(".")[0] for k in keys} == set(EXPERTS)  # both experts' LoRA saved
    assert all(torch.isfinite(v).all() for v in load_file(str(weights)).values())
