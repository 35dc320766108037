"""Multi-image edit rows (``metadata.images``: a list of reference images) through the row reader that training,
``inspect`` and ``curate`` share, and through ``prepare`` / ``curate`` / ``inspect``."""
import json

import pytest

from flowforge.data.prompts import check_condition_images, condition_images, load_prompts


def test_rows_list_images_relative_to_the_file_and_image_is_a_one_element_list(tmp_path, write_rows, make_row, png):
    for name in ("a", "b", "c"):
        png(tmp_path / "data" / "refs" / f"{name}.png")
    path = write_rows(tmp_path / "data" / "p.jsonl", [
        make_row("cat on sofa", "two", task="i2i", images=["refs/a.png", "refs/b.png"]),
        make_row("three things", "three", task="i2i", images=["refs/a.png", "refs/b.png", "refs/c.png"]),
        make_row("one thing", "one", task="i2i", image="refs/c.png"),
        {"prompt": "a peer row", "images": ["refs/b.png", "refs/a.png"]},  # peer schema: i2i from its images
    ])
    records = load_prompts(path)
    refs = tmp_path / "data" / "refs"
    assert condition_images(records[0].metadata) == [str((refs / "a.png").resolve()), str((refs / "b.png").resolve())]
    assert len(condition_images(records[1].metadata)) == 3
    assert records[2].metadata["image"] == str((refs / "c.png").resolve())
    assert condition_images(records[2].metadata) == [records[2].metadata["image"]]
    assert records[3].task == "i2i" and condition_images(records[3].metadata)[0].endswith("b.png")
    check_condition_images(records, None, "data.prompts")
    check_condition_images(records, 3, "data.prompts")
    with pytest.raises(ValueError, match="record 'three' lists 3 condition images .* at most 2"):
        check_condition_images(records, 2, "data.prompts")


@pytest.mark.parametrize("metadata, must_mention", [
    ({"images": []}, "metadata.images' must be a non-empty list"),
    ({"images": "refs/a.png"}, "metadata.images' must be a non-empty list"),
    ({"images": ["refs/a.png", "refs/none.png"]}, "names 'refs/none.png', which is not a file"),
    ({"images": ["refs/a.png"], "image": "refs/a.png"}, "are both given"),
])
def test_bad_images_name_the_line_and_field(tmp_path, write_rows, make_row, png, metadata, must_mention):
    png(tmp_path / "refs" / "a.png")
    path = write_rows(tmp_path / "p.jsonl", [make_row("ok", "x", task="i2i", image="refs/a.png"),
                                             make_row("bad", "y", task="i2i", **metadata)])
    with pytest.raises(ValueError, match=f"p.jsonl:2: field .*{must_mention}"):
        load_prompts(path)


def test_prepare_curate_inspect_carry_the_images(tmp_path, cli, write_rows, make_row, png):
    for name in ("a", "b", "c"):
        png(tmp_path / "src" / "refs" / f"{name}.png", value=ord(name))
    words = "a photo of the cat from picture one on the sofa number {}"
    src = write_rows(tmp_path / "src" / "in.jsonl", [
        {"prompt": words.format(i), "metadata": {"images": ["refs/a.png", "refs/b.png", "refs/c.png"][: 2 + i % 2]}}
        for i in range(6)] + [{"prompt": words.format(9), "metadata": {"images": ["refs/a.png", "refs/none.png"]}}])
    raw = tmp_path / "raw" / "raw.jsonl"
    assert cli("prepare", "--source", "jsonl", "--input", src, "--task", "i2i", "--output", raw)[0] == 0
    assert json.loads(raw.read_text().splitlines()[0])["metadata"]["images"] == ["../src/refs/a.png",
                                                                                 "../src/refs/b.png"]
    out = tmp_path / "curated"
    assert cli("curate", "--input", raw, "--out-dir", out, "--eval-size", "2", "--eval-subset-sizes")[0] == 0
    assert json.loads((out / "summary.json").read_text())["dropped"]["missing_media"] == 1  # refs/none.png
    records = load_prompts(out / "train.jsonl") + load_prompts(out / "eval.jsonl")
    assert sorted(len(condition_images(r.metadata)) for r in records) == [2, 2, 2, 3, 3, 3]
    assert all(p.startswith(str((tmp_path / "src" / "refs").resolve())) for r in records
               for p in condition_images(r.metadata))
    rc, text, _ = cli("inspect", "--train", out / "train.jsonl", "--eval", out / "eval.jsonl", "--decode-media")
    assert rc == 0 and "condition images per row: 2: " in text and "3: " in text
    assert "; 3 media files decoded" in text  # a.png, b.png, c.png
    bad = write_rows(tmp_path / "bad.jsonl", [make_row("p q r", "s", task="i2i", images=["src/refs/a.png"],
                                                       image="src/refs/a.png")])
    rc, text, _ = cli("inspect", "--train", bad)
    assert rc == 1 and "are both given" in text
