"""The world model on the real training loop (demo:world, real Breakout start frames): FlowGRPO on video latents
with the first update's ratio exactly 1 and slot 0 pinned in every rollout, whole videos to action_following, the
anchors in module and coupling-LoRA mode."""

import json
import pathlib

import pytest
import torch

from flowforge.config import load_config
from flowforge.objectives.anchors import REACH_FLOOR
from flowforge.train.trainer import Trainer

B_MODULE = ["lora.trainable=module", "lora.modules=[latent_state_rollout.transition]"]
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "worldmodel" / "nft.yaml"
LORA = ["lora.trainable=lora", "lora.modules=null", "lora.rank=8", "lora.alpha=16"]


def _trainer(tmp_path, cache, algorithm, *extra):
    cfg = load_config(EXAMPLE, [
        f"run.output_dir={tmp_path}", f"run.name={algorithm}", f"data.cache_dir={cache}",
        f"train.algorithm={algorithm}",
        "data.prompts_per_step=2", "data.group_size=2", "sampler.num_steps=4", "sampler.sde_kind=sde",
        "sampler.noise_level=0.7", "sampler.num_sde_steps=2", "train.micro_batch_size=2", "train.steps=1",
        "train.allow_unit_ratio=true", "forward.sigma_mode=uniform_schedule", "anchor.episodes=8",
        "anchor.batch_size=2", "eval.max_prompts=2", "eval.every=0", "eval.scorers=[world_psnr]",
        # realism as the training reward: it varies within every group, so every step updates (the paddle rule can
        # give a whole group one value, and NFT then takes no step)
        "reward.weights={world_psnr: 1.0, action_following: 0.5}", "reward.required=[world_psnr]", *extra])
    return Trainer(cfg, progress=False)


def _metrics(trainer):
    return [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()][-1]


def test_grpo_on_video_latents_ratio_exactly_one_slot_zero_pinned(tmp_path, encode_cache_dir):
    trainer = _trainer(tmp_path, encode_cache_dir, "grpo", *B_MODULE)
    batch = trainer.next_prompts()
    traj, cond = trainer.sample(batch, 0)
    assert traj.final.shape[1:] == (1, 8, 32, 32)
    assert torch.equal(traj.final[:, :, :1], cond.image)  # bit-equal to the real first frame
    assert torch.equal(traj.latents[:, :, :, :1], cond.image[:, None].expand(-1, traj.latents.shape[1], -1, -1, -1, -1))
    before = {n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters()}
    trainer.train()
    row = _metrics(trainer)
    assert row["train/first_update_ratio_dev"] == 0.0
    assert "reward/action_following_mean" in row
    # demo:world's gates (up to 0.019) let the FM anchor reach B by size (with gates ~0 it would not:
    # tests/objectives/test_anchors.py); the transition CE reaches B whatever the gates
    n_b = len(list(trainer.adapter.transformer.latent_state_rollout.transition.parameters()))
    assert row["train/anchor_fm_reach"] == n_b and trainer.objective.anchor.paths["fm"] == n_b
    assert row["train/anchor_trans_reach"] == n_b
    changed = {n for n, p in trainer.adapter.transformer.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("latent_state_rollout.transition.") for n in changed)
    evals = [json.loads(line) for line in (trainer.run_dir / "eval.jsonl").read_text().splitlines()]
    assert "eval/world_psnr" in evals[-1] and "eval/action_following" in evals[-1]
    from flowforge.runtime.run_dir import sample_grid_path
    from flowforge.report.grids import read_grid_cells

    cells = read_grid_cells(sample_grid_path(trainer.run_dir, 1))  # the report writes each action under its frame
    assert cells and all([f["label"] for f in c["frames"]] == c["prompt"].upper().split() for c in cells)


@pytest.mark.slow  # end-to-end runs (minutes of CPU together): CI runs them in the slow set
def test_nft_coupling_lora_reports_no_transition_anchor(tmp_path, encode_cache_dir):
    trainer = _trainer(tmp_path, encode_cache_dir, "nft", *LORA)
    trainer.train()
    row = _metrics(trainer)
    assert row["train/anchor_trans_reach"] == 0.0 and "train/anchor_trans" not in row
    assert trainer.objective.anchor.paths["fm"] == 2 * 4 * 4  # a path to lora_A / lora_B of q, k, v, out, 4 blocks
    # ... and demo:world's gates (0.019 at most) let it reach lora_B of each by size (lora_A's gradient is 0 at init)
    assert row["train/anchor_fm_reach"] == 4 * 4 and trainer.objective.anchor.leverage["fm"] >= REACH_FLOOR
    assert row["train/grad_norm_fm_coupling_lora"] > 0 and row["train/grad_norm_rl_coupling_lora"] > 0
    assert row["train/coupling_gate_0"] == pytest.approx(0.019036, abs=1e-6)  # not trained in coupling-LoRA mode


def straight_and_resumed(tmp_path, cache, *extra):
    """``(full, resumed)``: an NFT world run of 3 steps straight and one of 2 steps + ``train.resume=auto``."""
    extra = ("train.steps=3", "checkpoint.every=1", *extra)
    full = _trainer(tmp_path, cache, "nft", *extra)
    full.train()
    part = _trainer(tmp_path / "p", cache, "nft", *extra)
    part.train(stop_at=2)
    del part
    resumed = _trainer(tmp_path / "p", cache, "nft", *extra, "train.resume=auto")
    assert resumed.step == 2
    resumed.train()
    return full, resumed


@pytest.mark.slow  # end-to-end runs (minutes of CPU together): CI runs them in the slow set
def test_world_model_resume_equals_uninterrupted_run(tmp_path, encode_cache_dir):
    """Module mode with both anchors on: the real-clip anchor stream, the policy bank of the trained submodules and
    the optimizer resume bit-exactly (3 steps straight vs 2 steps + resume)."""
    from tests.train.test_resume import _assert_same, _rows, _state

    full, resumed = straight_and_resumed(tmp_path, encode_cache_dir, "anchor.fm_weight=0.1",
                                         "anchor.trans_weight=0.01")
    _assert_same(_state(full), _state(resumed))
    rows = _rows(full.run_dir)
    assert rows == _rows(resumed.run_dir) and rows[-1]["train/anchor_fm"] > 0


def test_provenance_saved_in_the_run_and_an_output_dir_in_the_source_refused(tmp_path, encode_cache_dir, caplog):
    """The provenance of every loaded tensor is a file of the run (the log has one summary line); a run directory
    inside the shipped demo:world checkpoint is refused before anything is written."""
    from flowforge.demo.paths import demo_world_dir
    from flowforge.runtime.run_dir import MODEL_PROVENANCE_FILE

    with caplog.at_level("INFO"):
        trainer = _trainer(tmp_path, encode_cache_dir, "nft", *B_MODULE)
    record = json.loads((trainer.run_dir / MODEL_PROVENANCE_FILE).read_text())
    assert {t["status"] for t in record["tensors"]} == {"loaded"} and len(record["tensors"]) > 50
    assert record["sources"][0]["realpath"].endswith("diffusion_pytorch_model.safetensors")
    lines = [r.getMessage() for r in caplog.records if "world model provenance" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "loaded" in lines[0]
    trainer.close()
    before = sorted(p.name for p in demo_world_dir().iterdir())
    with pytest.raises(ValueError, match="source model directory"):
        _trainer(demo_world_dir(), encode_cache_dir, "nft", *B_MODULE)
    assert sorted(p.name for p in demo_world_dir().iterdir()) == before
