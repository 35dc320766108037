"""The pipeline config: one YAML file holding the run sections shared by stages A and C plus the pipeline's own.

A pipeline file is an ordinary run config (``run``, ``model``, ``data``, ``sampler``, ``train``, the algorithm
sections, ``eval``, ...) with four more sections: ``stages`` (budgets, the extension rule, per-stage overrides),
``teacher`` (the judge endpoint), ``student`` (:class:`flowforge.reward_model.config.StudentConfig`, with the quality
gate) and ``audit`` (stage C's checks against the teacher). The ``stages`` section is what marks a file as a pipeline
config (:func:`is_pipeline_file`; ``flowforge check`` uses it).

The pipeline directory is ``run.output_dir / run.name``; stage ``A`` and ``C`` are run directories inside it, made by
:func:`stage_config` from the shared sections with these keys set by the pipeline:

=====================  ================================================================================================
key                    stage A / stage C
=====================  ================================================================================================
``run.output_dir``     the pipeline directory; ``run.name`` ``A`` / ``C``
``reward.weights``     ``{vlm_judge: 1.0}``: the teacher's endpoint in A, the student's in C (or the in-process
                       ``scalar_head`` scorer with ``stages.student_serving: in_process``)
``reward.options``     ``vlm_judge``: ``teacher.judge`` plus the endpoint (``base_url``, ``model``, ``api_key_env``)
``train.steps``        A: ``budget_A / M``; C: A's steps + ``budget_C / M`` (or ``stages.c_steps``); an
                       override's ``train.steps`` / ``data.prompts_per_step`` count (:mod:`.plan`: never more than
                       the condition ledger serves)
``train.resume``       ``auto`` (C's first start: A's last checkpoint)
``checkpoint.every``   A: ``checkpoint.every`` (1 when 0: a resume replays at most one step, whose answers the judge's
                       ledger serves); C: ``audit.every`` when audits run every k steps (the last good checkpoint is
                       an audited one)
=====================  ================================================================================================

then ``stages.a_overrides`` / ``stages.c_overrides`` (``section.key=value`` strings; they may not set what the
pipeline owns: :data:`flowforge.orchestrate.plan.PROTECTED`, refused by :func:`load_pipeline`). ``stages.quick`` holds
the overrides of a short run, applied to the whole file by ``--quick`` (:func:`load_pipeline`). The file must not set
``reward.weights`` / ``reward.options`` / ``reward.required``: the teacher and the student are the rewards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowforge.config import Config, ConfigError, from_dict
from flowforge.orchestrate.plan import (audited_groups, capacity_problems, override_problems, prompts_per_step,
                                        stage_steps)
from flowforge.reward_model.config import StudentConfig
from flowforge.settings import schema
from flowforge.settings.schema import Checks, Section, merge, parse_overrides, to_dict

STUDENT_SERVING = ("server", "in_process")
GATE_ACTIONS = ("stop", "extend")
JUDGE = "vlm_judge"
SCALAR_HEAD_SCORER = "flowforge.reward_model.scalar_head:ScalarHeadScorer"
PIPELINE_SECTIONS = ("stages", "teacher", "audit", "student")
REWARD_KEYS_SET_BY_PIPELINE = ("weights", "options", "required")


@dataclass(frozen=True)
class StagesConfig(Section):
    """``stages``: the condition budgets (conditions = rows of ``data.prompts``), the A extension and the gate."""

    section_name = "stages"

    n_a: int = 0  # stage A's budget in conditions; a multiple of data.prompts_per_step (M)
    extend_delta: int = 0  # conditions one extension moves from C to A (0: no extension); a multiple of M
    extend_cap: int = 0  # the most conditions A may ever get (0: all of them)
    c_steps: int = 0  # cap on stage C's steps (0: until its budget or the pass is used up)
    seed: int = 0  # seed of the pass order (flowforge.orchestrate.ledger)
    on_gate_fail: str = "stop"  # stop | extend (give A extend_delta more conditions, retrain the student)
    student_serving: str = "server"  # server: `flowforge serve judge --student`; in_process: scalar_head scorer
    a_overrides: tuple[str, ...] = ()  # section.key=value for stage A only
    c_overrides: tuple[str, ...] = ()  # section.key=value for stage C only
    quick: tuple[str, ...] = ()  # section.key=value that `--quick` applies (before the command line's): a short run
    # the proxy arm's stage C reward (flowforge stages --arm proxy, flowforge.orchestrate.arms): a reward scorer
    # that never saw a teacher mark (a registry name such as action_idm, or pkg.module:Factory), and its options
    proxy_reward: str = ""
    proxy_options: dict[str, Any] = field(default_factory=dict)

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("n_a", "extend_delta", "extend_cap", "c_steps", "seed", allow_zero=True)
        c.choice("on_gate_fail", GATE_ACTIONS)
        c.choice("student_serving", STUDENT_SERVING)
        c.require(self.n_a >= 1, f"stages.n_a={self.n_a} must be >= 1 (stage A's budget in conditions)")
        c.require(not (self.on_gate_fail == "extend" and self.extend_delta == 0),
                  "stages.on_gate_fail='extend' needs stages.extend_delta >= 1")
        return c.problems


@dataclass(frozen=True)
class TeacherConfig(Section):
    """``teacher``: the judge stage A trains with and stage C is audited by.

    ``url`` empty: the pipeline starts ``flowforge serve judge`` on loopback with a random free port and a fresh
    token, with ``scorer`` (``--scorer``) or ``model_dir`` (``--model``) as the backend, and stops it when done; its
    request log is ``<pipeline>/teacher/requests.log``. Otherwise ``url`` is an OpenAI-compatible API root and
    ``api_key_env`` names the variable holding its key.
    """

    section_name = "teacher"

    url: str = ""
    model: str = "teacher"  # model id sent with every request (the auto-started server serves this id)
    api_key_env: str = ""  # "" with a url: no key (a server run with --no-auth)
    scorer: str = ""  # the auto-started server's --scorer (a registry name or pkg.module:Factory)
    scorer_options: dict[str, Any] = field(default_factory=dict)  # its keyword options (the server's --options)
    model_dir: str = ""  # the auto-started server's --model (a local image-text-to-text model)
    score_range: tuple[float, float] = (0.0, 1.0)  # --score-range of the auto-started scorer judge
    max_requests: int = 0  # hard budget: billed teacher requests of the whole pipeline (A and audits); 0: no limit
    judge: dict[str, Any] = field(default_factory=dict)  # vlm_judge options shared by teacher and student

    def problems(self) -> list[str]:
        c = Checks(self)
        if not self.url:
            c.require(bool(self.scorer) != bool(self.model_dir),
                      "teacher: without teacher.url give exactly one of teacher.scorer and teacher.model_dir (the "
                      "backend of the judge server the pipeline starts)")
        else:
            c.require(self.url.startswith(("http://", "https://")),
                      f"teacher.url={self.url!r} must be an http(s) API root, e.g. http://127.0.0.1:8000/v1")
        c.require(not self.scorer_options or (bool(self.scorer) and not self.url),
                  "teacher.scorer_options applies to teacher.scorer only (the judge server the pipeline starts)")
        c.require(bool(self.model), "teacher.model must name the judge model id")
        c.require(len(self.score_range) == 2 and self.score_range[1] > self.score_range[0],
                  f"teacher.score_range={list(self.score_range)} must be [low, high] with high > low")
        c.positive("max_requests", allow_zero=True)
        bad = sorted(set(self.judge) & {"model", "base_url", "api_key_env", "run_dir", "ledger", "max_billed", "paid"})
        c.require(not bad, f"teacher.judge sets {bad}: the pipeline sets the endpoint, the ledger and the budget "
                           "(teacher.max_requests); give the other vlm_judge options only")
        return c.problems


@dataclass(frozen=True)
class AuditConfig(Section):
    """``audit``: stage C's teacher audits. The teacher re-judges every group of C's steps until ``first_groups``
    groups were audited, then the groups of every step that is a multiple of ``every`` (0: no periodic audit).
    A verdict is taken once ``pool_groups`` audited groups the teacher can order have gathered since the last
    verdict (0: one step's groups alone; every group counts toward one verdict only); one below a threshold stops
    stage C at the last good checkpoint. With ``closing`` C's last steps are audited too (:meth:`closing_steps`) and
    its last step takes the closing verdict on every group gathered since the last verdict, however many, so the
    policy C hands on was trained only on steps a verdict covers. ``tie_margin``: teacher marks this close tie
    (:func:`flowforge.reward_model.evaluate.tie_blocks`); a step whose audited groups the teacher cannot order at all
    is unaudited: recorded, no verdict, and the ``max_unaudited + 1``-th such step stops C. ``flowforge check``
    simulates a verdict's size (a random student passes < ``max_null_pass``) and power (a student at the gate's bar
    is stopped >= ``min_power``) from the teacher's marks (:func:`flowforge.orchestrate.thresholds.audit_design`)."""

    section_name = "audit"

    first_groups: int = 8
    every: int = 5
    min_spearman: float = 0.55  # mean within-group Spearman of student vs teacher on a verdict's groups
    min_pairwise_accuracy: float = 0.74  # teacher-ordered pairs the student orders the same way
    max_null_pass: float = 0.01  # size: a random student passes a verdict with p < this (1: not checked)
    min_power: float = 0.8  # power: a student at student.gate's bar is stopped with p >= this (0: not checked)
    pool_groups: int = 8  # > 0: each verdict on the next pool_groups orderable audited groups (>= M); 0: a step's M
    tie_margin: float = 0.0  # teacher marks this close are a tie (its retest noise); 0: exact ties only
    max_unaudited: int = 2  # audited steps the teacher cannot order at all that C may take; one more stops it
    closing: bool = True  # audit C's last steps too, so the policy C hands on has a verdict of its own (costs a pool)

    def closing_steps(self, m: int) -> int:
        """How many of C's last steps the closing verdict audits at ``m`` groups a step: enough for one pool
        (``ceil(pool_groups / m)``, one step without pooling); 0 when ``closing`` is off or nothing is audited."""
        if not self.closing or not (self.first_groups > 0 or self.every > 0):
            return 0
        return max(1, -(-self.pool_groups // max(m, 1)))

    def due(self, step: int, *, first: int, end: int, m: int) -> bool:
        """Whether trainer step ``step`` of a stage C that runs steps ``first .. end - 1`` with ``m`` groups a step
        is audited: while fewer than ``first_groups`` of C's groups were audited, then every step that is a multiple
        of ``every``, and C's last :meth:`closing_steps` steps. The one schedule of the audits
        (:class:`~flowforge.orchestrate.stage_trainer.Auditor`) and of their plan
        (:func:`~flowforge.orchestrate.plan.audited_groups`)."""
        early = (step - first) * m < self.first_groups
        return (early or (self.every > 0 and step % self.every == 0)
                or max(first, end - self.closing_steps(m)) <= step < end)

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("first_groups", "every", "pool_groups", "max_unaudited", allow_zero=True)
        c.require(-1.0 <= self.min_spearman <= 1.0, f"audit.min_spearman={self.min_spearman} must be in [-1, 1]")
        c.require(0.0 <= self.min_pairwise_accuracy <= 1.0,
                  f"audit.min_pairwise_accuracy={self.min_pairwise_accuracy} must be in [0, 1]")
        c.require(0.0 < self.max_null_pass <= 1.0, f"audit.max_null_pass={self.max_null_pass} must be in (0, 1]")
        c.require(0.0 <= self.min_power < 1.0, f"audit.min_power={self.min_power} must be in [0, 1)")
        c.require(0.0 <= self.tie_margin < 1.0, f"audit.tie_margin={self.tie_margin} must be in [0, 1)")
        return c.problems


RUN_SECTIONS: tuple[type, ...] = tuple(f.default_factory for f in dataclasses.fields(Config))
PipelineConfig = schema.make_root(
    "PipelineConfig", (*RUN_SECTIONS, StagesConfig, TeacherConfig, AuditConfig, StudentConfig), module=__name__,
    doc="A three-stage pipeline's configuration: the run sections of stages A and C plus stages / teacher / audit / "
        "student (see flowforge.orchestrate.config).")


def is_pipeline_file(path: str | Path) -> bool:
    """Whether the YAML file at ``path`` is a pipeline config (has a top-level ``stages`` section); False when it
    cannot be read as YAML (the run-config loader reports that)."""
    try:
        return "stages" in schema.read_yaml(path)
    except (ConfigError, UnicodeDecodeError):
        return False


def load_pipeline(path: str | Path, overrides: Sequence[str] = (), *, quick: bool = False) -> Any:
    """Defaults < the YAML file < (with ``quick``: the file's ``stages.quick``) < ``section.key=value`` overrides,
    as a :data:`PipelineConfig`.

    Raises:
        ConfigError: unknown keys, wrong types, refused values, or reward keys the pipeline sets -- all at once;
            ``quick`` for a file without ``stages.quick``.
    """
    data = schema.read_yaml(path)
    nested, problems = parse_overrides(overrides)
    merged = merge(data, nested)
    if quick:
        short = (merged.get("stages") or {}).get("quick") if isinstance(merged.get("stages"), Mapping) else None
        if not short or not isinstance(short, (list, tuple)):
            raise ConfigError([f"--quick: {path} has no stages.quick (the section.key=value overrides of a short "
                               "run, e.g. examples/stages/digits.yaml's)"], header="invalid pipeline config")
        nested, problems = parse_overrides([*map(str, short), *overrides])
        merged = merge(data, nested)
    reward = merged.get("reward") or {}
    if isinstance(reward, Mapping):
        problems += [f"reward.{key}: set by the pipeline (the teacher in stage A, the student in stage C); remove "
                     "it and configure the teacher section" for key in REWARD_KEYS_SET_BY_PIPELINE if key in reward]
    try:
        cfg = schema.build(PipelineConfig, merged)
    except ConfigError as exc:
        problems += exc.problems
    else:
        for stage in ("a", "c"):
            problems += override_problems(f"stages.{stage}_overrides", getattr(cfg.stages, f"{stage}_overrides"))
    if problems:
        raise ConfigError(problems, header=f"invalid pipeline config {path}")
    return cfg


def pipeline_dir(pcfg: Any) -> Path:
    """``run.output_dir / run.name``: the directory holding the ledger and every stage."""
    return Path(pcfg.run.output_dir) / pcfg.run.name


def run_sections(pcfg: Any) -> dict[str, Any]:
    """The shared run sections of ``pcfg`` as a nested dict (what stages A and C start from)."""
    data = to_dict(pcfg)
    return {f.name: data[f.name] for f in dataclasses.fields(Config)}


def judge_options(pcfg: Any, *, base_url: str, model: str, api_key_env: str | None) -> dict[str, Any]:
    """``reward.options.vlm_judge`` for an endpoint: ``teacher.judge`` plus the endpoint."""
    return {**pcfg.teacher.judge, "model": model, "base_url": base_url, "api_key_env": api_key_env}


def stage_config(pcfg: Any, stage: str, *, steps: int, reward: Mapping[str, Any], resume: str = "auto",
                 output_dir: str | Path | None = None) -> Config:
    """The run config of stage ``stage`` (``"A"`` or ``"C"``): the shared sections with the keys of the module
    table set (``reward`` = ``{"weights": ..., "options": ...}``), then the stage's overrides. ``output_dir``: where
    the stage's run directory goes instead of the pipeline directory (a control arm's folder,
    :mod:`flowforge.orchestrate.arms`).

    Raises:
        ConfigError: the stage's overrides do not parse or give a bad config.
        ValueError: an unknown stage.
    """
    if stage not in ("A", "C"):
        raise ValueError(f"stage must be 'A' or 'C', got {stage!r}")
    s = pcfg.stages
    set_here: dict[str, Any] = {"run": {"output_dir": str(output_dir or pipeline_dir(pcfg)), "name": stage},
                                "train": {"steps": steps, "resume": resume}}
    if stage == "C" and pcfg.audit.every > 0:
        set_here["checkpoint"] = {"every": pcfg.audit.every}
    if stage == "A":
        set_here["checkpoint"] = {"every": pcfg.checkpoint.every or 1}
    nested, problems = parse_overrides(s.a_overrides if stage == "A" else s.c_overrides)
    if problems:
        raise ConfigError(problems, header=f"invalid stages.{stage.lower()}_overrides")
    data = merge(run_sections(pcfg), set_here)
    # replaced, not merged: the default weights ({digit: 1.0}) must not join the judge
    data["reward"] = {**data["reward"], "weights": dict(reward["weights"]),
                      "options": dict(reward.get("options", {})), "required": []}
    data = merge(data, nested)
    data["train"] = {**data["train"], "steps": steps}  # the plan's (flowforge.orchestrate.plan: an override caps it)
    return from_dict(data)


PLACEHOLDER_URL = "http://127.0.0.1:1/v1"
"""The endpoint :func:`check_pipeline` puts in the stage configs (the real ones exist only while the pipeline runs)."""


def _budget_problems(pcfg: Any, total: int) -> list[str]:
    s, m = pcfg.stages, pcfg.data.prompts_per_step
    problems = [f"stages.{key}={getattr(s, key)} must be a multiple of data.prompts_per_step={m} (a step takes M "
                "conditions)" for key in ("n_a", "extend_delta", "extend_cap") if getattr(s, key) % m]
    cap = s.extend_cap or total
    if s.n_a > total or cap > total:
        problems.append(f"stages.n_a={s.n_a} and stages.extend_cap={s.extend_cap} must not exceed the {total} "
                        f"conditions of data.prompts={pcfg.data.prompts!r}")
    elif cap < s.n_a:
        problems.append(f"stages.extend_cap={s.extend_cap} must be 0 or >= stages.n_a={s.n_a}")
    return problems


def _reference_student_problems(pcfg: Any) -> list[str]:
    """What a ``student.scalar_head.reference`` student needs before stage A spends the teacher: every condition's and
    every evaluation row's real future (``metadata.reference``; stage B trains on it, stage C's student requests and
    its evaluation send it), a reference strip the judge sends whole (``teacher.judge.max_side`` at least
    ``clip_frames`` x ``model.width``: a shrunk strip no longer lines up with the candidates' frames), and an ``init``
    whose first convolution takes the clip and its difference (``6 x clip_frames`` channels)."""
    from flowforge.data.prompts import load_prompts
    from flowforge.demo.paths import resolve_demo_path
    from flowforge.rewards.judge.options import JudgeOptions

    out = []
    for key in ("prompts", "eval_prompts"):
        try:
            rows = load_prompts(resolve_demo_path(getattr(pcfg.data, key)))
        except (ValueError, OSError, KeyError):
            continue  # data.prompts' own problem is reported where it is read; eval_prompts' by the stage checks
        missing = [r.metadata.get("sample_id", i) for i, r in enumerate(rows) if not r.metadata.get("reference")]
        if missing:
            out.append(f"data.{key}: {len(missing)} of {len(rows)} rows have no metadata.reference (e.g. "
                       f"{missing[:2]}); student.scalar_head.reference=true compares each candidate with its row's "
                       "real future")
    s = pcfg.student.scalar_head
    max_side = int(dict(pcfg.teacher.judge).get("max_side", JudgeOptions.max_side))
    if s.clip_frames * pcfg.model.width > max_side:
        out.append(f"teacher.judge.max_side={max_side} would shrink a reference strip of clip_frames={s.clip_frames} "
                   f"frames x model.width={pcfg.model.width} px; give at least {s.clip_frames * pcfg.model.width}")
    if s.init:
        try:
            from safetensors import safe_open

            with safe_open(str(resolve_demo_path(s.init)), framework="pt") as handle:
                first = handle.get_slice("backbone.0.weight").get_shape() if "backbone.0.weight" in handle.keys() \
                    else None
        except (OSError, ValueError):
            first = None  # a missing file is reported by the init check
        if first is not None and first[1] != 6 * s.clip_frames:
            out.append(f"student.scalar_head.init={s.init!r} has a first convolution of {first[1]} input channels; "
                       f"a reference student of clip_frames={s.clip_frames} takes {6 * s.clip_frames}")
    return out


LATER_CHECKS = {"A": ("student.gate", "audit"), "B": ("audit",), "arm": ("student.gate", "audit")}
"""Threshold checks (:mod:`flowforge.orchestrate.thresholds`, by the name their problems start with) of the stages
after ``--stage X``: warnings, not problems, when only stage X runs. ``"arm"`` (``--arm teacher|proxy``): a control
arm runs stage A and its own stage C, with no gate and no audits, so their thresholds cannot refuse it."""


def _not_run(stage: str | None) -> str:
    """Why a threshold problem is only a warning for ``stage`` (a :data:`LATER_CHECKS` key)."""
    return "not used by a control arm (no gate, no audits)" if stage == "arm" else \
        f"for a later stage than --stage {stage}"


def check_pipeline(pcfg: Any, *, this_machine: bool = True, stage: str | None = None,
                   notes: list[str] | None = None) -> list[str]:
    """Check a pipeline config as a whole before anything loads: the budgets against the prompt file, the student
    and audit rules, the teacher's scorer, and both stage run configs through
    :func:`flowforge.train.preflight.preflight` (with a placeholder endpoint; ``this_machine`` as there). Returns the
    warnings. ``stage`` (``--stage``, or ``"arm"`` for ``--arm``): the gate and audit thresholds of stages that do
    not run (:data:`LATER_CHECKS`) are warnings (stage A alone needs no reachable gate; an arm has neither).
    ``notes``: gets what ``flowforge check`` prints besides (the audit schedule, and the audits' size and power,
    :func:`flowforge.orchestrate.thresholds.design_line`).

    Raises:
        ConfigError: every problem found, in one error.
    """
    from flowforge.data.prompts import load_prompts
    from flowforge.demo.paths import resolve_demo_path
    from flowforge.orchestrate.ledger import conditions_from_records
    from flowforge.rewards.registry import check_scorer_spec
    from flowforge.train.preflight import preflight

    problems, warnings = [], []
    total = 0
    prompts = resolve_demo_path(pcfg.data.prompts)
    if not this_machine and not Path(prompts).exists():  # --portable: the GPU machine's data, counted there
        warnings.append(f"data.prompts={pcfg.data.prompts!r} is not on this machine: the budgets and the gate's "
                        "permutation null are checked where it is (flowforge check without --portable)")
        if pcfg.data.group_size >= 2:  # the audits' size and power need no prompt: checked here all the same
            from flowforge.orchestrate.thresholds import audit_problems

            found = audit_problems(pcfg, notes, warnings)
            problems += [p for p in found if not p.startswith(LATER_CHECKS.get(stage or "", ()))]
            warnings += [f"{_not_run(stage)}: {p}" for p in found if p.startswith(LATER_CHECKS.get(stage or "", ()))]
    else:
        try:
            total = len(conditions_from_records(load_prompts(prompts)))
        except (ValueError, OSError, KeyError) as exc:
            problems.append(f"data.prompts={pcfg.data.prompts!r}: {exc} (every row needs a unique "
                            "metadata.sample_id: it is the condition id)")
    if total:
        problems += _budget_problems(pcfg, total)
        capacity = capacity_problems(pcfg, total)  # what the overrides make the stages draw vs the ledger
        problems += capacity
        if not _budget_problems(pcfg, total) and not capacity:
            from flowforge.orchestrate.thresholds import test_groups_at_budget, threshold_problems

            drawn = stage_steps(pcfg, "A", pcfg.stages.n_a) * prompts_per_step(pcfg, "A")  # A's conditions
            audited = audited_groups(pcfg, total)
            if notes is not None and (pcfg.audit.first_groups > 0 or pcfg.audit.every > 0):
                notes.append(f"audit schedule: {audited[1]}")
            found, warned = threshold_problems(  # gate and audit thresholds a random student fails
                pcfg, None if drawn == pcfg.stages.n_a else test_groups_at_budget(pcfg, drawn),
                audited=audited, notes=notes)
            later = LATER_CHECKS.get(stage or "", ())
            problems += [p for p in found if not p.startswith(later)]
            warnings += [f"{_not_run(stage)}: {p}" for p in found if p.startswith(later)]
            warnings += warned
        rest = (total - pcfg.stages.n_a) // pcfg.data.prompts_per_step
        if rest == 0:
            warnings.append(f"stage C gets no step: {total} conditions - stages.n_a={pcfg.stages.n_a} is fewer than "
                            f"data.prompts_per_step={pcfg.data.prompts_per_step}")
    if pcfg.stages.student_serving == "in_process" and pcfg.student.kind != "scalar_head":
        problems.append(f"stages.student_serving='in_process' needs student.kind='scalar_head' (a vlm_json student "
                        f"is served with `flowforge serve judge --student`), got {pcfg.student.kind!r}")
    if (pcfg.stages.student_serving == "in_process" and pcfg.student.kind == "scalar_head"
            and pcfg.student.scalar_head.reference):
        problems.append("stages.student_serving='in_process' cannot serve a student.scalar_head.reference=true student "
                        "(the trainer's scorers get no reference; a judge request carries it): use 'server'")
    if this_machine and pcfg.student.kind == "scalar_head" and pcfg.student.scalar_head.reference:
        problems += _reference_student_problems(pcfg)
    if pcfg.stages.proxy_reward:
        problems += [f"stages.proxy_reward: {p}" for p in check_scorer_spec(pcfg.stages.proxy_reward,
                                                                            dict(pcfg.stages.proxy_options))]
    if pcfg.teacher.scorer and not pcfg.teacher.url:
        where = "teacher.scorer / teacher.scorer_options" if pcfg.teacher.scorer_options else "teacher.scorer"
        problems += [f"{where}: {p}" for p in check_scorer_spec(pcfg.teacher.scorer, dict(pcfg.teacher.scorer_options))]
    init = pcfg.student.scalar_head.init
    if this_machine and pcfg.student.kind == "scalar_head" and init:  # found before stage A runs, not after it
        try:
            found = Path(resolve_demo_path(init)).is_file()
        except ValueError as exc:
            problems.append(f"student.scalar_head.init: {exc}")
        else:
            if not found:
                problems.append(f"student.scalar_head.init={init!r}: no such file (a .safetensors of the student "
                                "network's tensors, e.g. from python -m flowforge.reward_model.pretrain, or "
                                "demo:digit-tower)")
    judge = judge_options(pcfg, base_url=PLACEHOLDER_URL, model=pcfg.teacher.model, api_key_env=None)
    reward = {"weights": {JUDGE: 1.0}, "options": {JUDGE: judge}}
    # teacher.judge's problems once, under its own name (both stages would report them as reward.options.vlm_judge)
    where = f"reward.options.{JUDGE}"
    judged = [p.replace(where, "teacher.judge", 1) for p in check_scorer_spec(JUDGE, judge)]
    problems += judged
    stale: dict[str, int] = {}  # stage -> its train.max_staleness > 0: refused once below, not per preflight rule
    for stage in ("A", "C"):
        try:
            cfg = stage_config(pcfg, stage, steps=1, reward=reward)
            stale.update({stage: cfg.train.max_staleness} if cfg.train.max_staleness else {})
            warnings += [f"stage {stage}: {w}" for w in preflight(cfg, this_machine=this_machine).warnings]
        except ConfigError as exc:
            problems += [f"stage {stage}: {p}" for p in exc.problems if not (judged and p.startswith(where))
                         and not (stage in stale and p.startswith("train.max_staleness="))]
            continue
        if stage == "C" and pcfg.audit.every > 0 and cfg.checkpoint.keep < 2:
            problems.append(f"checkpoint.keep={cfg.checkpoint.keep} must be >= 2 for stage C with audits every "
                            f"{pcfg.audit.every} steps (the last good checkpoint must outlive the next one)")
    if stale:  # the trainer refuses it too (Lookahead), but only once the model has loaded
        problems.append(", ".join(f"stage {k}: train.max_staleness={v}" for k, v in stale.items()) + ": the "
                        "stages' condition ledger and judges see each step in order, so a stage rolls out on-policy; "
                        "allowed: train.max_staleness=0")
    if problems:
        raise ConfigError(problems, header="invalid pipeline config")
    return warnings
