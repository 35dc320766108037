"""``flowforge data prepare``: every source, stable sample ids, atomic / no-overwrite / no-symlink output."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowforge.data.prompts import load_prompts
from flowforge.data.tools.prepare import prepare, stable_id

PROMPTS = ["a red fox in deep snow at dawn", "a lighthouse on a cliff in a storm", "a bowl of ramen, studio light"]


def read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_lines_rerun_is_byte_identical_and_ids_follow_content_not_order(tmp_path, cli):
    src = tmp_path / "prompts.txt"
    src.write_text("\n".join(PROMPTS) + "\n\n", encoding="utf-8")
    out = tmp_path / "raw.jsonl"
    assert cli("prepare", "--source", "lines", "--input", src, "--output", out)[0] == 0
    first = out.read_bytes()
    assert cli("prepare", "--source", "lines", "--input", src, "--output", out, "--overwrite")[0] == 0
    assert out.read_bytes() == first
    rows = read(out)
    assert [r["prompt"] for r in rows] == PROMPTS
    assert [r["metadata"]["sample_id"] for r in rows] == [stable_id("lines", "t2i", p, []) for p in PROMPTS]
    src.write_text("\n".join(reversed(PROMPTS)) + "\n", encoding="utf-8")
    assert cli("prepare", "--source", "lines", "--input", src, "--output", out, "--overwrite")[0] == 0
    assert read(out) == list(reversed(rows))
    assert len(load_prompts(out)) == 3  # the training loader accepts the output


def test_pickapic_parquet_caption_column_nulls_and_repeats(tmp_path, cli):
    # the shape of a pickapic_v2 shard: caption + image bytes + other columns; repeats of one caption are common
    captions = [PROMPTS[0], None, PROMPTS[1], "   ", PROMPTS[0], PROMPTS[0]]
    table = pa.table({"ranking_id": list(range(6)), "caption": captions, "jpg_0": [b"\xff\xd8"] * 6,
                      "label_0": [0.5] * 6})
    pq.write_table(table, tmp_path / "train-0000.parquet")
    out = tmp_path / "raw.jsonl"
    rc, stdout, _ = cli("prepare", "--source", "pickapic", "--input", tmp_path / "train-0000.parquet",
                        "--output", out)
    assert rc == 0 and "wrote 4 prompts" in stdout and "skipped 2 empty" in stdout
    ids = [r["metadata"]["sample_id"] for r in read(out)]
    base = stable_id("pickapic", "t2i", PROMPTS[0], [])
    assert ids == [base, stable_id("pickapic", "t2i", PROMPTS[1], []), f"{base}-1", f"{base}-2"]
    assert len(load_prompts(out)) == 4


def test_pickapic_rankings_prompt_column_and_shard_directory(tmp_path, cli):
    shards = tmp_path / "data"
    shards.mkdir()
    pq.write_table(pa.table({"prompt": PROMPTS[:2], "best_image_uid": ["a", "b"]}), shards / "train-00000.parquet")
    pq.write_table(pa.table({"prompt": PROMPTS[2:], "best_image_uid": ["c"]}), shards / "train-00001.parquet")
    out = tmp_path / "raw.jsonl"
    assert cli("prepare", "--source", "pickapic", "--input", shards, "--output", out)[0] == 0
    assert [r["prompt"] for r in read(out)] == PROMPTS


def test_generic_parquet_needs_an_existing_string_column(tmp_path, cli):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": PROMPTS, "n": [1, 2, 3]}), path)
    out = tmp_path / "raw.jsonl"
    rc, _, err = cli("prepare", "--source", "parquet", "--input", path, "--output", out)
    assert rc == 2 and "--column" in err and "required" in err
    rc, _, err = cli("prepare", "--source", "parquet", "--input", path, "--column", "caption", "--output", out)
    assert rc == 2 and "no column 'caption'" in err and "'text'" in err
    rc, _, err = cli("prepare", "--source", "parquet", "--input", path, "--column", "n", "--output", out)
    assert rc == 2 and "not strings" in err
    assert not out.exists()
    assert cli("prepare", "--source", "parquet", "--input", path, "--column", "text", "--output", out)[0] == 0
    assert [r["metadata"]["sample_id"] for r in read(out)] == [stable_id("parquet", "t2i", p, []) for p in PROMPTS]


def test_jsonl_field_metadata_and_media_paths_rebased(tmp_path, cli, write_rows, png):
    png(tmp_path / "src" / "img" / "cat.png")
    src = write_rows(tmp_path / "src" / "in.jsonl", [
        {"caption": "the cat walks away", "metadata": {"image": "img/cat.png"}, "style": "photo"},
        {"caption": "the cat sits", "metadata": {"image": "img/cat.png", "sample_id": "mine-1"}},
    ])
    out = tmp_path / "out" / "raw.jsonl"
    assert cli("prepare", "--source", "jsonl", "--input", src, "--prompt-field", "caption", "--task", "i2v",
               "--output", out)[0] == 0
    rows = read(out)
    assert rows[0]["metadata"] == {"task": "i2v", "sample_id": stable_id("jsonl", "i2v", "the cat walks away",
                                                                          ["img/cat.png"]),
                                   "image": "../src/img/cat.png", "style": "photo"}
    assert rows[1]["metadata"]["sample_id"] == "mine-1"  # an id the input already has is kept
    records = load_prompts(out)  # the image resolves from the output's directory
    assert records[0].metadata["image"] == str((tmp_path / "src" / "img" / "cat.png").resolve())


@pytest.mark.parametrize("rows, must_mention", [
    ([{"text": "x y z"}], "no field 'prompt'"),
    ([{"prompt": "a b c", "metadata": {"task": "t2v"}}], "metadata.task='t2v'"),
    ([{"prompt": "a b c", "metadata": {"sample_id": "s"}}, {"prompt": "d e f", "metadata": {"sample_id": "s"}}],
     "repeats"),
    (['{"prompt": "a b c"', ], "not valid JSON"),
    ([{"prompt": "a <image> cat"}], "<image> placeholder"),
], ids=["missing-field", "task-mismatch", "repeated-id", "bad-json", "placeholder"])
def test_jsonl_errors_name_file_and_line(tmp_path, cli, write_rows, rows, must_mention):
    src = write_rows(tmp_path / "in.jsonl", [{"prompt": "a fine first row"}] + rows)
    rc, _, err = cli("prepare", "--source", "jsonl", "--input", src, "--output", tmp_path / "raw.jsonl")
    assert rc == 2 and must_mention in err and f"{src}:" in err
    assert not (tmp_path / "raw.jsonl").exists()


def test_refuses_existing_output_and_symlinks(tmp_path, cli):
    src = tmp_path / "p.txt"
    src.write_text(PROMPTS[0] + "\n", encoding="utf-8")
    out = tmp_path / "raw.jsonl"
    out.write_text("keep me\n")
    rc, _, err = cli("prepare", "--source", "lines", "--input", src, "--output", out)
    assert rc == 2 and "already exists" in err and "--overwrite" in err
    assert out.read_text() == "keep me\n"
    target = tmp_path / "target.jsonl"
    target.write_text("precious\n")
    link = tmp_path / "link.jsonl"
    os.symlink(target, link)
    rc, _, err = cli("prepare", "--source", "lines", "--input", src, "--output", link, "--overwrite")
    assert rc == 2 and "symbolic link" in err
    assert target.read_text() == "precious\n" and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "p.txt", "raw.jsonl", "target.jsonl"]


def test_argument_errors_exit_2(tmp_path, cli):
    src = tmp_path / "p.txt"
    src.write_text(PROMPTS[0] + "\n", encoding="utf-8")
    out = tmp_path / "raw.jsonl"
    for args, text in ((["--source", "csv"], "--source"), (["--source", "lines", "--task", "x2y"], "--task"),
                       (["--source", "lines", "--column", "c"], "--column"),
                       (["--source", "lines", "--task", "i2i"], "metadata.image")):
        rc, _, err = cli("prepare", *args, "--input", src, "--output", out)
        assert rc == 2 and text in err
    assert cli("prepare", "--source", "lines", "--input", tmp_path / "nope.txt", "--output", out)[0] == 2
    with pytest.raises(ValueError, match="holds no prompts"):
        (tmp_path / "empty.txt").write_text("\n \n")
        prepare("lines", tmp_path / "empty.txt", out)
