"""``flowforge export`` / ``sample`` of a run that kept an EMA (issue 27): by default they take the weights its
held-out evals measured -- the EMA, as flow_grpo saves and evaluates it -- say so in the log, and ``--weights live``
still gives the live ones. A run without an EMA exports its live weights."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from flowforge.cli import main
from flowforge.rollout import candidate_noise, decode_media, generate
from flowforge.tools.export import export_run, read_export_meta
from flowforge.tools.sample import load_for_sampling, read_prompts, sample
from flowforge.train.checkpoint import load_checkpoint
from tests.train.test_trainer import tiny_cfg

PROMPT = "a handwritten seven"


@pytest.fixture(scope="module")
def ema_run(tiny_model_dir, encode_cache_dir, tmp_path_factory):
    """A 2-step GRPO LoRA run with grpo.ema_decay = 0.5 (the EMA strictly between the start and live), and its
    trainer."""
    from flowforge.train.trainer import Trainer

    out = tmp_path_factory.mktemp("ema_runs")
    trainer = Trainer(tiny_cfg(tiny_model_dir, out, encode_cache_dir, "train.algorithm=grpo", "grpo.ema_decay=0.5",
                               "lora.rank=4", "lora.alpha=8", "checkpoint.every=1", "train.lr=1e-2",
                               "run.name=ema"), progress=False)
    return trainer.train(), trainer


def _sha256(tensors):
    from flowforge.tools.export.run import _tensors_sha256

    return _tensors_sha256(tensors)


def test_export_takes_the_ema_by_default_and_says_so(ema_run, tmp_path, caplog):
    run_dir, _ = ema_run
    state = load_checkpoint(sorted((run_dir / "checkpoints").glob("step_*"))[-1])
    assert {"live", "ema"} <= set(state.tensors)
    ema, live = _sha256(state.tensors["ema"]), _sha256(state.tensors["live"])
    assert ema != live
    with caplog.at_level(logging.INFO, logger="flowforge"):
        assert main(["export", str(run_dir), str(tmp_path / "default"), "--form", "adapter"]) == 0
    meta = read_export_meta(tmp_path / "default")
    assert meta["weights"] == "ema" and meta["weights_sha256"] == ema
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("exporting ")]
    assert len(lines) == 1 and "its EMA weights (the ones its held-out evals measured; --weights live" in lines[0]
    explicit = export_run(run_dir, tmp_path / "live", form="adapter", weights="live")
    assert read_export_meta(explicit)["weights"] == "live" and read_export_meta(explicit)["weights_sha256"] == live
    merged = export_run(run_dir, tmp_path / "merged", form="merged", verify=True)  # verified against the EMA
    assert read_export_meta(merged)["weights"] == "ema" and read_export_meta(merged)["verify"]["passed"]


def test_sample_of_the_run_and_its_export_is_the_ema_policy(ema_run, tmp_path):
    run_dir, trainer = ema_run
    export = export_run(run_dir, tmp_path / "adapter", form="adapter")
    records = read_prompts([PROMPT], None, "t2i")
    from_run = load_for_sampling(run_dir)
    assert "(ema weights)" in from_run.source
    media = sample(from_run, records, num=2, seed=3)
    assert (sample(load_for_sampling(export), records, num=2, seed=3) - media).abs().max() <= 1e-5
    x_T = candidate_noise([0, 1], trainer.latent_shape, 3, -1)
    cond = from_run.adapter.encode([PROMPT] * 2)
    with torch.no_grad():
        with trainer.policy.using("ema"):
            expected = decode_media(trainer.adapter, generate(trainer.adapter, cond, x_T, trainer.sigmas, 1.0), 8)
        with trainer.policy.using("live"):
            live = decode_media(trainer.adapter, generate(trainer.adapter, cond, x_T, trainer.sigmas, 1.0), 8)
    assert (media - expected).abs().max() <= 1e-5
    assert (media - live).abs().max() > 1e-4  # not the live policy


def test_a_run_without_ema_exports_live(tiny_model_dir, encode_cache_dir, tmp_path, caplog):
    from flowforge.train.trainer import Trainer

    run_dir = Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, "train.algorithm=grpo", "train.steps=1",
                               "checkpoint.every=1", "run.name=plain"), progress=False).train()
    with caplog.at_level(logging.INFO, logger="flowforge"):
        out = export_run(run_dir, tmp_path / "out", form="adapter")
    assert read_export_meta(out)["weights"] == "live"
    assert any("its live weights (the run kept no EMA)" in r.getMessage() for r in caplog.records)
    assert json.loads((out / "flowforge_export.json").read_text())["weights"] == "live"
