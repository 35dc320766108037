"""``train.max_staleness``: s = 0 is today's run bit for bit; s = 1 rolls the next step out in the workers while the
trainer updates, tags and logs the version, trains with the ratio against it, and resumes exactly."""

import json
import signal

import pytest
import torch

from flowforge.runtime.interrupt import Interrupted
from flowforge.train.preflight import preflight
from flowforge.train.preflight.check import PreflightError
from flowforge.train.trainer import Trainer
from tests.train.test_resume import _assert_same, _rows, _state
from tests.train.test_trainer import tiny_cfg

ASYNC = ("rollout.engine=workers", "train.max_staleness=1", "eval.max_prompts=1")


def _trainer(tiny_model_dir, out, cache, *extra):
    return Trainer(tiny_cfg(tiny_model_dir, out, cache, *extra), progress=False)


@pytest.mark.slow  # a few short runs (10-15 s each on 2 cores): CI runs it in the slow set
def test_staleness_zero_is_bit_identical_to_a_run_without_the_option(tiny_model_dir, tmp_path, encode_cache_dir):
    runs = []
    for name, extra in (("plain", ()), ("s0", ("train.max_staleness=0",))):
        out = tmp_path / name
        _trainer(tiny_model_dir, out, encode_cache_dir, "checkpoint.every=2", *extra).train()
        runs.append(out / "t")
    assert _rows(runs[0]) == _rows(runs[1])
    # the weights, optimizer and LR schedule (rng/ holds the process's python / numpy generators, which two runs in
    # one process leave in different states whatever the option)
    weights = sorted(p.relative_to(runs[0]) for p in (runs[0] / "checkpoints").rglob("*")
                     if p.suffix in (".safetensors", ".pt") and "rng" not in p.parts)
    assert weights
    for rel in weights:
        assert (runs[0] / rel).read_bytes() == (runs[1] / rel).read_bytes(), rel


def test_preflight_refuses_staleness_for_other_algorithms_and_the_local_engine(tiny_model_dir, tmp_path,
                                                                             encode_cache_dir):
    with pytest.raises(PreflightError) as err:
        preflight(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, "train.algorithm=nft",
                           "train.max_staleness=1"))
    text = str(err.value)
    assert "train.max_staleness=1 needs an algorithm" in text and "allowed ['dppo', 'grpo', 'grpo_guard']" in text
    assert "needs rollout.engine='workers' (got 'local')" in text


@pytest.mark.slow  # a few short runs (10-15 s each on 2 cores): CI runs it in the slow set
def test_two_step_async_run_with_workers_tags_versions_and_the_first_ratio_is_one(tiny_model_dir, tmp_path,
                                                                                  encode_cache_dir):
    """Step 0 rolls out on-policy (version 0, first ratio exactly 1); step 1 was rolled out by version 0 while step
    0 updated (staleness 1), so its first update's ratio is against version 0's recorded log-probs and not 1."""
    trainer = _trainer(tiny_model_dir, tmp_path, encode_cache_dir, *ASYNC)
    trainer.train()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/policy_version"] for r in rows] == [0.0, 0.0]
    assert [r["train/staleness"] for r in rows] == [0.0, 1.0]
    assert rows[0]["train/first_update_ratio_dev"] == 0.0
    assert rows[1]["train/first_update_ratio_dev"] > 0.0
    assert all(r["time/rollout"] > 0 for r in rows)
    assert not trainer.lookahead.pending and not trainer.engine.engine.started


@pytest.mark.slow  # three worker-engine runs of 4 steps: CI runs it in the slow set
def test_async_resume_from_a_checkpoint_equals_the_uninterrupted_run(tiny_model_dir, tmp_path, encode_cache_dir):
    """Checkpoints are synchronisation points: nothing is queued across one, so a run stopped after step 2's
    checkpoint (as a kill would leave it) and resumed ends with the uninterrupted run's weights, optimizer state and
    metrics; both roll steps 0 and 2 out on-policy and steps 1 and 3 one version stale."""
    extra = (*ASYNC, "train.steps=4", "checkpoint.every=2", "train.lr_schedule=cosine")
    whole = _trainer(tiny_model_dir, tmp_path / "whole", encode_cache_dir, *extra)
    whole.train()
    part = _trainer(tiny_model_dir, tmp_path / "part", encode_cache_dir, *extra)
    part.train(stop_at=2)
    resumed = _trainer(tiny_model_dir, tmp_path / "part", encode_cache_dir, *extra, "train.resume=auto")
    assert resumed.step == 2
    resumed.train()
    _assert_same(_state(whole), _state(resumed))
    expected, got = _rows(whole.run_dir), _rows(resumed.run_dir)
    assert [r["train/staleness"] for r in expected] == [0.0, 1.0, 0.0, 1.0]
    assert got == expected


def _record(trainer, after=None):
    """``{step: StepBatch}`` of the steps ``trainer`` rolls out (its lookahead's ``rollout`` wrapped), ``after(step)``
    called after each."""
    batches, rollout = {}, trainer.lookahead.rollout

    def recorded(step, end, timer):
        batch, traj, cond = rollout(step, end, timer)
        batches[step] = batch
        if after is not None:
            after(step)
        return batch, traj, cond

    trainer.lookahead.rollout = recorded
    return batches


@pytest.mark.slow  # three short runs with rollout workers (~30 s): CI runs it in the slow set
def test_a_signal_between_checkpoints_discards_the_queued_rollout_and_rewinds_the_sampler(tiny_model_dir, tmp_path,
                                                                                        encode_cache_dir):
    """A SIGTERM during step 0 with step 1's rollout queued (``checkpoint.every=0``: nothing stops the lookahead):
    the run stops after step 0, discards the queued rollout and rewinds the sampler, so the checkpoint the stop
    commits resumes with step 1's candidates drawn again -- the uninterrupted run's step 1 batch -- rolled out
    on-policy (where the uninterrupted run used a version-0 rollout)."""
    extra = (*ASYNC, "checkpoint.every=0")
    whole = _trainer(tiny_model_dir, tmp_path / "whole", encode_cache_dir, *extra)
    expected = _record(whole)
    whole.train()
    part = _trainer(tiny_model_dir, tmp_path / "part", encode_cache_dir, *extra)
    queued = []

    def signal_with_a_rollout_queued(step):
        queued.append(sorted(part.lookahead.pending))
        signal.raise_signal(signal.SIGTERM)  # a real one, to train()'s handlers: the loop stops after this step

    _record(part, after=signal_with_a_rollout_queued)
    with pytest.raises(Interrupted):
        part.train()
    assert queued == [[1]]  # step 1's rollout was queued when the stop came
    assert part.step == 1 and not part.lookahead.pending
    resumed = _trainer(tiny_model_dir, tmp_path / "part", encode_cache_dir, *extra, "train.resume=auto")
    assert resumed.step == 1
    got = _record(resumed)
    resumed.train()
    for field in ("prompt_indices", "candidate_ids", "group_ids"):
        assert torch.equal(getattr(got[1], field), getattr(expected[1], field)), field
    assert [r.prompt for r in got[1].records] == [r.prompt for r in expected[1].records]
    rows = [(r["step"], r["train/staleness"], r["train/policy_version"]) for r in _rows(resumed.run_dir)]
    assert rows == [(1, 0.0, 0.0), (2, 0.0, 1.0)]
    assert [r["train/staleness"] for r in _rows(whole.run_dir)] == [0.0, 1.0]
