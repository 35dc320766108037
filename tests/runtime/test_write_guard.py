"""The shared write rule (flowforge.runtime.write_guard): resolved targets, runs, checkpoints, protected inputs."""

import pytest

from flowforge.runtime.errors import UserError
from flowforge.runtime.write_guard import check_write_target


@pytest.fixture
def tree(tmp_path):
    run = tmp_path / "runs" / "base"
    step = run / "checkpoints" / "step_000006"
    (step / "weights").mkdir(parents=True)
    (step / "COMMITTED").write_text("")
    (run / "config.yaml").write_text("run: {}\n")
    (run / "samples").mkdir()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "data.jsonl").write_text("{}\n")
    (tmp_path / "runlink").symlink_to(run, target_is_directory=True)
    return tmp_path, run, step


@pytest.mark.parametrize("rel, why", [
    ("runs/base/samples/step_000006.png", "lies inside the run directory"),
    ("runs/base", "is the run directory"),
    ("runs/base/checkpoints/step_000006/weights/live.png", "lies inside the checkpoint"),
    ("runlink/samples/x.png", "lies inside the run directory"),
    ("in/../runs/base/new/x.png", "lies inside the run directory"),
    ("in/../in/data.jsonl", "is the input"),
    ("in/data.jsonl/x", "lies inside the input"),
])
def test_refused_targets_name_the_protecting_directory(tree, rel, why):
    root, _, _ = tree
    with pytest.raises(UserError, match=why) as info:
        check_write_target(root / rel, "--out", protected={"input": root / "in" / "data.jsonl"})
    assert str(info.value).startswith("--out ") and "\n" not in str(info.value)


def test_allowed_targets(tree):
    root, run, step = tree
    assert check_write_target(root / "elsewhere" / "x.png", "--out") == (root / "elsewhere" / "x.png").resolve()
    assert check_write_target(root / "in" / "other.jsonl", "--out", protected={"input": root / "in" / "data.jsonl"})
    # the command's own output area: the trainer's run directory, report.html of the reported run
    assert check_write_target(root / "runlink" / "report.html", "report", own=run) == run / "report.html"
    with pytest.raises(UserError, match="lies inside the run directory"):
        check_write_target(run / "x", "--out", own=root / "other")


def test_a_tree_replaced_as_a_whole_may_not_contain_a_protected_path(tree):
    root, run, _ = tree
    with pytest.raises(UserError, match="contains the base model"):
        check_write_target(root, "OUT", protected={"base model": root / "in"}, replaces_tree=True)
    assert check_write_target(root / "in", "--out-dir", protected={"input": root / "in" / "data.jsonl"})


@pytest.mark.parametrize("marker", [["pipeline.json"], ["conditions.jsonl", "judge.token"]],
                         ids=["marked", "made-before-the-marker"])
def test_a_pipeline_directory_is_refused_to_foreign_writers_and_open_to_its_own(tmp_path, marker):
    pipe = tmp_path / "runs" / "p"
    (pipe / "teacher").mkdir(parents=True)
    for name in marker:
        (pipe / name).write_text("{}\n")
    for target in (pipe / "conditions.jsonl", pipe / "teacher" / "requests.log", pipe / "x.png", pipe):
        with pytest.raises(UserError, match=f"the pipeline directory {pipe}") as info:
            check_write_target(target, "--out")
        assert "\n" not in str(info.value)
    # its own writers (the pipeline's stages and servers) pass own=; a pipeline inside another pipeline does not
    assert check_write_target(pipe / "A", "run", own=pipe) == pipe / "A"
    with pytest.raises(UserError, match=f"lies inside {pipe / 'q'}, which lies inside the pipeline directory {pipe}"):
        check_write_target(pipe / "q" / "A", "run", own=pipe / "q")
    # a data directory that merely holds a conditions.jsonl is not a pipeline
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "conditions.jsonl").write_text("{}\n")
    assert check_write_target(tmp_path / "data" / "other.jsonl", "--output")
