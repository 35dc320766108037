"""The pipeline directory's recorded paths (flowforge.orchestrate.directory, issue 42): relative to the pipeline
directory, so a copied or moved pipeline (or a rerun from another working directory) uses its own student; a record
leading outside it is refused, never followed to another pipeline's student."""

import json
import shutil
from types import SimpleNamespace

import pytest

from flowforge.orchestrate.directory import (GATE_FILE, PipelineLayout, mark_pipeline_dir, record_path, recorded_path,
                                            student_dir)
from flowforge.runtime.errors import UserError
from tests.tools.test_export import tree_digest


def _finished_b(directory, record_student=None):
    """A pipeline directory with stage B's attempt 0 done: its student and gate.json (as run_stage_b writes it, or
    with ``record_student`` as an older flowforge wrote it)."""
    student = directory / "B" / "attempt_0" / "student"
    student.mkdir(parents=True)
    (student / "meta.json").write_text(json.dumps({"pipeline": directory.name}))
    mark_pipeline_dir(directory)
    record = {"attempt": 0, "passed": True, "student": record_student or record_path(directory, student)}
    (student.parent / GATE_FILE).write_text(json.dumps(record))
    return record


def _pcfg(directory):
    return SimpleNamespace(run=SimpleNamespace(output_dir=str(directory.parent), name=directory.name))


def test_a_copied_pipeline_serves_its_own_student(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    original = tmp_path / "runs" / "p"
    record = _finished_b(original)
    assert record["student"] == "B/attempt_0/student"  # relative to the pipeline directory
    copy = tmp_path / "elsewhere" / "q"
    shutil.copytree(original, copy)
    gate = json.loads((copy / "B" / "attempt_0" / GATE_FILE).read_text())
    assert student_dir(_pcfg(copy), gate) == copy / "B" / "attempt_0" / "student"
    monkeypatch.chdir(copy / "B")  # a rerun from another working directory, with a relative run.output_dir
    relative = SimpleNamespace(run=SimpleNamespace(output_dir="../..", name="q"))
    assert (student_dir(relative, gate).resolve() == (copy / "B" / "attempt_0" / "student").resolve())


@pytest.mark.parametrize("form", ["absolute", "cwd-relative"])
def test_an_older_record_works_inside_its_pipeline_and_is_refused_in_a_copy(tmp_path, monkeypatch, form):
    monkeypatch.chdir(tmp_path)
    original = tmp_path / "runs" / "p"
    old = original / "B" / "attempt_0" / "student"
    _finished_b(original, str(old) if form == "absolute" else "runs/p/B/attempt_0/student")
    gate = json.loads((original / "B" / "attempt_0" / GATE_FILE).read_text())
    assert student_dir(_pcfg(original), gate).resolve() == old.resolve()
    copy = tmp_path / "runs" / "q"
    shutil.copytree(original, copy)
    before = tree_digest(tmp_path)
    with pytest.raises(UserError) as info:  # the record names p's student: never served to q's stage C
        student_dir(_pcfg(copy), gate)
    message = str(info.value)
    assert "\n" not in message and f"{copy / 'B' / 'attempt_0' / GATE_FILE}: student" in message
    assert f"{old.resolve()}, outside the pipeline directory {copy}" in message
    assert 'set "student" to "B/attempt_0/student"' in message
    assert tree_digest(tmp_path) == before
    shutil.rmtree(original)  # moved rather than copied: the old place is gone
    with pytest.raises(UserError, match="names no existing path inside the pipeline directory"):
        student_dir(_pcfg(copy), gate)


def test_records_never_lead_out_of_the_pipeline_directory(tmp_path):
    pipe, other = tmp_path / "p", tmp_path / "other"
    (other / "student").mkdir(parents=True)
    pipe.mkdir()
    (pipe / "link").symlink_to(other / "student", target_is_directory=True)
    for value in ("../other/student", "link", str(other / "student")):
        with pytest.raises(UserError, match="outside the pipeline directory"):
            recorded_path(pipe, value, "gate.json: student", "fix")
    with pytest.raises(ValueError, match="outside the pipeline directory"):
        record_path(pipe, other / "student")


def test_stage_c_moved_onto_an_existing_run_by_c_overrides_is_refused(tiny_model_dir, encode_cache_dir, tmp_path):
    """Issue 42: ``stages.c_overrides=[run.output_dir=runs, run.name=<existing run>]`` made stage C resume A's
    checkpoint over that run. The pipeline now refuses those overrides when it loads; behind that, a stage C config
    pointed at an existing run (the Python API) meets the trainer's rule: refused before anything is written."""
    import dataclasses

    from flowforge.config import ConfigError
    from flowforge.orchestrate.config import JUDGE, PLACEHOLDER_URL, judge_options, load_pipeline, stage_config
    from flowforge.orchestrate.stage_trainer import stage_trainer
    from flowforge.orchestrate.stages import open_ledger
    from tests.orchestrate.support import write_pipeline

    runs = tmp_path / "runs"
    vx = runs / "vx"  # a finished run of its own
    (vx / "checkpoints" / "step_000004").mkdir(parents=True)
    (vx / "checkpoints" / "step_000004" / "COMMITTED").write_text("{}")
    (vx / "config.yaml").write_text("run: {name: vx}\n")
    moved = write_pipeline(tmp_path / "moved.yaml", tiny_model_dir, runs, encode_cache_dir,
                           stages={"n_a": 4, "c_overrides": [f"run.output_dir={runs}", "run.name=vx"]})
    with pytest.raises(ConfigError, match="run.name"):
        load_pipeline(moved)
    pcfg = load_pipeline(write_pipeline(tmp_path / "pipeline.yaml", tiny_model_dir, runs, encode_cache_dir,
                                        stages={"n_a": 4}))
    ledger = open_ledger(pcfg)
    a_last = runs / "p" / "A" / "checkpoints" / "step_000002"  # stage A's last checkpoint (its marker is enough here)
    a_last.mkdir(parents=True)
    (a_last / "COMMITTED").write_text("{}")
    (runs / "p" / "A" / "config.yaml").write_text("run: {name: A}\n")
    judge = judge_options(pcfg, base_url=PLACEHOLDER_URL, model=pcfg.teacher.model, api_key_env=None)
    cfg = stage_config(pcfg, "C", steps=3, reward={"weights": {JUDGE: 1.0}, "options": {JUDGE: judge}},
                       resume=str(a_last))
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=str(runs), name="vx"))
    before = tree_digest(runs)
    with pytest.raises(UserError, match=f"belongs to the run {runs / 'p' / 'A'}.*names the existing run {vx}.*"
                                        "choose a fresh run.name"):
        stage_trainer(cfg, ledger=ledger, stage="C", reward_name=JUDGE, progress=False)
    assert tree_digest(runs) == before


def test_the_layout_names_every_path_of_the_pipeline(tmp_path):
    """PipelineLayout is the one place the pipeline directory's paths are spelled (the layout the stages module
    docstring draws); it names paths without creating anything."""
    layout = PipelineLayout(tmp_path)
    named = {
        "marker": layout.marker, "token": layout.token, "conditions": layout.conditions, "summary": layout.summary,
        "report": layout.report, "a_run": layout.a_run, "c_run": layout.c_run, "a_checkpoint": layout.a_checkpoint(12),
        "a_judge_ledger": layout.a_judge_ledger, "audit_dir": layout.audit_dir,
        "audit_judge_ledger": layout.audit_judge_ledger, "audit_log": layout.audit_log,
        "attempt": layout.attempt(2), "gate_file": layout.gate_file(2), "attempt_student": layout.attempt_student(2),
        "server_log": layout.server_log("teacher"), "request_log": layout.request_log("student"),
    }
    assert {k: layout.relative(v).as_posix() for k, v in named.items()} == {
        "marker": "pipeline.json", "token": "judge.token", "conditions": "conditions.jsonl",
        "summary": "summary.json", "report": "report.html", "a_run": "A", "c_run": "C",
        "a_checkpoint": "A/checkpoints/step_000012", "a_judge_ledger": "A/judge/ledger.sqlite", "audit_dir": "C/audit",
        "audit_judge_ledger": "C/audit/judge/ledger.sqlite", "audit_log": "C/audit.jsonl", "attempt": "B/attempt_2",
        "gate_file": "B/attempt_2/gate.json", "attempt_student": "B/attempt_2/student",
        "server_log": "teacher/server.log", "request_log": "student/requests.log",
    }
    assert list(tmp_path.iterdir()) == []  # naming a path creates nothing
    for n in (10, 2, 0):  # by attempt number, not by name: attempt_10 after attempt_2
        layout.gate_file(n).parent.mkdir(parents=True)
        layout.gate_file(n).write_text("{}")
    assert layout.gate_files() == [layout.gate_file(0), layout.gate_file(2), layout.gate_file(10)]
    assert PipelineLayout.of(SimpleNamespace(run=SimpleNamespace(output_dir=str(tmp_path), name="p"))).root == \
        tmp_path / "p"
