"""The error catalogue, continued (issue 42, "hardening, round three": tracebacks / internal errors and cosmetic
messages). Same rule as :mod:`tests.cli.test_errors`: one line ``error: ...`` naming the field or file (exit 2), no
traceback, no ``internal error``, and every file that existed before is byte-identical afterwards.

Each case names what it printed on the code before: ``check`` said OK and ``train`` ended in ``internal error:
TypeError`` (an adapter that is not one, a judge option of the wrong type), a corrupt judge ledger gave ``internal
error: DatabaseError: file is not a database`` without the file, ``model.height=64`` leaked diffusers' message after
the run directory was written, a lone surrogate in a prompt was accepted by ``check``.
"""

import errno
import io
import json
import os
from pathlib import Path

import pytest

from tests.cli.harness import EXAMPLE, assert_one_line_error, run_cli
from tests.runtime.lock_holder import lock_holder
from tests.tools.test_export import tree_digest

JUDGE = ("reward.options={{vlm_judge: {{model: m, base_url: 'http://127.0.0.1:1/v1', api_key_env: null, "
         "max_attempts: 1, frames: 1, max_side: 16{more}}}}}")


def judged(more=""):
    """Overrides scoring with ``vlm_judge`` only (nothing listens at its URL), plus judge options ``more``; braces
    doubled (the case's ``{placeholders}`` are filled in later)."""
    return ["reward.weights=!{{vlm_judge: 1.0}}", "reward.required=[]", JUDGE.replace("{more}", more)]


@pytest.fixture(scope="module")
def places(tiny_model_dir, encode_cache_dir, tmp_path_factory):
    """``tmp``: the scratch directory holding the bad inputs (compared before / after every case); ``out``: where a
    refused ``train`` would write (a case's own ``tmp_path`` in :func:`test_bad_input_is_one_line`); ``base``: the tiny
    model; ``cache``: the session's encoding cache."""
    tmp = tmp_path_factory.mktemp("hardening")
    rows = [{"prompt": f"a handwritten {i}", "metadata": {"task": "t2i", "sample_id": f"s{i}"}} for i in range(8)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp / "surrogate.jsonl").write_text(text.replace("a handwritten 1", "a handwritten \\ud800 one"))
    (tmp / "ledger.sqlite").write_bytes(b"not a database, but a user's file\n" * 100)
    live = tmp / "live_run"  # a run directory another process holds (test_a_live_run_...)
    live.mkdir()
    (live / "config.yaml").write_text("train: {steps: 1}\n")
    out = tmp_path_factory.mktemp("hardening_out")
    return {"tmp": str(tmp), "out": str(out), "base": str(tiny_model_dir), "cache": str(encode_cache_dir)}


def train(*overrides):
    """A one-step ``train`` of the tiny model into ``{out}/r``; ``overrides`` replace the keys they name."""
    base = ["model.path={base}", "data.cache_dir={cache}", "run.output_dir={out}", "run.name=r", "train.steps=1",
            "data.prompts_per_step=2", "data.group_size=2", "train.micro_batch_size=2", "sampler.num_steps=3",
            "sampler.num_sde_steps=1", "eval.max_prompts=1", "eval.samples_per_prompt=1", "eval.every=0",
            "eval.scorers=[digit_eval]"]
    named = {o.partition("=")[0] for o in overrides}
    return ["train", EXAMPLE, *[b for b in base if b.partition("=")[0] not in named], *overrides, "--no-progress"]


CASES = [
    pytest.param(["check", EXAMPLE, "model.adapter=json:JSONDecoder"],
                 ["model.adapter", "'json:JSONDecoder' is not a FlowModel adapter class", "['blocks', 'encode'",
                  "registered adapter ['flux'", "flowforge/models/base.py"], id="adapter-not-an-adapter-check"),
    pytest.param(train("model.adapter=json:JSONDecoder"), ["model.adapter", "not a FlowModel adapter class"],
                 id="adapter-not-an-adapter-train"),
    pytest.param(["check", EXAMPLE, *judged(", retry_backoff_s: 1.0e9")],
                 ["reward.options.vlm_judge.retry_backoff_s: expected float, got a string '1.0e9'", "YAML 1.1",
                  "write 1.0e+9 or 1000000000.0"], id="scorer-option-yaml11-float"),
    pytest.param(["check", EXAMPLE, *judged(", frames: many, paid: 1")],
                 ["reward.options.vlm_judge.frames: expected int, got a string 'many'",
                  "reward.options.vlm_judge.paid: expected bool, got int 1"], id="scorer-option-wrong-types"),
    pytest.param(["check", EXAMPLE, "reward.options={{jpeg_compressibility: {{quality: 9.5}}}}",
                  "reward.weights={{jpeg_compressibility: 1.0}}"],
                 ["reward.options.jpeg_compressibility.quality: expected int, got float 9.5"],
                 id="scorer-option-every-scorer"),
    pytest.param(["check", EXAMPLE, "data.prompts={tmp}/surrogate.jsonl"],
                 ["data.prompts", "surrogate.jsonl:2", "field 'prompt'", "lone surrogate", "\\ud800"],
                 id="prompts-lone-surrogate"),
    pytest.param(train("model.height=64", "model.width=64"),
                 ["model.height=64", "at most 32x32 pixels", "pos_embed_max_size 8"], id="model-height-past-pos-embed"),
    pytest.param(train(*judged(", ledger: '{tmp}/ledger.sqlite'")),
                 ["ledger.sqlite", "is not a valid judge request ledger", "file is not a database"],
                 id="judge-ledger-corrupt"),
]


@pytest.mark.parametrize(("args", "must_mention"), CASES)
def test_bad_input_is_one_line(places, tmp_path, args, must_mention):
    places = {**places, "out": str(tmp_path)}  # each case's own place for the run a refused train would write
    args = [a.format(**places) for a in args]
    before = tree_digest(places["tmp"])
    rc, _, stderr = run_cli(args, places["tmp"], in_process=True)
    assert "internal error" not in stderr, stderr
    assert_one_line_error(rc, stderr, [m.format(**places) for m in must_mention])
    assert tree_digest(places["tmp"]) == before


def test_a_live_run_is_named_by_its_lock_holder(places):
    """A second ``train`` into a run directory that a live process holds: ``locked by PID N (running since ...)``
    (was: ``already holds a run``, which sent the user to --overwrite or train.resume)."""
    live = Path(places["tmp"]) / "live_run"
    with lock_holder(live) as holder:
        before = tree_digest(places["tmp"])
        for more in ([], ["--overwrite"], ["train.resume=auto"]):
            args = [a.format(**places) for a in train(f"run.output_dir={places['tmp']}", "run.name=live_run", *more)]
            rc, _, stderr = run_cli(args, places["tmp"], in_process=True)
            assert_one_line_error(rc, stderr, [str(live), f"is locked by PID {holder.pid} on host",
                                               "(running since 20"])
            assert tree_digest(places["tmp"]) == before


class FullDisk(io.RawIOBase):
    """A file whose every write fails as on a disk with no space left (``OSError`` ENOSPC)."""

    def writable(self):
        return True

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_during_a_checkpoint_names_the_file_and_commits_nothing(places, tmp_path, monkeypatch):
    """``torch.save`` of ``optimizer.pt`` onto a disk with no space left: one line naming the file and ``No space
    left on device`` (was: ``internal error: RuntimeError: [enforce fail at inline_container.cc:672] . unexpected
    pos ...``, what torch's own writer raises given a path); the earlier checkpoint is untouched and still the latest,
    the new one is not committed and holds no temporary."""
    import torch

    args = [a.format(**places) for a in train(f"run.output_dir={tmp_path}", "checkpoint.every=1")]
    rc, _, stderr = run_cli(args, tmp_path, in_process=True)
    assert rc == 0, stderr
    run = tmp_path / "r"
    assert (run / "checkpoints" / "step_000001" / "COMMITTED").is_file()
    first = tree_digest(run / "checkpoints" / "step_000001")
    real_save = torch.save

    def full_disk(obj, f, *a, **kw):
        if "optimizer.pt" not in str(getattr(f, "name", f)):
            return real_save(obj, f, *a, **kw)
        if isinstance(f, (str, os.PathLike)):  # torch's C++ writer on a full disk (the message measured on main)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(obj, FullDisk(), *a, **kw)

    monkeypatch.setattr(torch, "save", full_disk)
    args = [a.format(**places) for a in train(f"run.output_dir={tmp_path}", "checkpoint.every=1", "train.resume=auto",
                                              "train.steps=2")]
    rc, _, stderr = run_cli(args, tmp_path, in_process=True)
    monkeypatch.undo()
    assert "internal error" not in stderr, stderr
    assert_one_line_error(rc, stderr, [str(run / "checkpoints" / "step_000002" / "optimizer.pt"),
                                       "No space left on device"])
    assert tree_digest(run / "checkpoints" / "step_000001") == first
    second = run / "checkpoints" / "step_000002"
    assert not (second / "COMMITTED").exists()
    assert not [p for p in second.rglob("*") if ".tmp-" in p.name or p.name == "optimizer.pt"]
    assert (run / "checkpoints" / "latest").read_text().strip().endswith("step_000001")
