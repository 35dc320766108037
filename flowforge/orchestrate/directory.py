"""The pipeline directory as flowforge's own: the name of every path in it, its marker, its place under the shared
write rule, and the paths its state files record.

- :class:`PipelineLayout` names every path the pipeline reads or writes (no other module joins path parts of the
  pipeline directory by hand)::

      <run.output_dir>/<run.name>/
        pipeline.json  judge.token  conditions.jsonl      the marker, the judge servers' token, the condition ledger
        summary.json   report.html                        the pipeline's report
        teacher/ student/  server.log  requests.log       the judge servers the pipeline started
        teacher/scorer_options.yaml                       the teacher's --options (with teacher.scorer_options)
        A/  judge/ledger.sqlite                           stage A's run directory, its teacher requests
        B/attempt_<n>/  gate.json  student/               each gate attempt: its verdict, its student
        C/  audit.jsonl  audit/judge/ledger.sqlite        stage C's run directory, its audits and their requests
        arms/<arm>/conditions.jsonl  arms/<arm>/C/        a control arm's ledger and stage C (orchestrate.arms)
        last_good/step_<n>/C/                             after an audit stop: the eval of C's last good checkpoint

- :func:`mark_pipeline_dir` writes ``pipeline.json`` (:data:`~flowforge.runtime.write_guard.PIPELINE_MARKER`) when the
  pipeline claims its directory; from then on the shared write rule (:mod:`flowforge.runtime.write_guard`) refuses
  every other writer in it or below it (``data prepare --output``, ``serve judge --request-log``, ``sample --out``,
  ``export``, ``flowforge train``), as it does for a run directory. The pipeline's own writers are let in: its stage
  trainers (``Trainer(own_area=...)`` of :func:`~flowforge.orchestrate.stage_trainer.stage_trainer`) and the judge
  servers it starts
  (which prove it by the pipeline's lock: :func:`flowforge.runtime.lock.held_by_parent`).
- :func:`check_pipeline_dir` is the rule for the pipeline directory itself.
- :func:`record_path` / :func:`recorded_path`: paths in the pipeline's state files (``gate.json``'s student, the
  summary's last good checkpoint) are relative to the pipeline directory, so a moved or copied pipeline directory,
  or a rerun from another working directory, uses its own files; a record that leads outside it is refused, never
  followed to another pipeline's student.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flowforge.demo.paths import resolve_demo_path
from flowforge.orchestrate.config import pipeline_dir
from flowforge.orchestrate.servers import TOKEN_FILE
from flowforge.rewards.judge.client import LEDGER_FILE as JUDGE_LEDGER_FILE
from flowforge.runtime.durable import step_dir_name, write_bytes
from flowforge.runtime.errors import UserError
from flowforge.runtime.run_dir import CHECKPOINTS_DIR
from flowforge.runtime.write_guard import PIPELINE_MARKER, check_write_target, enclosing, real

CONDITIONS_FILE = "conditions.jsonl"
GATE_FILE = "gate.json"
AUDIT_FILE = "audit.jsonl"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.html"
ATTEMPT_PREFIX = "attempt_"
PIPELINE_MARKER_RECORD = {"kind": "flowforge pipeline directory",
                          "note": "written by `flowforge stages`; every file here is the pipeline's own, and flowforge "
                                  "refuses any other writer (data prepare --output, serve judge --request-log, "
                                  "sample --out, export, train)"}


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Every path of the pipeline directory ``root`` (module docstring), by name. Nothing is created or checked:
    the properties only name paths."""

    root: Path  # the pipeline directory, run.output_dir / run.name

    @classmethod
    def of(cls, pcfg: Any) -> PipelineLayout:
        """The layout of ``pcfg``'s pipeline directory (:func:`flowforge.orchestrate.config.pipeline_dir`)."""
        return cls(pipeline_dir(pcfg))

    # ---- the pipeline's own files
    @property
    def marker(self) -> Path:
        return self.root / PIPELINE_MARKER

    @property
    def token(self) -> Path:
        """The judge servers' bearer token (:func:`~flowforge.orchestrate.servers.pipeline_token`)."""
        return self.root / TOKEN_FILE

    @property
    def conditions(self) -> Path:
        """The condition ledger (:class:`~flowforge.orchestrate.ledger.ConditionLedger`)."""
        return self.root / CONDITIONS_FILE

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def report(self) -> Path:
        return self.root / REPORT_FILE

    # ---- stages
    def stage(self, name: str) -> Path:
        """The folder of stage ``name``: ``"A"`` / ``"C"`` run directories, ``"B"`` the gate attempts."""
        return self.root / name

    @property
    def a_run(self) -> Path:
        return self.stage("A")

    @property
    def c_run(self) -> Path:
        return self.stage("C")

    def a_checkpoint(self, step: int) -> Path:
        """Stage A's checkpoint of ``step`` (stage C resumes from A's last)."""
        return self.a_run / CHECKPOINTS_DIR / step_dir_name(step)

    @property
    def a_judge_ledger(self) -> Path:
        """Stage A's teacher requests (the judge client's request ledger in A's run directory)."""
        return self.a_run / JUDGE_LEDGER_FILE

    def last_good_run(self, step: int) -> Path:
        """After an audit stop: the run directory that holds the held-out evaluation of stage C's last good checkpoint
        of ``step`` (the policy the pipeline hands on; :func:`~flowforge.orchestrate.stages.evaluate_last_good`):
        ``last_good/step_<step>/C``, one per checkpoint, so an evaluation is never read for another checkpoint."""
        return self.root / "last_good" / step_dir_name(step) / "C"

    @property
    def audit_dir(self) -> Path:
        """The run directory of stage C's audit judge (the teacher)."""
        return self.c_run / "audit"

    @property
    def audit_judge_ledger(self) -> Path:
        return self.audit_dir / JUDGE_LEDGER_FILE

    @property
    def audit_log(self) -> Path:
        """Stage C's audit records, one line per audited step."""
        return self.c_run / AUDIT_FILE

    def attempt(self, n: int) -> Path:
        """The folder of gate attempt ``n`` (0, then one per extension of stage A)."""
        return self.stage("B") / f"{ATTEMPT_PREFIX}{n}"

    def gate_file(self, n: int) -> Path:
        return self.attempt(n) / GATE_FILE

    def attempt_student(self, n: int) -> Path:
        """The student gate attempt ``n`` trains (:func:`flowforge.reward_model.train.train_student` writes it)."""
        return self.attempt(n) / "student"

    def gate_files(self) -> list[Path]:
        """The gate records present, by attempt number."""
        found = self.stage("B").glob(f"{ATTEMPT_PREFIX}*/{GATE_FILE}")
        return sorted(found, key=lambda p: int(p.parent.name.removeprefix(ATTEMPT_PREFIX)))

    # ---- control arms (flowforge.orchestrate.arms)
    def arm_dir(self, arm: str) -> Path:
        """``arms/<arm>``: a control arm's condition ledger and its stage C run directory ``C/``."""
        return self.root / "arms" / arm

    def arm_judge_ledger(self, arm: str) -> Path:
        """The teacher requests of a control arm's stage C (its judge's request ledger)."""
        return self.arm_dir(arm) / "C" / JUDGE_LEDGER_FILE

    # ---- the judge servers the pipeline starts
    def server_dir(self, name: str) -> Path:
        """The folder of the ``name`` judge server (``"teacher"``, ``"student"``): its logs."""
        return self.root / name

    def server_log(self, name: str) -> Path:
        return self.server_dir(name) / "server.log"

    def request_log(self, name: str) -> Path:
        return self.server_dir(name) / "requests.log"

    def server_options(self, name: str) -> Path:
        """The ``--options`` file of the ``name`` judge server (its scorer's keyword options, YAML)."""
        return self.server_dir(name) / "scorer_options.yaml"

    def relative(self, path: Path) -> Path:
        """``path`` (a path of this layout) relative to the pipeline directory, for messages and links."""
        return path.relative_to(self.root)


def mark_pipeline_dir(directory: Path) -> None:
    """Write the pipeline directory's marker :data:`~flowforge.runtime.write_guard.PIPELINE_MARKER` (atomically)
    when it is missing: a directory made before the marker existed gets it on its next run."""
    marker = PipelineLayout(Path(directory)).marker
    if not marker.is_file():
        write_bytes(marker, (json.dumps(PIPELINE_MARKER_RECORD, indent=1) + "\n").encode())


def check_pipeline_dir(pcfg: Any, inputs: Mapping[str, str | Path] | None = None) -> Path:
    """The shared write rule (:func:`flowforge.runtime.write_guard.check_write_target`) for the pipeline directory
    ``run.output_dir / run.name``, before anything is written: not a run directory or checkpoint, not inside a run, a
    checkpoint, another pipeline directory, the base model, the prompt files, the teacher's model directory or
    ``inputs`` (label -> path: the config file). Returns it resolved.

    Raises:
        UserError: naming the directory, what it lies inside, and what to do.
    """
    local = {"base model": pcfg.model.path, "data.prompts": pcfg.data.prompts,
             "data.eval_prompts": pcfg.data.eval_prompts, "teacher.model_dir": pcfg.teacher.model_dir}
    protected = {label: Path(resolve_demo_path(value)) for label, value in local.items()
                 if value and Path(resolve_demo_path(value)).exists()}  # a hub id or a missing path holds nothing
    protected.update(inputs or {})
    directory = pipeline_dir(pcfg)
    what = "pipeline directory (run.output_dir / run.name)"
    found = enclosing(directory)
    if found is not None and found[1] == real(directory) and found[0] != "pipeline directory":
        raise UserError(f"{what} {directory}", f"is the {found[0]} {found[1]}",
                        "choose a pipeline directory of its own; flowforge never writes into a run or a checkpoint "
                        "it is not producing")
    return check_write_target(directory, what, protected=protected, own=directory)


def student_dir(pcfg: Any, record: Mapping[str, Any]) -> Path:
    """The student a passed gate record names, in this pipeline directory (:func:`recorded_path`).

    Raises:
        UserError: the recorded path does not exist in the pipeline directory or lies outside it.
    """
    layout = PipelineLayout.of(pcfg)
    gate, own = layout.gate_file(record["attempt"]), layout.attempt_student(record["attempt"])
    return recorded_path(layout.root, record["student"], f"{gate}: student",
                         f"this pipeline's student of attempt {record['attempt']} is {own}: set "
                         f"\"student\" to \"{layout.relative(own).as_posix()}\" in that file when it is there, or "
                         "remove the file to train and gate the student again")


def record_path(directory: str | Path, path: str | Path) -> str:
    """``path`` as the pipeline's state files record it: relative to the pipeline ``directory`` (POSIX), so the
    directory can be moved or copied and rerun from any working directory (:func:`recorded_path` reads it).

    Raises:
        ValueError: ``path`` lies outside ``directory`` (the pipeline records only its own files).
    """
    root, where = real(directory), real(path)
    if not where.is_relative_to(root):
        raise ValueError(f"{path} lies outside the pipeline directory {directory}; the pipeline records only its own "
                         "files")
    return where.relative_to(root).as_posix()


def recorded_path(directory: str | Path, value: str, what: str, fix: str) -> Path:
    """The file or directory a state-file entry names: ``value`` relative to the pipeline ``directory``
    (:func:`record_path`); a record written before paths were relative (absolute, or relative to the first run's
    working directory) is used while it names an existing path inside ``directory``. Never a path outside it:
    a copied or moved pipeline would otherwise serve the original pipeline's files.

    Args:
        directory: the pipeline directory. value: the recorded path. what: the entry, for the message
            (``"B/attempt_0/gate.json: student"``). fix: what to do when it is refused.

    Returns:
        ``directory / <path relative to it>``.

    Raises:
        UserError: the path does not exist in ``directory`` or lies outside it (symlinks resolved).
    """
    root = real(directory)
    recorded = Path(value)
    places = ([] if recorded.is_absolute() else [Path(directory) / recorded]) + [recorded]
    for place in places:  # the current form first; then the old one (absolute, or the first run's cwd)
        if real(place).is_relative_to(root) and place.exists():
            return Path(directory) / real(place).relative_to(root)
    outside = [real(p) for p in places if not real(p).is_relative_to(root) and p.exists()]
    why = (f"records {value!r}: {outside[0]}, outside the pipeline directory {directory} (a record of another "
           "pipeline, or of this one before it was moved or copied)" if outside else
           f"records {value!r}, which names no existing path inside the pipeline directory {directory}")
    raise UserError(what, why, fix)
