"""Exact resume (bitwise on CPU), crash safety with a real SIGKILL, contract refusal."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from flowforge.train import checkpoint as ckpt
from tests.train.test_trainer import tiny_cfg
from flowforge.train.trainer import Trainer


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/")) and not k.endswith("_time")}
            for r in rows]


def _state(trainer):
    weights = {n: trainer.policy.named_weights(n) for n in ("live", "old") if trainer.policy.has(n)}
    return weights, trainer.policy.optimizer.state_dict()["state"]


def _assert_same(a, b):
    wa, oa = a
    wb, ob = b
    assert wa.keys() == wb.keys()
    for name in wa:
        for k in wa[name]:
            assert torch.equal(wa[name][k], wb[name][k]), (name, k)
    assert oa.keys() == ob.keys()
    for i in oa:
        for k in oa[i]:
            assert torch.equal(torch.as_tensor(oa[i][k]), torch.as_tensor(ob[i][k])), (i, k)


@pytest.mark.parametrize("algorithm,trainable", [("grpo", "lora"), ("grpo", "full"), ("nft", "lora"),
                                                 ("nft", "full")])
@pytest.mark.slow  # end-to-end runs (minutes of CPU together): CI runs them in the slow set
def test_resume_equals_uninterrupted_run(tiny_model_dir, tmp_path, encode_cache_dir, algorithm, trainable):
    extra = [f"train.algorithm={algorithm}", "train.steps=3", "checkpoint.every=1", "eval.every=0",
             "train.lr_schedule=cosine"]
    if trainable == "full":
        extra += ["lora.trainable=full", "train.lr=1e-4"]

    def cfg(name, *more):
        return tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, f"run.name={name}", *extra, *more)

    full = Trainer(cfg("full"), progress=False)
    full.train()
    part = Trainer(cfg("part"), progress=False)
    part.train(stop_at=2)
    del part
    resumed = Trainer(cfg("part", "train.resume=auto"), progress=False)
    assert resumed.step == 2
    resumed.train()
    _assert_same(_state(full), _state(resumed))
    assert _rows(full.run_dir) == _rows(resumed.run_dir)
    # the end eval's change from the start is measured against the step-0 samples the first process kept
    evals = [json.loads(line) for line in (full.run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals == [json.loads(line) for line in (resumed.run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals[0]["eval/sample_change"] == 0.0 and evals[-1]["eval/sample_change"] > 0.0


def test_resume_refuses_a_different_lora_alpha(tiny_model_dir, tmp_path, encode_cache_dir):
    base = ["train.steps=2", "checkpoint.every=1", "lora.rank=4", "lora.alpha=8", "run.name=c"]
    Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, *base), progress=False).train(stop_at=1)
    with pytest.raises(ValueError, match=r"resume refused[\s\S]*lora.alpha: checkpoint 8.0, this run 16.0"):
        Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, *base, "lora.alpha=16", "train.resume=auto"),
                progress=False)


def test_run_dir_inside_the_model_directory_is_refused(tiny_model_dir, tmp_path, encode_cache_dir):
    with pytest.raises(ValueError, match="inside"):
        Trainer(tiny_cfg(tiny_model_dir, tiny_model_dir, encode_cache_dir), progress=False)


@pytest.mark.slow  # end-to-end runs (minutes of CPU together): CI runs them in the slow set
def test_sigkill_during_checkpoint_write_then_auto_resume_completes(tiny_model_dir, tmp_path, encode_cache_dir):
    overrides = [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}", "run.name=k",
                 f"data.cache_dir={encode_cache_dir}", "data.prompts_per_step=2", "data.group_size=4",
                 "sampler.num_steps=4", "sampler.num_sde_steps=2", "train.micro_batch_size=2", "train.steps=3",
                 "checkpoint.every=1", "eval.every=0", "eval.max_prompts=2", "run.num_threads=1"]
    script = textwrap.dedent(f"""
        import os, signal, sys
        from flowforge.train import checkpoint
        from flowforge.config import load_config
        from flowforge.train.trainer import Trainer

        seen = []
        def die(stage, relpath):
            # second checkpoint, its weight file fully written under its temporary name: a hard kill
            if stage == "tmp" and str(relpath).startswith("weights"):
                seen.append(relpath)
                if len(seen) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.save._test_hook = die
        Trainer(load_config(None, {overrides!r}), progress=False).train()
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    run_dir = tmp_path / "k"
    assert (run_dir / "checkpoints" / "step_000002").is_dir()
    assert not ckpt.is_committed(run_dir / "checkpoints" / "step_000002")
    path, notes = ckpt.resolve_resume(run_dir, "auto")
    assert path.name == "step_000001" and any("no COMMITTED" in n for n in notes)
    from flowforge.config import load_config

    trainer = Trainer(load_config(None, overrides + ["train.resume=auto"]), progress=False)
    assert trainer.step == 1
    trainer.train()
    assert ckpt.is_committed(run_dir / "checkpoints" / "step_000003")
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-2:] == [2, 3]


@pytest.mark.parametrize("trainable", ["lora", "full"])
def test_policy_bank_state_dict_round_trip(tiny_model_dir, tmp_path, encode_cache_dir, trainable):
    """The bank is Stateful: live / old weights, AdamW moments, LR schedule and step counter move to another bank."""
    extra = ["train.algorithm=nft", "train.steps=3", "eval.every=0", "train.lr_schedule=cosine"]
    if trainable == "full":
        extra += ["lora.trainable=full", "train.lr=1e-4"]

    def make(name):
        return Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, f"run.name={name}", *extra),
                       progress=False)

    trained = make("a")
    trained.train(stop_at=1)
    state = trained.policy.state_dict()
    assert set(state) == {"weights", "scheduler", "optimizer_steps", "optimizer"}
    assert set(state["weights"]) == {"live", "old"}  # ref is the immutable base: never part of the state
    fresh = make("b")
    fresh.policy.load_state_dict(state)
    _assert_same(_state(trained), _state(fresh))
    assert fresh.policy.optimizer_steps == trained.policy.optimizer_steps > 0
    assert fresh.policy.scheduler.state_dict() == trained.policy.scheduler.state_dict()
    assert fresh.policy.lr == trained.policy.lr


def test_checkpoints_leave_the_run_unchanged_and_an_interrupted_run_without_one_says_so(
        tiny_model_dir, tmp_path, encode_cache_dir):
    """every=1 vs every=0: the same metrics and weights (a save only reads the RNG states). A run stopped after 2 of
    3 steps with every=0 has nothing to resume: resume=auto and export say so; with every=1 resume=auto continues."""
    from flowforge.tools.export.out import ExportError
    from flowforge.tools.export.source import pick_checkpoint

    def cfg(name, *more):
        return tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, f"run.name={name}", "train.steps=3",
                        "eval.every=0", *more)

    never = Trainer(cfg("never", "checkpoint.every=0"), progress=False)
    never.train(stop_at=2)
    saving = Trainer(cfg("saving", "checkpoint.every=1"), progress=False)
    saving.train(stop_at=2)
    assert _rows(never.run_dir) == _rows(saving.run_dir) and len(_rows(never.run_dir)) == 2
    _assert_same(_state(never), _state(saving))

    lost = "the run was interrupted at step 2 of 3 before any checkpoint (checkpoint.every=0)"
    assert ckpt.lost_progress(never.run_dir) == lost and ckpt.lost_progress(saving.run_dir) is None
    path, notes = ckpt.resolve_resume(never.run_dir, "auto")
    assert path is None and notes == [f"{lost}: nothing to resume, starting from step 0; {ckpt.NO_CHECKPOINT_FIX}"]
    with pytest.raises(ExportError, match=r"interrupted at step 2 of 3 before any checkpoint.*checkpoint.every > 0"):
        pick_checkpoint(never.run_dir, None)

    del saving
    resumed = Trainer(cfg("saving", "checkpoint.every=1", "train.resume=auto"), progress=False)
    assert resumed.step == 2
    resumed.train()
    assert [r["step"] for r in _rows(resumed.run_dir)] == [1, 2, 3]


def test_startup_stages_are_logged_with_their_time(tiny_model_dir, tmp_path, encode_cache_dir, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="flowforge"):
        Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir), progress=False)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("loading model ") for line in lines), lines
    assert any(line.startswith("model loaded in ") and "encoding 220 train + 3 eval prompts" in line for line in lines)
    assert any(line.startswith("prompts encoded in ") for line in lines), lines


def test_a_fresh_run_with_resume_auto_says_once_that_it_starts_from_scratch(tiny_model_dir, tmp_path,
                                                                            encode_cache_dir, caplog):
    """Every pipeline stage starts with train.resume=auto: a fresh run directory gives one INFO line, no WARNING
    saying the same (issue 27: a duplicated line on every stage start); a damaged checkpoint still warns."""
    import logging

    with caplog.at_level(logging.INFO, logger="flowforge"):
        Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, "train.resume=auto"), progress=False)
    about = [r for r in caplog.records if "checkpoint" in r.getMessage()]
    assert [(r.levelname, r.getMessage().split(":")[0]) for r in about] == [("INFO", "train.resume=auto")], \
        [r.getMessage() for r in about]
