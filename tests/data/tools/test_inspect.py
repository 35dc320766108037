"""``flowforge data inspect``: every problem listed with file and line; exit 0 clean, 1 with problems, 2 bad input."""

import pytest

from flowforge.data.tools.inspect import inspect_files

GOOD = "a watercolor of a harbor at sunset with small boats"


def test_clean_pair_exits_0(tmp_path, cli, write_rows, make_row, png):
    png(tmp_path / "cond.png")
    train = write_rows(tmp_path / "train.jsonl", [make_row(GOOD, "t1"), make_row("an i2i edit", "t2", task="i2i",
                                                                                image="cond.png")])
    evaluation = write_rows(tmp_path / "eval.jsonl", [make_row("another prompt entirely", "e1")])
    rc, out, _ = cli("inspect", "--train", train, "--eval", evaluation, "--decode-media")
    assert rc == 0 and out.startswith("clean:") and "1 media file decoded" in out


def test_every_schema_and_placeholder_problem_is_listed_with_its_line(tmp_path, cli, write_rows, make_row, png):
    png(tmp_path / "a.png")
    png(tmp_path / "b.png")
    rows = [
        make_row(GOOD, "ok"),                                                        # 1 clean
        "{not json",                                                                 # 2
        {"prompt": GOOD, "metadata": {"task": "t2i"}},                               # 3 no sample_id
        make_row(GOOD, "bad-task", task="txt2img"),                                  # 4
        make_row("", "empty"),                                                       # 5
        {"prompt": GOOD, "meta": {}, "metadata": {"task": "t2i", "sample_id": "x"}},  # 6 unknown key
        make_row("the <image> cat", "ph-none"),                                      # 7 placeholder, no image
        make_row("<image> and <image>", "ph-two", image="a.png"),                    # 8 two marks, one image
        make_row("<image> left, <image> right", "ph-ok", image=["a.png", "b.png"]),  # 9 clean
        make_row("a <video> of waves", "ph-video", image="a.png"),                   # 10 video mark, no video
        make_row("an edit", "i2i-no-image", task="i2i"),                             # 11
        make_row("an edit", "i2i-two", task="i2i", image=["a.png", "b.png"]),        # 12
        make_row(GOOD, "ok"),                                                        # 13 repeated id
        make_row(GOOD, "gone", image="missing.png"),                                 # 14 missing media
        make_row(GOOD, "bad-media", image=7),                                        # 15
    ]
    train = write_rows(tmp_path / "train.jsonl", rows)
    rc, out, _ = cli("inspect", "--train", train)
    assert rc == 1
    lines = out.splitlines()
    expected = {2: "not valid JSON", 3: "metadata.sample_id", 4: "metadata.task", 5: "'prompt'", 6: "'meta'",
                7: "1 <image> placeholder but metadata lists no image", 8: "2 <image> placeholders",
                10: "<video>", 11: "metadata.image' is required", 12: "must be one path",
                13: "repeats the one on line 1",
                14: "missing.png' is missing", 15: "metadata.image"}
    for number, text in expected.items():
        assert any(line.startswith(f"{train}:{number}: ") and text in line for line in lines), (number, out)
    assert not any(line.startswith((f"{train}:1: ", f"{train}:9: ")) for line in lines)
    assert lines[-1].startswith(f"{len(lines) - 1} problems in {train}")


def test_leakage_by_content_and_by_sample_id(tmp_path, cli, write_rows, make_row):
    train = write_rows(tmp_path / "train.jsonl", [make_row(GOOD, "t1"), make_row("a second train prompt", "t2")])
    evaluation = write_rows(tmp_path / "eval.jsonl", [
        make_row("a clean eval prompt", "e1"),
        make_row("  A Watercolor of a harbor at SUNSET with small boats", "e2"),  # same content as train line 1
        make_row("another eval prompt", "t2"),  # same sample_id as train line 2
    ])
    rc, out, _ = cli("inspect", "--train", train, "--eval", evaluation)
    assert rc == 1
    assert f"{evaluation}:2: train/eval leakage: same content as {train}:1" in out
    assert f"{evaluation}:3: train/eval leakage: sample_id 't2' is also on {train}:2" in out
    assert f"{evaluation}:1:" not in out


def test_decode_failures_name_file_and_line(tmp_path, cli, write_rows, make_row, png):
    from PIL import Image

    png(tmp_path / "good.png")
    # a patterned image (a flat one compresses to a few bytes PIL still decodes when cut), cut mid-stream
    Image.frombytes("RGB", (64, 64), bytes((i * 7919) % 251 for i in range(64 * 64 * 3))).save(tmp_path / "n.png")
    (tmp_path / "broken.png").write_bytes((tmp_path / "n.png").read_bytes()[:300])
    (tmp_path / "text.png").write_text("not an image")
    png(tmp_path / "frames" / "000.png")
    (tmp_path / "frames" / "001.png").write_bytes(b"\x89PNG garbage")
    (tmp_path / "no_frames").mkdir()
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    Image.new("RGB", (4, 4)).save(tmp_path / "anim.gif", save_all=True,
                                  append_images=[Image.new("RGB", (4, 4), (9, 9, 9))])
    rows = [make_row(GOOD, "good", image="good.png"),
            make_row(GOOD + " two", "cut", image="broken.png"),
            make_row(GOOD + " three", "text", image="text.png"),
            make_row(GOOD + " four", "frames", video="frames"),
            make_row(GOOD + " five", "empty-frames", video="no_frames"),
            make_row(GOOD + " six", "mp4", video="clip.mp4"),
            make_row(GOOD + " seven", "gif", video="anim.gif"),
            make_row(GOOD + " eight", "cut-again", image="broken.png")]
    evaluation = write_rows(tmp_path / "eval.jsonl", rows)
    rc, out, _ = cli("inspect", "--eval", evaluation)
    assert rc == 0  # without --decode-media only presence is checked
    rc, out, _ = cli("inspect", "--eval", evaluation, "--decode-media")
    assert rc == 1
    problems = {int(line.split(":")[1]): line for line in out.splitlines()[:-1]}
    assert sorted(problems) == [2, 3, 4, 5, 6, 8]
    assert "broken.png' does not decode as an image" in problems[2] and problems[2].startswith(f"{evaluation}:2: ")
    assert "text.png' does not decode" in problems[3]
    assert "frame 001.png" in problems[4]
    assert "no frame images" in problems[5]
    assert "cannot decode (.mp4" in problems[6] and "not checked" in problems[6]
    assert "broken.png' does not decode" in problems[8]


def test_bad_invocations_exit_2(tmp_path, cli, write_rows, make_row):
    train = write_rows(tmp_path / "train.jsonl", [make_row(GOOD, "t1")])
    assert cli("inspect")[0] == 2
    rc, _, err = cli("inspect", "--train", tmp_path / "nope.jsonl")
    assert rc == 2 and "nope.jsonl" in err
    rc, _, err = cli("inspect", "--train", train, "--eval", train)
    assert rc == 2 and "same file" in err
    with pytest.raises(ValueError, match="neither"):
        inspect_files()


def test_every_prompt_source_train_reads_is_inspected_as_train_reads_it(tmp_path, cli, png):
    """A .txt file (one prompt a line, a repeated line included), JSONL rows without metadata (an image row is i2i)
    and a dataset directory: clean, with as many records as load_prompts reads; curate takes the .txt as well."""
    from flowforge.data.prompts import load_prompts

    png(tmp_path / "cond.png")
    txt = tmp_path / "prompts.txt"
    txt.write_text("a handwritten seven\n\nthe number 3, written neatly\na handwritten seven\n")
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "a red cube", "tag": "color"}\n{"prompt": "make it blue", "image": "cond.png"}\n')
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "train.txt").write_text("a cat\na dog\n")
    rc, out, _ = cli("inspect", "--train", txt, "--eval", plain, "--decode-media")
    assert rc == 0, out
    assert out == (f"clean: {txt} (3 records), {plain} (2 records); 1 media file decoded\n"
                   f"{plain}: condition images per row: 1: 1 row\n")
    assert [len(load_prompts(p)) for p in (txt, plain)] == [3, 2]
    rc, out, _ = cli("inspect", "--train", dataset)
    assert (rc, out) == (0, f"clean: {dataset / 'train.txt'} (2 records)\n")
    rc, out, _ = cli("curate", "--input", txt, "--out-dir", tmp_path / "out", "--min-prompt-words", "0",
                     "--eval-size", "1", "--eval-subset-sizes")
    assert rc == 0 and out.startswith("read 3, kept 2"), out  # the repeated line is one content


def test_a_txt_line_is_not_json_and_a_missing_source_names_it(tmp_path, cli):
    txt = tmp_path / "p.txt"
    txt.write_text('{"prompt": "not parsed as JSON in a .txt file"}\n')
    assert cli("inspect", "--train", txt)[0] == 0
    rc, _, err = cli("inspect", "--train", tmp_path / "nope.txt")
    assert rc == 2 and err.startswith(f"error: {tmp_path / 'nope.txt'}: is not a file")
