"""PromptSet: a prompt file held as byte offsets gives the same rows and errors as load_prompts, at bytes per row."""

import json
import os
import tracemalloc

import pytest

from flowforge.data.prompt_set import open_prompts
from flowforge.data.prompts import check_task, load_prompts


def _row(i, task="t2i", **extra):
    return json.dumps({"prompt": f"prompt {i}", "metadata": {"task": task, "sample_id": f"id{i}", **extra}})


def _jsonl_with_every_line_ending(tmp_path):
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "frame.png")
    text = (f"{_row(0, digit=3)}\n\n{_row(1, task='i2v', image='frame.png')}\r\n  \r\n{_row(2)}\r{_row(3)}\n"
            f"{_row(4)}")  # blank lines, CRLF, a lone CR, no final newline
    (tmp_path / "p.jsonl").write_bytes(text.encode())
    return tmp_path / "p.jsonl"


def _txt_with_repeats(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n\na cat\n  a dog  \nünïcode prompt\n")
    return tmp_path / "p.txt"


def _dataset_dir(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "a red cube", "tag": "color"}) + "\n"
                                          + json.dumps({"prompt": "two dogs"}) + "\n")
    return tmp_path


@pytest.mark.parametrize("make", [_jsonl_with_every_line_ending, _txt_with_repeats, _dataset_dir])
def test_rows_are_those_load_prompts_reads(tmp_path, make):
    source = make(tmp_path)
    rows, expected = open_prompts(source), load_prompts(source)
    assert len(rows) == len(expected) and list(rows) == expected
    assert [rows[i] for i in range(len(rows))] == expected and rows[-1] == expected[-1]
    assert rows[1:3] == expected[1:3] and rows[:None] == expected
    assert list(rows.prompts) == [r.prompt for r in expected]
    assert rows.tasks.tolist() == [r.task for r in expected]
    with pytest.raises(IndexError):
        rows[len(rows)]


@pytest.mark.parametrize("bad_row, line, field", [
    ({"metadata": {"task": "t2i", "sample_id": "x"}}, 3, "'prompt'"),
    ({"prompt": "a", "metadata": {"task": "t2x", "sample_id": "x"}}, 3, "'metadata.task'"),
    ({"prompt": "a", "metadata": {"task": "t2i", "sample_id": "id1"}}, 3,
     "'metadata.sample_id'.*'id1' repeats the one on line 2"),
    ("{not json", 3, "not valid JSON"),
])
def test_errors_are_those_of_load_prompts(tmp_path, bad_row, line, field):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([_row(0), _row(1), bad_row if isinstance(bad_row, str) else json.dumps(bad_row),
                               _row(2)]) + "\n")
    for read in (load_prompts, open_prompts):
        with pytest.raises(ValueError, match=rf"p\.jsonl:{line}: .*{field}"):
            read(path)


def test_a_repeated_id_names_its_earliest_repeat_and_the_first_line(tmp_path):
    path = tmp_path / "p.jsonl"
    ids = ["a", "b", "c", "b", "a", "c"]  # 'b' repeats first (line 5 after the blank line 3)
    lines = [json.dumps({"prompt": "p", "metadata": {"task": "t2i", "sample_id": i}}) for i in ids]
    path.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:5: .*'b' repeats the one on line 2"):
        open_prompts(path)
    with pytest.raises(ValueError, match=r"p\.jsonl:5: .*'b' repeats the one on line 2"):
        load_prompts(path)


def test_rows_cost_bytes_not_records(tmp_path):
    n = 50_000
    path = tmp_path / "big.jsonl"
    path.write_text("".join(_row(i, digit=i % 10) + "\n" for i in range(n)))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        rows = open_prompts(path)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert rows.offsets.nbytes + rows.lengths.nbytes + rows.task_codes.nbytes == 13 * n
    assert kept < 40 * n, f"{kept / n:.0f} bytes kept per row"  # a list of parsed records keeps ~1 KB per row
    assert rows[n - 1].metadata == {"task": "t2i", "sample_id": f"id{n - 1}", "digit": 9}


def test_a_file_replaced_keeps_its_rows_and_one_changed_in_place_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(_row(0) + "\n" + _row(1) + "\n")
    rows = open_prompts(path)
    replacement = tmp_path / "new.jsonl"
    replacement.write_text(_row(7) + "\n")
    os.replace(replacement, path)  # how flowforge's own writers replace a file: the open rows stay valid
    assert rows[1].prompt == "prompt 1"
    rows = open_prompts(path)
    with path.open("a") as handle:
        handle.write(_row(8) + "\n")
    with pytest.raises(RuntimeError, match="changed since it was opened"):
        rows[0]


def test_check_task_reads_the_task_codes(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(_row(0) + "\n" + _row(1, task="t2v") + "\n" + _row(2) + "\n")
    rows = open_prompts(path)
    check_task(rows, "t2v", "data.prompts")
    with pytest.raises(ValueError, match="record 'id0' has metadata.task='t2i' but model.task='i2v'"):
        check_task(rows, "i2v", "data.prompts")
