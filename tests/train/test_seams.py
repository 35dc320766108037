"""The trainer's seams (issue 40): a prompt source and step hooks called at fixed points of the real loop, and a
failed judge group dropped with zero weight in plain ``flowforge train`` (was: the run stopped on a NaN reward)."""

import json

import pytest
import torch

from flowforge.train.seams import SamplerPrompts, StepHook
from flowforge.train.trainer import Trainer
from tests.train.test_trainer import read_jsonl, tiny_cfg


class Recorder(StepHook):
    """Records every call (name, step) and adds a metric after scoring."""

    def __init__(self, calls):
        self.calls = calls

    def before_step(self, trainer, step):
        self.calls.append(("before_step", step))

    def on_rolled_out(self, trainer, step, batch):
        self.calls.append(("on_rolled_out", step))

    def on_scored(self, trainer, step, batch, media, components, metrics):
        assert media.shape[0] == len(batch.records) and set(components) >= {"digit"}
        metrics["hook/scored_rows"] = float(len(batch.records))
        self.calls.append(("on_scored", step))

    def on_trained(self, trainer, step, batch, metrics):
        self.calls.append(("on_trained", step, trainer.policy.optimizer_steps))

    def before_eval(self, trainer, step):
        self.calls.append(("before_eval", step))

    def on_evaluated(self, trainer, step, scalars):
        self.calls.append(("on_evaluated", step, "eval/digit_eval" in scalars))


class FirstPrompts(SamplerPrompts):
    """Always prompts 3 and 5 (not the sampler's), recording what it is told."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def groups(self, trainer, step, sampled):
        self.calls.append(("groups", step, len(sampled)))
        return torch.tensor([3, 5])

    def rolled_out(self, trainer, step, batch):
        self.calls.append(("rolled_out", step, sorted({r.prompt for r in batch.records})))

    def scored(self, trainer, step, batch, components):
        super().scored(trainer, step, batch, components)
        self.calls.append(("scored", step))

    def trained_on(self, trainer, step, batch):
        self.calls.append(("trained_on", step))


def test_the_loop_asks_the_prompt_source_and_calls_the_hooks_at_fixed_points(tiny_model_dir, tmp_path,
                                                                              encode_cache_dir):
    calls = []
    trainer = Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, "train.steps=2"), progress=False,
                      prompts=FirstPrompts(calls), hooks=[Recorder(calls)])
    chosen = sorted({trainer.train_prompts[3].prompt, trainer.train_prompts[5].prompt})
    run_dir = trainer.train()
    step = [("before_step", 0), ("groups", 0, 2), ("rolled_out", 0, chosen), ("on_rolled_out", 0), ("scored", 0),
            ("on_scored", 0), ("trained_on", 0), ("on_trained", 0, 2)]
    second = [(c[0], 1, *c[2:]) for c in step]
    second[-1] = ("on_trained", 1, 4)  # 2 optimizer steps per batch
    assert calls == [("before_eval", 0), ("on_evaluated", 0, True), *step, *second,
                     ("before_eval", 2), ("on_evaluated", 2, True)]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["hook/scored_rows"] for r in rows] == [8.0, 8.0]  # a hook's metrics are logged with the step
    assert [r["reward/judge_failed_groups"] for r in rows] == [0.0, 0.0]


def test_plain_train_drops_a_group_the_remote_judge_gave_no_marks_and_trains_on(tiny_model_dir, encode_cache_dir,
                                                                               tmp_path, monkeypatch):
    """A remote judge (a real judge server on loopback) never answers the first group of step 0 in the strict format:
    after its 3 attempts the group has no marks (NaN). Was: ``error: reward component 'vlm_judge' scored NaN/inf for
    4 of 8 samples`` (exit 2); now the group is dropped with zero weight, counted, and the other group trained on."""
    from tests.cli.test_errors import EXAMPLE, run_cli
    from tests.serve.judge_support import TOKEN_ENV, start, stop

    (tmp_path / "token").write_text("s3cret")
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["malformed", "wrong_count", "malformed"]))
    server, url = start(["-m", "tests.serve.judge_support", "scripted", "--script", str(script), "--token-file",
                         str(tmp_path / "token")])
    try:
        options = (f"reward.options={{vlm_judge: {{model: scripted, base_url: '{url}/v1', api_key_env: {TOKEN_ENV}, "
                   "frames: 1, max_side: 16, max_attempts: 3, retry_backoff_s: 0.0, max_concurrency: 1}}")
        rc, _, err = run_cli(["train", EXAMPLE, f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}",
                              "run.name=t", f"data.cache_dir={encode_cache_dir}", "data.prompts_per_step=2",
                              "data.group_size=4", "sampler.num_steps=4", "sampler.num_sde_steps=2",
                              "train.micro_batch_size=4", "train.steps=2", "eval.max_prompts=2",
                              "eval.samples_per_prompt=2", "eval.every=0", "eval.scorers=[digit_eval]",
                              "checkpoint.every=0", "reward.weights={vlm_judge: 1.0}", "reward.required=[]", options,
                              "--no-progress"], tmp_path, in_process=True)
    finally:
        stop(server)
    assert rc == 0, err
    rows = read_jsonl(tmp_path / "t" / "metrics.jsonl")
    assert [r["reward/judge_failed_groups"] for r in rows] == [1.0, 0.0]
    assert [r["train/skipped"] for r in rows] == [0.0, 0.0]  # step 0 trained on its other group
    assert [r["reward/vlm_judge_failures"] for r in rows] == [1.0, 0.0]
    assert all(r["reward/total_mean"] == pytest.approx(r["reward/total_mean"]) for r in rows)  # finite: kept rows
