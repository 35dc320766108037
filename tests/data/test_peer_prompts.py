"""Peer prompt sources load as they are: .txt, {"prompt", "image"} JSONL, a Flow-Factory-style dataset directory."""

import json

import pytest
from PIL import Image

from flowforge.data.prompts import load_prompts


def test_a_txt_file_loads_one_prompt_a_line_with_stable_unique_ids(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("a red cube\n\n  a blue ball  \na red cube\n", encoding="utf-8")
    records = load_prompts(path)
    assert [r.prompt for r in records] == ["a red cube", "a blue ball", "a red cube"]
    assert {r.task for r in records} == {"t2i"}
    ids = [r.sample_id for r in records]
    assert len(set(ids)) == 3 and ids[0].startswith("train-0-") and ids[2].startswith("train-2-")
    assert [r.sample_id for r in load_prompts(path)] == ids  # deterministic across loads


def test_prompt_image_jsonl_infers_the_task_and_keeps_other_keys(tmp_path):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "cat.png")
    rows = [{"prompt": "make it blue", "image": "cat.png"}, {"prompt": "a dog", "tag": "single_object"}]
    path = tmp_path / "edit.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    first, second = load_prompts(path)
    assert first.task == "i2i" and first.metadata["image"] == str((tmp_path / "cat.png").resolve())
    assert second.task == "t2i" and second.metadata["tag"] == "single_object"
    assert first.sample_id != second.sample_id


def test_a_dataset_directory_reads_its_train_split_and_its_test_file_by_name(tmp_path):
    (tmp_path / "train.txt").write_text("one\ntwo\n", encoding="utf-8")
    (tmp_path / "test.txt").write_text("three\n", encoding="utf-8")
    assert [r.prompt for r in load_prompts(tmp_path)] == ["one", "two"]
    assert [r.prompt for r in load_prompts(tmp_path / "test.txt")] == ["three"]
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "from jsonl"}) + "\n", encoding="utf-8")
    assert [r.prompt for r in load_prompts(tmp_path)] == ["from jsonl"]  # train.jsonl is preferred


def test_what_still_cannot_be_read_names_flowforge_data_prepare(tmp_path):
    with pytest.raises(ValueError, match=r"is a directory with no train split.*train.jsonl.*flowforge data prepare"):
        load_prompts(tmp_path)
    bad = tmp_path / "p.jsonl"
    bad.write_text("not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: not valid JSON.*flowforge data prepare"):
        load_prompts(bad)
    missing_image = tmp_path / "q.jsonl"
    missing_image.write_text(json.dumps({"prompt": "x", "image": "nope.png"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"'metadata.image' names 'nope.png', which is not a file"):
        load_prompts(missing_image)
