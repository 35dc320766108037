"""Issue 43 item 7: a short pipeline run -- ``--stage A`` needs no reachable gate, the gate's problem names
``stages.n_a`` and the smallest one that passes (found by inverting the test-group count and the permutation null),
and ``--quick`` applies the config's ``stages.quick`` overrides. No pipeline runs here."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flowforge.cli import main
from flowforge.config import ConfigError
from flowforge.orchestrate import thresholds
from flowforge.orchestrate.config import check_pipeline, load_pipeline, pipeline_dir

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stages" / "digits.yaml"


def test_the_gate_problem_names_stages_n_a_and_the_smallest_that_passes():
    pcfg = load_pipeline(EXAMPLE, ["stages.n_a=8"])
    with pytest.raises(ConfigError) as caught:
        check_pipeline(pcfg)
    (problem,) = caught.value.problems
    assert problem.startswith("student.gate: 0 test groups at stages.n_a=8 (K=8 candidates each)")
    assert problem.endswith("the smallest stages.n_a that passes is 92 (8 test groups)")
    assert check_pipeline(load_pipeline(EXAMPLE, ["stages.n_a=92"])) == []  # and it does pass


@pytest.mark.parametrize("overrides", [[], ["student.gate.min_groups=1"], ["student.gate.min_groups=1",
                                                                        "student.gate.min_spearman=0.4"]])
def test_smallest_passing_n_a_is_the_first_budget_a_linear_scan_finds(overrides):
    """Bisection over the budgets equals the slow scan: the first multiple of M whose test groups pass min_groups
    and the null (min_groups 8: the count decides; min_groups 1: the null does, at a few groups)."""
    pcfg = load_pipeline(EXAMPLE, overrides)
    counts = thresholds.test_groups_by_budget(pcfg)
    assert counts[96] == thresholds.test_groups_at_budget(pcfg) == 9  # the example's stated 9 test groups
    m = pcfg.data.prompts_per_step
    scan = next((n, counts[n]) for n in range(m, len(counts), m) if thresholds.gate_reachable(pcfg, counts[n]))
    assert thresholds.smallest_passing_n_a(pcfg) == scan
    n_a, groups = scan
    assert not thresholds.gate_reachable(pcfg, counts[n_a - m]) and groups >= pcfg.student.gate.min_groups


def test_no_budget_passes_an_unreachable_gate():
    pcfg = load_pipeline(EXAMPLE, ["student.gate.min_groups=500"])
    assert thresholds.smallest_passing_n_a(pcfg) is None
    with pytest.raises(ConfigError, match="no stages.n_a up to all 220 conditions passes"):
        check_pipeline(pcfg)


def test_stage_a_alone_does_not_need_stage_b_s_gate(capsys):
    pcfg = load_pipeline(EXAMPLE, ["stages.n_a=8"])
    warnings = check_pipeline(pcfg, stage="A")
    assert any(w.startswith("for a later stage than --stage A: student.gate: 0 test groups at stages.n_a=8")
               for w in warnings)
    with pytest.raises(ConfigError, match="student.gate"):
        check_pipeline(pcfg, stage="B")  # B is the gate
    assert main(["check", str(EXAMPLE), "stages.n_a=8", "--stage", "A"]) == 0
    assert "smallest stages.n_a that passes is 92" in capsys.readouterr().err
    assert main(["check", str(EXAMPLE), "stages.n_a=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stages.n_a=8" in err[0] and "smallest stages.n_a that passes is 92" in err[0]


def test_quick_applies_the_config_s_short_run_before_the_command_line(tmp_path, capsys):
    pcfg = load_pipeline(EXAMPLE, ["eval.max_prompts=10"], quick=True)
    assert check_pipeline(pcfg) == []  # its gate is reachable: the whole short pipeline can run
    assert pipeline_dir(pcfg) == Path("runs/digits-stages-quick")  # never mixed with a full run's ledger
    assert (pcfg.stages.n_a, pcfg.stages.c_steps, pcfg.run.num_threads) == (64, 8, 1)
    assert pcfg.eval.max_prompts == 10  # the command line wins
    assert load_pipeline(EXAMPLE).stages.n_a == 96  # without --quick the file's own values
    plain = yaml.safe_load(EXAMPLE.read_text())
    del plain["stages"]["quick"]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(plain))
    assert main(["check", str(path), "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--quick:" in err and "has no stages.quick" in err
