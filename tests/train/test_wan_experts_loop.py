"""Wan 2.2 A14B (two experts) on the real training loop: a saved tiny two-expert ``WanPipeline`` directory loaded by
the trainer through ``model.adapter=wan``; GRPO (first ratio exactly 1 with CFG) and NFT (forward process at random
per-row sigmas, so batches straddle the boundary) 2-step LoRA runs on both / one expert; the checkpoint keeps the
trained experts' LoRA; both export forms, verified."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flowforge.models.wan.experts import EXPERTS, WanExperts
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


LOW_ONLY = [f"transformer_2.blocks.0.{t}" for t in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q")]
"""``lora.targets`` naming low-noise-expert modules only (the tiny experts have one block each)."""


@pytest.mark.parametrize("algorithm", ["grpo", "nft"])
def test_two_expert_wan_trains_and_exports(algorithm, experts_dir, prompt_files, tmp_path):  # noqa: F811
    """GRPO: LoRA on both experts (the default targets); NFT: on the low-noise expert only. Then both export forms,
    verified (the probe has one row per expert)."""
    from diffusers import WanPipeline

    from flowforge.tools.export import export_run, read_export_meta
    from flowforge.tools.export.wan_experts import LORA_FILES
    from flowforge.train.trainer import Trainer

    guidance = GUIDANCE["wan"] if algorithm == "grpo" else 1.0
    targets = [] if algorithm == "grpo" else [f"lora.targets=[{', '.join(LOW_ONLY)}]"]
    cfg = family_cfg("wan", experts_dir, tmp_path / "runs", tmp_path / "cache", prompt_files,
                     f"run.name=a14b-{algorithm}", f"train.algorithm={algorithm}", "lora.rank=4", "lora.alpha=8",
                     f"sampler.guidance_scale={guidance}", "checkpoint.every=2", *targets)
    trainer = Trainer(cfg, progress=False)
    assert isinstance(trainer.adapter.transformer, WanExperts)
    assert trainer.adapter.transformer.expert_of(trainer.sigmas[:-1]) == [EXPERTS[0]] * 2 + [EXPERTS[1]] * 2
    run_dir = train_and_check(trainer, algorithm)
    weights = load_file(str(run_dir / "checkpoints" / "step_000002" / "weights" / "live.safetensors"))
    trained = set(EXPERTS) if algorithm == "grpo" else {"transformer_2"}
    assert {k.split(".")[0] for k in weights} == trained  # the checkpoint keeps each trained expert's LoRA
    assert all(torch.isfinite(v).all() for v in weights.values())

    merged = export_run(run_dir, tmp_path / "merged", form="merged", verify=True)
    report = read_export_meta(merged)["verify"]
    assert report["passed"] and report["base_diff"] > 1e-6, report
    pipe = WanPipeline.from_pretrained(str(merged), local_files_only=True)
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == BOUNDARY
    adapter = export_run(run_dir, tmp_path / "adapter", form="adapter", verify=True)
    report = read_export_meta(adapter)["verify"]
    assert report["passed"] and report["max_abs_diff"] == 0.0, report
    assert {n for n, f in LORA_FILES.items() if (adapter / f).is_file()} == trained
