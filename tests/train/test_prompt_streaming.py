"""A prompt file longer than STREAM_ABOVE trains streamed: only drawn prompts are encoded, resume is bit-exact, and
peak memory does not grow with the number of rows (slow: a million-row file)."""

import json
import pathlib
import subprocess
import sys

import pytest

from flowforge.data import prompt_set
from flowforge.data.preprocess import STREAM_ABOVE, StreamedConditioning
from flowforge.data.prompts import scan_rows
from flowforge.train.trainer import Trainer
from tests.train.test_resume import _assert_same, _rows, _state
from tests.train.test_trainer import tiny_cfg

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def write_prompts(path, n):
    """``n`` digit prompts (unique ids, ``metadata.digit`` for the digit reward), one JSON row a line."""
    with path.open("w") as handle:
        for i in range(n):
            handle.write(json.dumps({"prompt": f"a {WORDS[i % 10]} no. {i}",
                                     "metadata": {"task": "t2i", "sample_id": f"r{i}", "digit": i % 10}}) + "\n")
    return path


def test_a_long_prompt_file_is_encoded_per_step_and_resumes_bit_exactly(tiny_model_dir, tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "long.jsonl", STREAM_ABOVE + 88)
    scanned = []
    monkeypatch.setattr(prompt_set, "scan_rows", lambda path: scanned.append(path.name) or scan_rows(path))
    extra = [f"data.prompts={prompts}", "train.steps=3", "checkpoint.every=1", "eval.every=0"]

    def trainer(name, cache, *more):
        return Trainer(tiny_cfg(tiny_model_dir, tmp_path, tmp_path / cache, f"run.name={name}", *extra, *more),
                       progress=False)

    full = trainer("full", "cache")
    assert sorted(scanned) == ["eval.jsonl", "long.jsonl"]  # preflight's pass over each file is the trainer's
    assert isinstance(full.train_cond, StreamedConditioning) and full.train_cond.encoded == 0
    full.train()
    assert full.train_cond.encoded == 3 * 2  # 3 steps x 2 distinct prompts: nothing else of the file encoded
    part = trainer("part", "cache")
    part.train(stop_at=2)
    del part
    resumed = trainer("part", "fresh_cache", "train.resume=auto")  # an empty cache: step 3's prompts encoded anew
    assert resumed.step == 2
    resumed.train()
    _assert_same(_state(full), _state(resumed))
    assert _rows(full.run_dir) == _rows(resumed.run_dir)


def _train_peak_rss_kib(model_dir, out_dir, prompts, name):
    """Peak RSS (KiB) of a fresh process running ``flowforge train`` for 2 steps on ``prompts``."""
    argv = ["train", str(ROOT / "examples/digits/grpo.yaml"), f"model.path={model_dir}", f"run.output_dir={out_dir}",
            f"run.name={name}", f"data.cache_dir={out_dir / 'cache'}", f"data.prompts={prompts}",
            "data.prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "sampler.num_sde_steps=2",
            "train.micro_batch_size=2", "train.num_updates_per_batch=2", "train.steps=2", "eval.max_prompts=3",
            "eval.every=0", "run.num_threads=2", "--no-progress"]
    code = ("import resource, sys; from flowforge.cli import main; rc = main(sys.argv[1:]); "
            "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split("PEAK_RSS_KIB")[-1].split()[0])


@pytest.mark.slow
def test_peak_memory_is_flat_in_the_number_of_prompt_rows(tiny_model_dir, tmp_path):
    small = _train_peak_rss_kib(tiny_model_dir, tmp_path, write_prompts(tmp_path / "1k.jsonl", 1_000), "small")
    big_file = write_prompts(tmp_path / "1m.jsonl", 1_000_000)
    try:
        big = _train_peak_rss_kib(tiny_model_dir, tmp_path, big_file, "big")
    finally:
        big_file.unlink()
    assert big <= 1.5 * small, f"peak RSS {big / 1024:.0f} MiB with 1M rows vs {small / 1024:.0f} MiB with 1k"
