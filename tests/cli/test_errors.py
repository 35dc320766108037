"""Every failure of the command line is one clear line: ``error: <what>: <why>; <fix>`` on stderr, exit 2, no
traceback (``--debug`` / ``FLOWFORGE_DEBUG=1`` show it). The catalogue below is one table: a case is one line
``(args, must_mention)``; ``{placeholders}`` in the args are paths from :func:`places`, and every case checks that the
run directory and the scratch directory (every other input, and where a refused ``train`` would have written) are
byte-identical afterwards.

Each case runs the real command line in a subprocess. Config values go through ``flowforge check`` (no model load);
what needs a model or a checkpoint goes through ``train`` / ``export`` with the tiny model and the prepared LoRA run
(:func:`places`). The whole table takes about 1.5 s a case on 2 cores (interpreter + torch start-up).

Add a case: append ``pytest.param([...args], ["text the error must contain"], id="short-name")`` to ``CASES``.
"""

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.cli.harness import EXAMPLE, PIPELINE, WORLD_EXAMPLE, assert_one_line_error, assert_usage_error, run_cli
from tests.tools.test_export import _refresh_manifest, tree_digest


def _prompt_rows(n, start=0):
    return "".join(json.dumps({"prompt": f"a digit {i}", "metadata": {"task": "t2i", "sample_id": f"s{i}"}}) + "\n"
                   for i in range(start, start + n))


def _bad_prompt_files(tmp):
    """Prompt files that must each fail in one line naming the file (and the line)."""
    (tmp / "latin1.jsonl").write_bytes(_prompt_rows(2).encode() + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    (tmp / "badjson.jsonl").write_text(_prompt_rows(1) + '{"prompt": "x", \n')
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "dup.jsonl").write_text(_prompt_rows(2) + _prompt_rows(1))
    (tmp / "two.jsonl").write_text(_prompt_rows(2))
    i2v = {"prompt": "x", "metadata": {"task": "i2v", "sample_id": "a", "image": "no.png"}}
    (tmp / "i2v.jsonl").write_text(json.dumps(i2v) + "\n")
    os.mkfifo(tmp / "fifo.jsonl")
    (tmp / "loop.jsonl").symlink_to(tmp / "loop.jsonl")
    (tmp / "dangling.jsonl").symlink_to(tmp / "nowhere.jsonl")


def _damaged_runs(run, tmp):
    """Copies of the prepared LoRA run, each with one thing wrong (``ck_*``)."""
    def copy(name):
        return Path(shutil.copytree(run, tmp / name))

    step = Path("checkpoints") / "step_000001"
    weights = copy("ck_flipped") / step / "weights" / "live.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])  # same size: only the sha256 can tell
    weights.write_bytes(bytes(data))
    (copy("ck_uncommitted") / step / "COMMITTED").unlink()
    (copy("ck_badmarker") / step / "COMMITTED").write_text("{garbage")
    shutil.rmtree(copy("ck_nockpt") / "checkpoints")
    (copy("ck_badconfig") / "config.yaml").write_text("train: {lr: [\n")
    (copy("ck_missing_file") / step / "trainer_state.json").unlink()
    zeroed = copy("ck_zeroed_opt") / step
    (zeroed / "optimizer.pt").write_bytes(b"\0" * (zeroed / "optimizer.pt").stat().st_size)
    _refresh_manifest(zeroed)  # the checksums agree: what is read must say what is wrong with it
    state = copy("ck_badstate") / step
    (state / "trainer_state.json").write_text("{not json")
    _refresh_manifest(state)


@pytest.fixture(scope="module")
def places(cli_run, tiny_model_dir, tmp_path_factory):
    """The paths the ``{placeholders}`` name: ``run`` (a LoRA run) and ``run_parent``, ``base`` (its base model),
    ``cwd`` (empty; the CLI runs here), ``example`` (examples/digits/grpo.yaml), ``run_config`` (the run's
    config.yaml: the tiny base model, the session's encoding cache), ``ckpt`` (the run's committed checkpoint), and
    ``tmp``, a scratch directory holding bad input files (garbage / non-mapping / binary YAML, bad prompt files, a
    symlink loop, a FIFO, a non-export directory, damaged copies of the run ``ck_*``, a model directory with
    garbage weights, ...)."""
    tmp = tmp_path_factory.mktemp("cli_errors")
    (tmp / "cwd").mkdir()
    (tmp / "garbage.yaml").write_text("train: {lr: [1e-4\nmodel: :\n")
    (tmp / "list.yaml").write_text("- train\n- model\n")
    (tmp / "binary.yaml").write_bytes(b"\xff\xfe\x00garbage\x00")
    (tmp / "unknown_key.yaml").write_text("train: {lrr: 1e-4}\n")
    (tmp / "wrong_type.yaml").write_text("train: {steps: many}\n")
    (tmp / "two_problems.yaml").write_text("train: {lrr: 1e-4, steps: many}\n")
    (tmp / "config_dir.yaml").mkdir()
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "precious.txt").write_text("keep")
    (tmp / "a_file").write_text("keep")
    (tmp / "options.yaml").write_text("{}\n")
    (tmp / "runlink").symlink_to(cli_run, target_is_directory=True)
    (tmp / "not_a_run").mkdir()
    (tmp / "good.jsonl").write_text("".join(json.dumps({"prompt": f"a handwritten {i}", "metadata": {
        "task": "t2i", "sample_id": f"g{i}"}}) + "\n" for i in range(6)))
    _bad_prompt_files(tmp)
    _damaged_runs(cli_run, tmp)
    from flowforge.demo.paths import resolve_demo_path

    shutil.copytree(resolve_demo_path("demo:world"), tmp / "world")  # a world-model source checkpoint (4.6 MB)
    pipe = tmp / "pipe"  # a pipeline directory (issue 42: its ledger and request logs are the pipeline's alone)
    (pipe / "teacher").mkdir(parents=True)
    for name, text in (("pipeline.json", "{}\n"), ("conditions.jsonl", '{"kind": "header"}\n'),
                       ("judge.token", "t0ken"), ("teacher/requests.log", "")):
        (pipe / name).write_text(text)
    # another existing run, which a resume from the run's checkpoint may not replace
    shutil.copytree(cli_run, tmp / "vx")
    broken = Path(shutil.copytree(tiny_model_dir, tmp / "broken_model"))
    weights = broken / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"\x07" * weights.stat().st_size)
    return {"run": str(cli_run), "run_parent": str(cli_run.parent), "base": str(tiny_model_dir), "tmp": str(tmp),
            "cwd": str(tmp / "cwd"), "example": EXAMPLE, "run_config": str(cli_run / "config.yaml"),
            "ckpt": str(cli_run / "checkpoints" / "step_000001"), "run_name": cli_run.name,
            "base_name": Path(tiny_model_dir).name, "tmp_name": tmp.name, "world_example": WORLD_EXAMPLE}


def train(*overrides):
    """A `train` of the tiny model (encoding cache outside the scratch directory) into {tmp}/refused, which a refused
    run must not leave behind."""
    return ["train", "{run_config}", "run.output_dir={tmp}", "run.name=refused", *overrides, "--no-progress"]


CASES = [
    # --- config files (any config verb) ---
    pytest.param(["check", "{tmp}/missing.yaml"], ["missing.yaml", "No such file"], id="config-missing"),
    pytest.param(["train", "{tmp}/missing.yaml"], ["missing.yaml"], id="train-config-missing"),
    pytest.param(["sft", "{tmp}/missing.yaml"], ["missing.yaml"], id="sft-config-missing"),
    pytest.param(["check", "{tmp}/config_dir.yaml"], ["config_dir.yaml"], id="config-is-a-directory"),
    pytest.param(["check", "{tmp}/garbage.yaml"], ["garbage.yaml", "YAML"], id="config-garbage-yaml"),
    pytest.param(["check", "{tmp}/list.yaml"], ["list.yaml", "mapping"], id="config-not-a-mapping"),
    pytest.param(["check", "{tmp}/binary.yaml"], ["binary.yaml"], id="config-binary"),
    pytest.param(["check", "{tmp}/unknown_key.yaml"], ["lrr"], id="config-unknown-key"),
    pytest.param(["check", "{tmp}/wrong_type.yaml"], ["steps"], id="config-wrong-type"),
    pytest.param(["check", "{tmp}/two_problems.yaml"], ["lrr", "steps"], id="config-two-problems-one-line"),
    pytest.param(["check", "{example}", "train.lr"], ["train.lr"], id="override-without-value"),
    pytest.param(["check", "{example}", "nosection.x=1"], ["nosection"], id="override-unknown-section"),
    pytest.param(["check", "{example}", "train.algorithm=sgd"], ["sgd"], id="preflight-unknown-algorithm"),
    pytest.param(["compare", "{tmp}/missing.yaml"], ["missing.yaml"], id="compare-file-missing"),
    pytest.param(["report", "{tmp}/no_such_run"], ["no_such_run"], id="report-missing-run"),
    # --- prompt files given as data.prompts (issue 11: "/dev/null ... gives 'does not exist'") ---
    pytest.param(["check", "{example}", "data.prompts=/dev/null"], ["/dev/null", "data.prompts",
                                                                    "not a regular file"], id="prompts-dev-null"),
    pytest.param(["check", "{example}", "data.prompts={tmp}/loop.jsonl"], ["loop.jsonl", "data.prompts",
                                                                           "symbolic links"],
                 id="prompts-symlink-loop"),
    pytest.param(["check", "{example}", "data.prompts={tmp}"], ["data.prompts"], id="prompts-directory"),
    # --- export: OUT would destroy data (issue 11 reproductions) ---
    pytest.param(["export", "{run}", "{run}", "--form", "adapter", "--overwrite"], ["run directory"],
                 id="export-out-is-run"),
    pytest.param(["export", "{run}", "{run}/checkpoints", "--form", "adapter", "--overwrite"], ["run directory"],
                 id="export-out-is-checkpoints"),
    pytest.param(["export", "{run}", "{run}/checkpoints/step_000001", "--form", "merged", "--overwrite"],
                 ["run directory"], id="export-out-is-checkpoint"),
    pytest.param(["export", "{run}", "{run_parent}", "--form", "adapter", "--overwrite"], ["contains the run"],
                 id="export-out-is-run-parent"),
    pytest.param(["export", "{run}", "{base}", "--form", "merged", "--overwrite"], ["base model directory"],
                 id="export-out-is-base"),
    pytest.param(["export", "{run}", ".", "--form", "adapter", "--overwrite"], ["current working directory"],
                 id="export-out-is-cwd"),
    pytest.param(["export", "{run}", "{tmp}/foreign", "--form", "adapter", "--overwrite"],
                 ["foreign", "flowforge_export.json"], id="export-out-not-an-export"),
    pytest.param(["export", "{run}", "{tmp}/a_file", "--form", "adapter"], ["a_file", "is a file"],
                 id="export-out-is-a-file"),
    # --- export: other arguments ---
    pytest.param(["export", "{tmp}/not_a_run", "{tmp}/o1", "--form", "adapter"], ["not_a_run", "config.yaml"],
                 id="export-not-a-run"),
    pytest.param(["export", "{run}", "{tmp}/o2", "--form", "adapter", "--step", "7"], ["--step 7", "committed"],
                 id="export-step-not-committed"),
    pytest.param(["export", "{run}", "{tmp}/o3", "--form", "adapter", "--weights", "ema"], ["'ema'", "--weights"],
                 id="export-weights-absent"),
    pytest.param(["export", "{run}", "{tmp}/o4", "--form", "merged", "--base", "{tmp}/no_base"],
                 ["no_base", "--base"], id="export-base-missing"),
    pytest.param(["export", "{run}", "{tmp}/o5", "--form", "merged", "--base", "{tmp}/foreign"],
                 ["foreign", "base model"], id="export-base-wrong"),
    # --- config values that passed `check` and crashed later (issue 11); `check` loads no model ---
    *[pytest.param(["check", "{example}", override], [key], id=f"value-{key}-{ident}") for override, key, ident in [
        ("grpo.clip_low=.nan", "grpo.clip_low", "nan"),
        ("advantage.clip=-1", "advantage.clip", "negative"),
        ("run.seed=-1", "run.seed", "negative"),
        ("reward.weights={{digit: .nan}}", "reward.weights.digit", "nan"),
        ("reward.options={{digit: {{foo: 1}}}}", "reward.options.digit", "unknown-option"),
        ("eval.max_prompts=0", "eval.max_prompts", "zero"),
        ("eval.max_prompts=-1", "eval.max_prompts", "negative"),
        ("data.prompts_per_step=1000", "data.prompts_per_step", "more-than-the-file"),
        ("run.device=gpu", "run.device", "not-a-device"),
        ("data.group_size=1000000000", "data.group_size", "exhausts-memory"),
        ("run.name=../escape", "run.name", "parent"),
        ("run.name=/abs/name", "run.name", "absolute"),
        ("train.lr=.inf", "train.lr", "inf"),
        ("train.micro_batch_size=7", "train.micro_batch_size", "divisibility"),
        ("model.path=demo:nope", "model.path", "unknown-demo"),
        ("model.path=/nonexistent/model", "model.path", "missing-dir"),
    ]],
    pytest.param(["check", "{example}", "run.device=cuda"], ["run.device", "no CUDA device"], id="value-cuda-here",
                 marks=pytest.mark.skipif("__import__('torch').cuda.is_available()", reason="CUDA is here")),
    # --- prompt files ---
    pytest.param(["check", "{example}", "data.prompts={tmp}/latin1.jsonl"], ["data.prompts", "latin1.jsonl:3",
                                                                             "UTF-8"], id="prompts-not-utf8"),
    pytest.param(["check", "{example}", "data.prompts={tmp}/badjson.jsonl"], ["badjson.jsonl:2", "JSON"],
                 id="prompts-bad-json-row"),
    pytest.param(["check", "{example}", "data.prompts={tmp}/empty.jsonl"], ["empty.jsonl", "no prompt rows"],
                 id="prompts-empty"),
    pytest.param(["check", "{example}", "data.prompts={tmp}/fifo.jsonl"], ["fifo.jsonl", "named pipe"],
                 id="prompts-fifo"),
    pytest.param(["check", "{example}", "data.prompts={tmp}/dup.jsonl"], ["dup.jsonl:3", "sample_id"],
                 id="prompts-duplicate-id"),
    pytest.param(["check", "{example}", "data.prompts={tmp}/two.jsonl"], ["data.prompts_per_step", "2 prompts"],
                 id="prompts-fewer-than-a-step"),
    pytest.param(["check", "{example}", "data.eval_prompts=/dev/null"], ["data.eval_prompts", "/dev/null"],
                 id="eval-prompts-dev-null"),
    pytest.param(["check", "{example}", "data.prompts={tmp}/i2v.jsonl"], ["i2v.jsonl:1", "metadata.image", "no.png"],
                 id="prompts-condition-image-missing"),
    pytest.param(["check", "{example}", "data.prompts=demo:nope"], ["demo:nope"], id="prompts-unknown-demo"),
    pytest.param(train("data.prompts={tmp}/dangling.jsonl"), ["data.prompts", "dangling.jsonl", "symlink"],
                 id="train-prompts-dangling-symlink"),
    # --- model directories (`train`: caught at load, or right after it, before anything is written) ---
    pytest.param(train("model.path={tmp}/foreign"), ["foreign"], id="model-dir-not-a-model"),
    pytest.param(train("model.path={tmp}/a_file"), ["a_file"], id="model-dir-is-a-file"),
    pytest.param(train("model.path={tmp}/broken_model"), ["broken_model", "diffusion_pytorch_model.safetensors"],
                 id="model-garbage-weights"),
    pytest.param(train("model.path=no-such-org/no-such-model"), ["model.path", "hf download"],
                 id="model-hub-id-offline"),
    pytest.param(train("lora.targets=[attn.to_q, to_qq]"), ["lora.targets", "'to_qq'"],
                 id="model-lora-target-matches-nothing"),
    pytest.param(train("lora.targets=[attn]"), ["lora.targets", "Attention"], id="model-lora-target-not-linear"),
    pytest.param(train("model.height=30"), ["model.height=30", "multiples of 4"], id="model-size-not-patch-multiple"),
    # --- checkpoints (resume and export read them) ---
    pytest.param(train("train.resume={tmp}/ck_flipped/checkpoints/step_000001"), ["live.safetensors", "sha256"],
                 id="resume-flipped-bytes"),
    pytest.param(train("train.resume={tmp}/ck_uncommitted/checkpoints/step_000001"), ["COMMITTED"],
                 id="resume-uncommitted"),
    pytest.param(train("train.resume={tmp}/no_checkpoint_here"), ["train.resume", "no_checkpoint_here"],
                 id="resume-missing"),
    pytest.param(train("train.resume={tmp}/ck_zeroed_opt/checkpoints/step_000001"), ["optimizer.pt"],
                 id="resume-zeroed-optimizer"),
    pytest.param(train("train.resume={tmp}/ck_badstate/checkpoints/step_000001"), ["trainer_state.json", "JSON"],
                 id="resume-garbage-trainer-state"),
    pytest.param(train("train.resume={ckpt}", "lora.rank=8"), ["lora.rank"], id="resume-other-lora-rank"),
    pytest.param(["export", "{tmp}/ck_flipped", "{tmp}/o6", "--form", "adapter"], ["live.safetensors", "sha256"],
                 id="export-flipped-bytes"),
    pytest.param(["export", "{tmp}/ck_uncommitted", "{tmp}/o7", "--form", "adapter"], ["ck_uncommitted"],
                 id="export-no-committed-checkpoint"),
    pytest.param(["export", "{tmp}/ck_badmarker", "{tmp}/o8", "--form", "adapter"], ["COMMITTED"],
                 id="export-garbage-manifest"),
    pytest.param(["export", "{tmp}/ck_nockpt", "{tmp}/o9", "--form", "adapter"], ["ck_nockpt"],
                 id="export-no-checkpoints"),
    pytest.param(["export", "{tmp}/ck_badconfig", "{tmp}/o10", "--form", "adapter"], ["config.yaml"],
                 id="export-garbage-config"),
    pytest.param(["export", "{tmp}/ck_missing_file", "{tmp}/o11", "--form", "adapter"], ["trainer_state.json"],
                 id="export-checkpoint-file-missing"),
    # --- export arguments ---
    pytest.param(["export", "{tmp}/no_such_run", "{tmp}/o12", "--form", "adapter"], ["no_such_run"],
                 id="export-run-missing"),
    pytest.param(["export", "{run}", "{run}/sub/out", "--form", "adapter"], ["run directory"],
                 id="export-out-inside-run"),
    pytest.param(["export", "{run}", "{tmp}/o13", "--form", "adapter", "--step", "-1"], ["--step -1"],
                 id="export-negative-step"),
    pytest.param(["export", "{run}", "{tmp}/o14", "--form", "merged", "--base", "{tmp}/a_file"], ["a_file"],
                 id="export-base-is-a-file"),
    # --- other verbs and command-line misuse that argparse cannot see ---
    pytest.param(["check", "{example}", "=1"], ["=1"], id="override-empty-key"),
    pytest.param(["check", "{example}", "train.lr=[1"], ["train.lr"], id="override-bad-yaml-literal"),
    pytest.param(["check", "{example}", "train=1"], ["train"], id="override-section-as-value"),
    pytest.param(["check", "{example}", "train.lr.x=1"], ["train.lr"], id="override-key-below-a-value"),
    pytest.param(["sft", "{example}", "sft.steps=-1"], ["sft.steps"], id="sft-bad-value"),
    pytest.param(["compare", "{example}"], ["grpo.yaml"], id="compare-a-run-config"),
    pytest.param(["report", "{tmp}/a_file"], ["a_file"], id="report-a-file"),
    pytest.param(["report", "{tmp}/foreign"], ["foreign", "not a flowforge run directory"], id="report-not-a-run"),
    pytest.param(["sample", "{tmp}/not_a_run", "--prompt", "a seven", "--out", "{tmp}/s.png"], ["not_a_run"],
                 id="sample-not-a-run"),
    # --- issue 24: no command writes into what it did not create; sample bounded before allocation ---
    pytest.param(["sample", "{run}", "--prompt", "a seven", "--out", "{run}/samples/step_000001.png"],
                 ["--out", "lies inside"], id="write-sample-onto-the-eval-grid"),
    pytest.param(["sample", "{run}", "--prompt", "a seven", "--out", "{ckpt}/weights/live.png"],
                 ["--out", "lies inside"], id="write-sample-into-a-checkpoint"),
    pytest.param(["sample", "{run}", "--prompt", "a", "--out", "{run}/samples/../y.png"],
                 ["--out", "lies inside"], id="write-sample-through-dotdot"),
    pytest.param(["data", "curate", "--input", "{tmp}/good.jsonl", "--out-dir", "{run}/data"],
                 ["--out-dir", "run directory"], id="write-curate-into-a-run"),
    pytest.param(["data", "prepare", "--source", "jsonl", "--input", "{tmp}/good.jsonl", "--output",
                  "{tmp}/foreign/../good.jsonl", "--overwrite"], ["is the input"], id="write-prepare-onto-its-input"),
    # --- issue 42: a pipeline directory is the pipeline's alone; a checkpoint continues in its run or a new one ---
    pytest.param(["data", "prepare", "--source", "jsonl", "--input", "{tmp}/good.jsonl", "--output",
                  "{tmp}/pipe/conditions.jsonl", "--overwrite"], ["--output", "the pipeline directory {tmp}/pipe"],
                 id="write-prepare-onto-a-pipeline-ledger"),
    pytest.param(["sample", "{run}", "--prompt", "a seven", "--out", "{tmp}/pipe/x.png"],
                 ["--out", "the pipeline directory {tmp}/pipe"], id="write-sample-into-a-pipeline"),
    pytest.param(["export", "{run}", "{tmp}/pipe/export", "--form", "adapter"],
                 ["export directory", "the pipeline directory {tmp}/pipe"], id="export-out-inside-a-pipeline"),
    pytest.param(train("run.output_dir={tmp}/pipe", "run.name=A"), ["the pipeline directory {tmp}/pipe"],
                 id="write-run-into-a-pipeline"),
    pytest.param(train("run.name=vx", "train.resume={ckpt}"),
                 ["train.resume={ckpt}", "belongs to the run {run}", "existing run {tmp}/vx", "fresh run.name"],
                 id="resume-into-another-existing-run"),
    pytest.param(["sample", "{run}", "--prompt", "a seven", "--out", "{tmp}/n.png", "--num", "1000000000"],
                 ["--num", "limit"], id="value-sample-num-huge"),
    # the pipeline directory and a judge server's request log under the same rule (the serve cases also give a
    # host --no-auth refuses, so that a server that checked nothing would fail on that instead of serving forever)
    pytest.param(["stages", PIPELINE, "run.output_dir={run}", "--no-progress"],
                 ["pipeline directory", "lies inside the run directory"], id="write-stages-into-a-run"),
    pytest.param(["stages", PIPELINE, "run.output_dir={tmp}/runlink/checkpoints/step_000001", "--no-progress"],
                 ["pipeline directory", "lies inside the checkpoint"], id="write-stages-into-a-checkpoint-by-symlink"),
    pytest.param(["stages", PIPELINE, "model.path={base}", "run.output_dir={base}/../{base_name}", "--no-progress"],
                 ["pipeline directory", "lies inside the base model"], id="write-stages-into-the-base-model"),
    # issue 22: a run directory that overlaps the source checkpoint (model.path), refused before anything loads or
    # is written (the scratch directory holding the checkpoint copies is compared before / after)
    *[pytest.param(["train", config, f"model.path={{tmp}}/{src}", *where, "--no-progress"],
                   ["source model directory", f"{{tmp}}/{src}"], id=f"write-run-{ident}")
      for config, src, where, ident in [
          ("{world_example}", "world", ["run.output_dir={tmp}/world", "run.name=refused"], "inside-the-world-model"),
          ("{world_example}", "world", ["run.output_dir={tmp}", "run.name=world"], "onto-the-world-model"),
          ("{world_example}", "world", ["run.output_dir={tmp}/..", "run.name={tmp_name}"], "around-the-world-model"),
          ("{world_example}", "world", ["run.output_dir={tmp}/foreign/../world", "run.name=r"],
           "inside-the-world-model-by-dotdot"),
          ("{run_config}", "broken_model", ["run.output_dir={tmp}/broken_model", "run.name=refused"],
           "inside-the-base-model")]],
    *[pytest.param(["serve", "judge", "--scorer", "digit", "--options", "{tmp}/options.yaml", "--request-log", log,
                    "--host", "0.0.0.0", "--no-auth"], ["--request-log", why], id=f"write-serve-log-{ident}")
      for log, why, ident in [("{run}/requests.log", "lies inside the run directory", "into-a-run"),
                              ("{tmp}/runlink/checkpoints/step_000001/r.log", "lies inside the checkpoint",
                               "into-a-checkpoint-by-symlink"),
                              ("{tmp}/foreign/../options.yaml", "is the --options file", "onto-its-options"),
                              ("{tmp}/pipe/conditions.jsonl", "the pipeline directory", "onto-a-pipeline-ledger"),
                              ("{tmp}/pipe/teacher/requests.log", "the pipeline directory",
                               "into-a-pipeline-s-teacher-log")]],
    # a --token-file the server would create: under the same rule (an existing one is only read)
    *[pytest.param(["serve", server, *backend, "--token-file", token], ["--token-file", why],
                   id=f"write-serve-{server}-token-{ident}")
      for server, backend in (("reward", ["--scorers", "digit"]), ("judge", ["--scorer", "digit"]))
      for token, why, ident in [("{run}/token.txt", "lies inside the run directory", "into-a-run"),
                                ("{tmp}/pipe/teacher/token.txt", "the pipeline directory", "into-a-pipeline")]],
]


@pytest.mark.parametrize(("args", "must_mention"), CASES)
def test_bad_input_is_one_line(places, args, must_mention):
    """Through :func:`flowforge.cli.main` in this process (no interpreter start-up per case); that the harness sees
    what a real process prints is checked on one case of every kind by the harness agreement test below."""
    args = [a.format(**places) for a in args]
    before = tree_digest(places["run"]), tree_digest(places["tmp"])
    rc, _, stderr = run_cli(args, places["cwd"], in_process=True)
    assert_one_line_error(rc, stderr, [m.format(**places) for m in must_mention])
    assert (tree_digest(places["run"]), tree_digest(places["tmp"])) == before


def test_the_catalogue_covers_every_kind_of_input():
    """At least 60 bad inputs, of every kind issue 11 names."""
    ids = [p.id for p in CASES]
    assert len(ids) >= 60 and len(set(ids)) == len(ids)
    for prefix in ("config-", "value-", "prompts-", "model-", "resume-", "export-", "override-"):
        assert any(i.startswith(prefix) for i in ids), prefix


USAGE_CASES = [
    pytest.param([], ["command"], id="no-verb"),
    pytest.param(["fly"], ["fly"], id="unknown-verb"),
    pytest.param(["check"], ["config"], id="check-without-config"),
    pytest.param(["export", "{run}", "{tmp}/u1"], ["--form"], id="export-without-form"),
    pytest.param(["export", "{run}", "{tmp}/u2", "--form", "fused"], ["fused"], id="export-bad-form"),
    pytest.param(["export", "{run}", "{tmp}/u3", "--form", "adapter", "--step", "two"], ["two"],
                 id="export-step-not-int"),
    pytest.param(["export", "{run}", "{tmp}/u4", "--form", "adapter", "--weights", "best"], ["best"],
                 id="export-bad-weights"),
    pytest.param(["sample", "{run}", "--prompt", "a", "--out", "{tmp}/g.png", "--guidance", "nan"], ["nan"],
                 id="sample-guidance-nan"),
    pytest.param(["sample", "{run}", "--prompt", "a", "--out", "{tmp}/g.png", "--guidance", "inf"], ["inf"],
                 id="sample-guidance-inf"),
    pytest.param(["report", "{run}", "--smooth", "nan"], ["nan"], id="report-smooth-nan"),
    pytest.param(["data", "curate", "--input", "{tmp}/x.jsonl", "--out-dir", "{tmp}/o", "--eval-fraction=-inf"],
                 ["-inf"], id="curate-eval-fraction-inf"),
    pytest.param(["serve", "reward", "--scorers", "digit", "--max-body-mb", "nan"], ["nan"], id="serve-body-nan"),
]


@pytest.mark.parametrize(("args", "must_mention"), USAGE_CASES)
def test_command_line_misuse_is_a_usage_error(places, args, must_mention):
    rc, _, stderr = run_cli([a.format(**places) for a in args], places["cwd"], in_process=True)
    assert_usage_error(rc, stderr, must_mention)


@pytest.mark.parametrize("how", ["before-verb", "after-verb", "env"])
def test_debug_shows_the_traceback(places, how):
    missing = f"{places['tmp']}/missing.yaml"
    args = {"before-verb": ["--debug", "check", missing], "after-verb": ["check", missing, "--debug"],
            "env": ["check", missing]}[how]
    rc, _, stderr = run_cli(args, places["cwd"], env={"FLOWFORGE_DEBUG": "1"} if how == "env" else None)
    assert rc == 1 and "Traceback (most recent call last)" in stderr and "ConfigError" in stderr
    assert "missing.yaml" in stderr


def test_a_good_command_still_exits_zero(places):
    rc, stdout, stderr = run_cli(["check", EXAMPLE], places["cwd"])
    assert rc == 0 and stdout == f"OK: {EXAMPLE}\n" and "Traceback" not in stderr
    rc, stdout, _ = run_cli(["check", EXAMPLE, "--print"], places["cwd"], in_process=True)
    assert rc == 0 and "train:" in stdout and stdout.endswith(f"OK: {EXAMPLE}\n")




def _without_durations(text: str) -> str:
    """``text`` with the start-up lines' measured seconds (``loaded in 0.4 s``) replaced, so two runs compare."""
    return re.sub(r"\b\d+(\.\d+)? s\b", "<t> s", text)


HARNESS_ONCE_DIFFERED = ("config-two-problems-one-line", "export-out-is-run")


def _first_of_each_kind():
    """The first catalogue case of every id prefix (``config-``, ``value-``, ``prompts-``, ``model-``, ``resume-``,
    ``export-``, ``override-``, ...), plus the cases the harness once differed on. Each starts an interpreter and
    torch (2-10 s); the default run takes the cases the harness once differed on and the first one, the slow set
    (CI runs it too) every kind."""
    seen, picked = set(), []
    for param in CASES:
        kind = param.id.split("-")[0]
        if kind not in seen or param.id in HARNESS_ONCE_DIFFERED:
            seen.add(kind)
            default = not picked or param.id in HARNESS_ONCE_DIFFERED
            picked.append(pytest.param(param.id, id=param.id, marks=() if default else pytest.mark.slow))
    return picked


@pytest.mark.parametrize("case", _first_of_each_kind())
def test_in_process_harness_agrees_with_the_process(places, case):
    (param,) = [p for p in CASES if p.id == case]
    args, must_mention = param.values
    args = [a.format(**places) for a in args]
    rc, _, stderr = run_cli(args, places["cwd"], in_process=True)
    assert_one_line_error(rc, stderr, [m.format(**places) for m in must_mention])
    real_rc, _, real_stderr = run_cli(args, places["cwd"])
    assert (rc, _without_durations(stderr)) == (real_rc, _without_durations(real_stderr))
    rc, _, stderr = run_cli(["--debug", *args], places["cwd"], in_process=True)
    assert rc == 1 and "Traceback (most recent call last)" in stderr


def test_in_process_harness_agrees_on_a_usage_error(places):
    args = ["export", places["run"], f"{places['tmp']}/u5", "--form", "fused"]
    assert run_cli(args, places["cwd"], in_process=True)[::2] == run_cli(args, places["cwd"])[::2]


def test_overrides_after_an_option_are_overrides(places):
    """Issue 24: ``stages CFG --no-progress run.name=x`` (and every config verb) takes overrides after options."""
    from flowforge.cli.dispatch import _parser

    rc, _, stderr = run_cli(["stages", "{tmp}/missing.yaml".format(**places), "--no-progress", "run.name=x"],
                            places["cwd"], in_process=True)
    assert_one_line_error(rc, stderr, ["missing.yaml"])  # reached the config, not "unrecognized arguments"
    rc, _, stderr = run_cli(["stages", "{tmp}/missing.yaml".format(**places), "--no-progress", "--bogus"],
                            places["cwd"], in_process=True)
    assert_usage_error(rc, stderr, ["--bogus"])
    assert _parser().parse_known_args(["stages", "p.yaml", "--no-progress", "run.name=x"])[1] == ["run.name=x"]
