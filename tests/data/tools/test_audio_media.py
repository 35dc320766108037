"""``metadata.audio`` in the data tools: a media key like ``image`` / ``video`` (schema check, ``<audio>``
placeholder, presence, dedup hash) whose WAV files decode in ``inspect --decode-media`` and whose other formats are
reported as not checked, never as passing."""
from __future__ import annotations

import wave

from flowforge.data.tools.records import media_paths, row_problems

GOOD = "a drum roll in an empty concert hall at night"


def _wav(path, frames: int = 160):
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(b"\x01\x00" * frames)
    return path


def test_audio_is_a_media_key_with_a_placeholder(make_row):
    row = make_row("<audio> a drum roll", "a1", task="t2v", audio="roll.wav")
    assert row_problems(row) == [] and media_paths(row["metadata"]) == [("audio", "roll.wav")]
    two = make_row("<audio> and <audio>", "a2", task="t2v", audio="roll.wav")
    assert any("2 <audio> placeholders" in p for p in row_problems(two))
    assert any("metadata.audio" in p for p in row_problems(make_row(GOOD, "a3", task="t2v", audio=3)))


def test_inspect_decodes_wav_and_names_what_it_cannot(tmp_path, cli, write_rows, make_row):
    _wav(tmp_path / "good.wav")
    (tmp_path / "cut.wav").write_bytes(_wav(tmp_path / "whole.wav").read_bytes()[:30])
    _wav(tmp_path / "empty.wav", frames=0)
    (tmp_path / "song.mp3").write_bytes(b"ID3\x03\x00")
    rows = [make_row(GOOD, "good", task="t2v", audio="good.wav"),
            make_row(GOOD + " two", "cut", task="t2v", audio="cut.wav"),
            make_row(GOOD + " three", "empty", task="t2v", audio="empty.wav"),
            make_row(GOOD + " four", "mp3", task="t2v", audio="song.mp3"),
            make_row(GOOD + " five", "missing", task="t2v", audio="nowhere.wav")]
    evaluation = write_rows(tmp_path / "eval.jsonl", rows)
    rc, out, _ = cli("inspect", "--eval", evaluation)
    assert rc == 1 and "nowhere.wav" in out and "cut.wav" not in out  # presence only
    rc, out, _ = cli("inspect", "--eval", evaluation, "--decode-media")
    problems = {int(line.split(":")[1]): line for line in out.splitlines()[:-1]}
    assert rc == 1 and sorted(problems) == [2, 3, 4, 5]
    assert "does not decode as WAV audio" in problems[2]
    assert "no audio frames" in problems[3]
    assert "cannot decode (.mp3" in problems[4] and "not checked" in problems[4]
