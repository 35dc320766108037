"""Fixtures for the data-tool tests: run the command line in process, write JSONL rows and small images."""

import json
from pathlib import Path

import pytest


@pytest.fixture
def cli(capsys):
    """``cli(*args) -> (exit status, stdout, stderr)`` of ``flowforge.cli.main(["data", *args])``."""
    from flowforge.cli import main

    def run(*args):
        capsys.readouterr()
        rc = main(["data", *map(str, args)])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture
def write_rows():
    """``write_rows(path, rows)``: one JSON object (or a raw string) per line; returns ``path``."""

    def write(path: Path, rows) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return path

    return write


@pytest.fixture
def png():
    """``png(path, value=0)``: a valid 8x8 RGB PNG; returns ``path``."""
    from PIL import Image

    def make(path: Path, value: int = 0) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (value, value, value)).save(path)
        return path

    return make


def row(prompt, sample_id, task="t2i", **metadata):
    return {"prompt": prompt, "metadata": {"task": task, "sample_id": sample_id, **metadata}}


@pytest.fixture
def make_row():
    """``make_row(prompt, sample_id, task="t2i", **metadata)``: a row of the unified schema."""
    return row
