"""The pipeline directory's recorded paths (flowforge.orchestrate.directory, issue 42): relative to the pipeline
directory, so a copied or moved pipeline (or a rerun from another working directory) uses its own student; a record
leading outside it is refused, never followed to another pipeline's student."""

import json
import shutil
from types import SimpleNamespace

import pytest

from flowforge.orchestrate.directory import GATE_FILE, mark_pipeline_dir, record_path, recorded_path, student_dir
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
