"""``flowforge data curate``: dedup, min-words, missing media, the hashed split, byte-identical reruns."""

import json
import os

import pytest

from flowforge.data.prompts import load_prompts
from flowforge.data.tools.curate import CurateSettings, curate
from flowforge.data.tools.records import split_key

WORDS = "red green blue amber violet silver golden crimson ivory teal".split()


def prompt(i):
    """A distinct prompt of six words or more."""
    return f"a {WORDS[i % 10]} {WORDS[(i // 10) % 10]} kite over the hills number {i}"


def rows_of(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def ids_of(path):
    return [r["metadata"]["sample_id"] for r in rows_of(path)]


def outputs(out_dir):
    return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir())}


ARGS = ["--prefix", "P_", "--min-prompt-words", "6", "--eval-size", "12", "--eval-subset-sizes", "4", "8"]


def test_rerun_and_reordered_input_give_byte_identical_files(tmp_path, cli, write_rows, make_row):
    rows = [make_row(prompt(i), f"s{i:03d}") for i in range(60)]
    raw = write_rows(tmp_path / "raw.jsonl", rows)
    out = tmp_path / "out"
    rc, stdout, _ = cli("curate", "--input", raw, "--out-dir", out, *ARGS)
    assert rc == 0 and "kept 60" in stdout
    first = outputs(out)
    assert sorted(first) == ["P_eval.jsonl", "P_eval4.jsonl", "P_eval8.jsonl", "P_summary.json", "P_train.jsonl"]
    assert cli("curate", "--input", raw, "--out-dir", out, *ARGS, "--overwrite")[0] == 0
    assert outputs(out) == first
    shuffled = write_rows(tmp_path / "other" / "raw.jsonl", rows[::-1][30:] + rows[::-1][:30])
    assert cli("curate", "--input", shuffled, "--out-dir", tmp_path / "out2", *ARGS)[0] == 0
    assert outputs(tmp_path / "out2") == first


def test_split_is_hash_ordered_nested_and_disjoint(tmp_path, cli, write_rows, make_row):
    raw = write_rows(tmp_path / "raw.jsonl", [make_row(prompt(i), f"s{i:03d}") for i in range(60)])
    assert cli("curate", "--input", raw, "--out-dir", tmp_path, *ARGS)[0] == 0
    train, evaluation = ids_of(tmp_path / "P_train.jsonl"), ids_of(tmp_path / "P_eval.jsonl")
    expected = sorted((f"s{i:03d}" for i in range(60)), key=split_key)
    assert evaluation == expected[:12] and train == expected[12:]
    assert ids_of(tmp_path / "P_eval4.jsonl") == evaluation[:4]
    assert ids_of(tmp_path / "P_eval8.jsonl") == evaluation[:8]
    assert not set(train) & set(evaluation)
    assert len(load_prompts(tmp_path / "P_train.jsonl")) == 48 and len(load_prompts(tmp_path / "P_eval4.jsonl")) == 4


def test_adding_records_never_moves_a_train_record_into_eval(tmp_path, write_rows, make_row):
    settings = CurateSettings(eval_size=10, eval_subset_sizes=())
    small = write_rows(tmp_path / "a.jsonl", [make_row(prompt(i), f"s{i:03d}") for i in range(40)])
    large = write_rows(tmp_path / "b.jsonl", [make_row(prompt(i), f"s{i:03d}") for i in range(80)])
    curate(small, tmp_path / "a", settings)
    curate(large, tmp_path / "b", settings)
    assert not set(ids_of(tmp_path / "a" / "train.jsonl")) & set(ids_of(tmp_path / "b" / "eval.jsonl"))


def test_dedup_keeps_the_smallest_id_and_counts_each_drop_once(tmp_path, cli, write_rows, make_row, png):
    png(tmp_path / "a.png")
    png(tmp_path / "b.png", 9)
    rows = [
        make_row(prompt(1), "z-late"),
        make_row("  A " + prompt(1)[2:].upper() + " ", "a-early"),  # same words up to case and spacing
        make_row(prompt(1), "m-mid"),
        make_row("tiny prompt", "short-1"),
        make_row("tiny prompt", "short-2"),  # too short first: never counted as a duplicate
        make_row(prompt(2), "img-a", image="a.png"),
        make_row(prompt(2), "img-b", image="b.png"),  # other media: not a duplicate
        make_row(prompt(2), "img-a2", image="./a.png"),  # the same file spelled differently: a duplicate
        make_row(prompt(3), "gone", image="missing.png"),
    ] + [make_row(prompt(10 + i), f"fill{i}") for i in range(6)]
    raw = write_rows(tmp_path / "raw.jsonl", rows)
    rc, stdout, _ = cli("curate", "--input", raw, "--out-dir", tmp_path / "o", "--eval-size", "2",
                        "--eval-subset-sizes")
    assert rc == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["dropped"] == {"too_short": 2, "missing_media": 1, "duplicate": 3}
    assert summary["dropped_examples"]["duplicate"] == ["img-a2", "m-mid", "z-late"]
    assert summary["records_read"] == 15 and summary["kept"] == 9
    assert summary["counts"] == {"train": 7, "eval": 2}
    kept = set(ids_of(tmp_path / "o" / "train.jsonl")) | set(ids_of(tmp_path / "o" / "eval.jsonl"))
    assert {"a-early", "img-a", "img-b"} <= kept and not {"z-late", "m-mid", "img-a2", "gone"} & kept
    assert "3 duplicate" in stdout


def test_min_words_ignores_placeholders_and_zero_keeps_all(tmp_path, write_rows, make_row, png):
    png(tmp_path / "c.png")
    rows = [make_row("one two three four five six", "six"), make_row("one two three four five", "five"),
            make_row("<image> one two three four five", "five+ph", image="c.png")]
    rows += [make_row(prompt(i), f"f{i}") for i in range(3)]
    raw = write_rows(tmp_path / "raw.jsonl", rows)
    summary = curate(raw, tmp_path / "o", CurateSettings(eval_size=1, eval_subset_sizes=()))
    assert summary["dropped"]["too_short"] == 2 and sorted(summary["dropped_examples"]["too_short"]) == [
        "five", "five+ph"]
    summary = curate(raw, tmp_path / "o", CurateSettings(min_prompt_words=0, eval_size=1, eval_subset_sizes=()),
                     overwrite=True)
    assert summary["kept"] == 6


def test_missing_media_dropped_unless_no_check_media_and_paths_rebased(tmp_path, cli, write_rows, make_row, png):
    png(tmp_path / "data" / "frames" / "x.png")
    rows = [make_row(prompt(i), f"i2i-{i}", task="i2i", image="frames/x.png") for i in range(4)]
    rows.append(make_row(prompt(9), "i2i-missing", task="i2i", image="frames/none.png"))
    raw = write_rows(tmp_path / "data" / "raw.jsonl", rows)
    out = tmp_path / "curated"
    assert cli("curate", "--input", raw, "--out-dir", out, "--eval-size", "1", "--eval-subset-sizes")[0] == 0
    assert json.loads((out / "summary.json").read_text())["dropped"]["missing_media"] == 1
    for record in load_prompts(out / "train.jsonl") + load_prompts(out / "eval.jsonl"):
        assert record.metadata["image"] == str((tmp_path / "data" / "frames" / "x.png").resolve())
    assert rows_of(out / "eval.jsonl")[0]["metadata"]["image"] == "../data/frames/x.png"
    assert cli("curate", "--input", raw, "--out-dir", out, "--eval-size", "1", "--eval-subset-sizes",
               "--no-check-media", "--overwrite")[0] == 0
    assert json.loads((out / "summary.json").read_text())["kept"] == 5


@pytest.mark.parametrize("size, fraction, kept, expected", [
    (None, None, 5000, 2048), (100, None, 5000, 100), (None, 0.1, 5000, 500), (300, 0.1, 5000, 300),
    (800, 0.1, 5000, 500), (None, 0.1, 19, 1),
])
def test_eval_size_and_fraction_interaction(size, fraction, kept, expected):
    assert CurateSettings(eval_size=size, eval_fraction=fraction).eval_count(kept) == expected


@pytest.mark.parametrize("args, must_mention", [
    (["--eval-size", "20"], "eval and train must each hold"),
    (["--eval-fraction", "0.01"], "eval and train must each hold"),
    (["--eval-size", "5", "--eval-subset-sizes", "8"], "exceed the eval set"),
    (["--eval-fraction", "1.5"], "--eval-fraction"),
    (["--prefix", "a/b_"], "--prefix"),
], ids=["eval-too-big", "eval-empty", "subset-too-big", "bad-fraction", "bad-prefix"])
def test_impossible_settings_exit_2_and_write_nothing(tmp_path, cli, write_rows, make_row, args, must_mention):
    raw = write_rows(tmp_path / "raw.jsonl", [make_row(prompt(i), f"s{i}") for i in range(20)])
    rc, _, err = cli("curate", "--input", raw, "--out-dir", tmp_path / "o", *args)
    assert rc == 2 and must_mention in err
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_schema_errors_name_the_line_and_ids_must_not_collide(tmp_path, cli, write_rows, make_row):
    good = [make_row(prompt(i), f"s{i}") for i in range(4)]
    raw = write_rows(tmp_path / "raw.jsonl", good + [make_row(prompt(8), "s9", task="t2x")])
    rc, _, err = cli("curate", "--input", raw, "--out-dir", tmp_path / "o", "--eval-size", "1")
    assert rc == 2 and f"{raw}:5" in err and "metadata.task" in err
    raw = write_rows(tmp_path / "raw.jsonl", good + [make_row(prompt(8), "s1")])
    rc, _, err = cli("curate", "--input", raw, "--out-dir", tmp_path / "o", "--eval-size", "1")
    assert rc == 2 and f"{raw}:5" in err and "line 2" in err
    raw = write_rows(tmp_path / "raw.jsonl", good + [good[1]])  # a verbatim repeat is only a duplicate
    assert cli("curate", "--input", raw, "--out-dir", tmp_path / "o", "--eval-size", "1",
               "--eval-subset-sizes")[0] == 0
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["dropped"]["duplicate"] == 1


def test_refuses_existing_outputs_symlinks_and_the_input(tmp_path, cli, write_rows, make_row):
    raw = write_rows(tmp_path / "raw.jsonl", [make_row(prompt(i), f"s{i}") for i in range(6)])
    args = ["--eval-size", "2", "--eval-subset-sizes", "1"]
    assert cli("curate", "--input", raw, "--out-dir", tmp_path / "o", *args)[0] == 0
    rc, _, err = cli("curate", "--input", raw, "--out-dir", tmp_path / "o", *args)
    assert rc == 2 and "already exists" in err
    target = tmp_path / "elsewhere.jsonl"
    target.write_text("precious\n")
    (tmp_path / "o" / "eval1.jsonl").unlink()
    os.symlink(target, tmp_path / "o" / "eval1.jsonl")
    rc, _, err = cli("curate", "--input", raw, "--out-dir", tmp_path / "o", *args, "--overwrite")
    assert rc == 2 and "symbolic link" in err and target.read_text() == "precious\n"
    raw = write_rows(tmp_path / "in" / "train.jsonl", [make_row(prompt(i), f"s{i}") for i in range(6)])
    rc, _, err = cli("curate", "--input", raw, "--out-dir", tmp_path / "in", "--eval-size", "1",
                     "--eval-subset-sizes", "--overwrite")
    assert rc == 2 and "is the input" in err


def test_out_dir_through_dotdot_or_a_symlink_onto_the_input_is_refused(tmp_path, cli, write_rows, make_row):
    """Issue 24 item 2: `--out-dir in/d1/../d1` and a symlinked directory both name the input's directory; the
    guard compares resolved paths, so the 40-row input stays whole."""
    raw = write_rows(tmp_path / "in" / "d1" / "train.jsonl", [make_row(prompt(i), f"s{i}") for i in range(40)])
    (tmp_path / "alias").symlink_to(tmp_path / "in" / "d1", target_is_directory=True)
    before = raw.read_bytes()
    for out_dir in (tmp_path / "in" / "d1" / ".." / "d1", tmp_path / "alias"):
        rc, _, err = cli("curate", "--input", raw, "--out-dir", out_dir, "--eval-size", "8", "--eval-subset-sizes",
                         "--overwrite")
        assert rc == 2 and "is the input" in err and len(err.strip().splitlines()) == 1
    assert raw.read_bytes() == before
    rc, _, err = cli("prepare", "--source", "jsonl", "--input", raw, "--output", tmp_path / "alias" / "train.jsonl",
                     "--overwrite")
    assert rc == 2 and "is the input" in err and raw.read_bytes() == before


def test_out_dir_inside_a_run_is_refused(tmp_path, cli, write_rows, make_row):
    raw = write_rows(tmp_path / "raw.jsonl", [make_row(prompt(i), f"s{i}") for i in range(6)])
    run = tmp_path / "runs" / "base"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {}\n")
    rc, _, err = cli("curate", "--input", raw, "--out-dir", run / "data", "--eval-size", "2", "--eval-subset-sizes")
    assert rc == 2 and "lies inside the run directory" in err and not (run / "data").exists()


_KILL = """
import os, sys
from flowforge.data.tools.curate import CurateSettings, curate
def hook(stage, name):
    if stage == sys.argv[3] and (stage == "tmp" or name.endswith("train.jsonl")):
        os.kill(os.getpid(), 9)
curate(sys.argv[1], sys.argv[2], CurateSettings(eval_size=int(sys.argv[4]), eval_subset_sizes=()), overwrite=True,
       hook=hook)
"""


@pytest.mark.parametrize("stage", ["tmp", "renamed"])
def test_kill_during_curate_overwrite_never_leaves_an_unmarked_mix(tmp_path, write_rows, make_row, stage):
    """kill -9 once every temporary is written (old set intact, no marker) or after the first rename (a mixed set,
    marked; readers refuse it); a rerun completes the set and removes the marker."""
    import subprocess
    import sys

    raw = write_rows(tmp_path / "raw.jsonl", [make_row(prompt(i), f"s{i}") for i in range(64)])
    out = tmp_path / "out"
    curate(raw, out, CurateSettings(eval_size=8, eval_subset_sizes=()))
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = subprocess.run([sys.executable, "-c", _KILL, str(raw), str(out), stage, "16"], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    now = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}
    markers = list(out.glob(".flowforge-incomplete*"))
    if stage == "tmp":
        assert now == old and not markers
        load_prompts(out / "train.jsonl")
    else:
        assert now["train.jsonl"] != old["train.jsonl"] and now["eval.jsonl"] == old["eval.jsonl"]
        assert len(markers) == 1
        with pytest.raises(ValueError, match="interrupted"):
            load_prompts(out / "eval.jsonl")
    curate(raw, out, CurateSettings(eval_size=16, eval_subset_sizes=()), overwrite=True)
    assert not list(out.glob(".flowforge-incomplete*")) and not list(out.glob(".*tmp-*"))
    assert len(ids_of(out / "train.jsonl")) + len(ids_of(out / "eval.jsonl")) == 64
