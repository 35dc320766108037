"""A digest of what a tiny pipeline run and a tiny ``flowforge train`` write, for comparing two versions of the code
(issue 40: the trainer's seams must not change a bit of what the pipeline does).

``python -m tests.orchestrate.pipeline_digest OUT.json [WORKDIR]`` runs, on the tiny random SD3 of
``tests/conftest.py``:

1. the whole pipeline A -> B -> C (:mod:`tests.orchestrate.support`) with the demo teacher behind a real judge server,
   the student in process, C audited, and ``eval.teacher_groups=1`` (the teacher on the first held-out group);
2. stage A with a scripted teacher that never answers the first group (the group is dropped, counted);
3. ``flowforge train`` of the digits example for 2 steps;

and writes one JSON object: every JSONL line (the condition ledger, metrics, eval, audits; timing keys and
timestamps left out), every row of every SQLite judge ledger (time columns left out) and the sha256 of every
tensor of every checkpoint. ``python -m tests.orchestrate.pipeline_digest OUT.json WORKDIR digest`` digests an
existing WORKDIR again without running anything. Two digests are compared with
``python tests/orchestrate/digest_diff.py A.json A_WORKDIR B.json B_WORKDIR`` (work directories and loopback ports
normalised). Nothing of it is a test: about 3 minutes of CPU on one thread.

Issue 40 (the trainer's seams) was checked with it: the pipeline's digests before and after were identical; plain
``flowforge train`` kept a byte-identical ``eval.jsonl`` and checkpoints, its ``metrics.jsonl`` gained
``reward/judge_failed_groups`` and ``reward/total_mean`` became the float64 mean of the kept rows (last float32 digit).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
from pathlib import Path

TIME_WORDS = ("time", "_at", "timestamp", "elapsed", "wall", "created", "started", "ended", "duration", "date",
              "latency", "unix")


def _timeless(value):
    """``value`` without the keys that hold wall-clock times or durations (they differ from run to run)."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items()
                if not (k.startswith(("time/", "perf/")) or any(w in k.lower() for w in TIME_WORDS))}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def _jsonl(path: Path) -> list:
    return [_timeless(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _sqlite(path: Path) -> dict:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        out = {}
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name"):
            cur = con.execute(f"SELECT * FROM {table}")
            cols = [d[0] for d in cur.description]
            # not compared: clocks, latencies, the writing process (owner) and the server's reply envelope (a random
            # completion id and its clock; the scores it carried are in scores_json / status)
            # (nor the attempts' row ids: two requests in flight at once are numbered in the order they leave)
            keep = [i for i, c in enumerate(cols) if not any(w in c.lower() for w in TIME_WORDS)
                    and c not in ("owner", "response_json", "id")]
            out[table] = sorted(json.dumps([row[i] for i in keep], default=str)
                                for row in cur.fetchall())
        return out
    finally:
        con.close()


def _tensors(path: Path) -> dict:
    import torch

    out = {}
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        items = load_file(str(path)).items()
    else:
        obj = torch.load(path, map_location="cpu", weights_only=False)
        items = []

        def walk(prefix, v):
            if isinstance(v, torch.Tensor):
                items.append((prefix, v))
            elif isinstance(v, dict):
                for k, w in v.items():
                    walk(f"{prefix}.{k}", w)
            elif isinstance(v, (list, tuple)):
                for i, w in enumerate(v):
                    walk(f"{prefix}.{i}", w)
        walk("", obj)
    for name, t in sorted(items):
        t = t.detach().contiguous().cpu().reshape(-1)
        out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()
    return out


def digest(root: Path) -> dict:
    """Everything comparable under ``root`` (relative paths as keys)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        rel = str(path.relative_to(root))
        if path.suffix == ".jsonl" and "requests" not in path.name:
            out[rel] = _jsonl(path)
        elif path.suffix == ".sqlite":
            out[rel] = _sqlite(path)
        elif path.suffix in (".safetensors", ".pt", ".bin") and "checkpoints" in path.parts:
            out[rel] = _tensors(path)
        elif path.suffix == ".json" and path.name not in ("provenance.json",):
            out[rel] = _timeless(json.loads(path.read_text()))
        elif path.suffix == ".log" and path.name == "requests.log":
            out[rel] = sorted(r["key"] for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()))
    return out


def main(out: str, work: str, only_digest: bool = False) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("FLOWFORGE_THREAD_CHECK", "0")
    import torch

    torch.set_num_threads(1)
    from flowforge.demo.model import build_tiny_sd3, test_sd3_config
    from flowforge.models.sd3.adapter import FLOWFORGE_META
    from flowforge.orchestrate.config import check_pipeline, load_pipeline
    from flowforge.orchestrate.stages import run_pipeline
    from tests.orchestrate.support import write_pipeline
    from tests.serve.judge_support import TOKEN_ENV, start, stop

    work = Path(work)
    if only_digest:
        Path(out).write_text(json.dumps({k: digest(work / k) for k in ("full", "drop", "plain")}, indent=1,
                                        sort_keys=True))
        return
    model, cache = work / "model", work / "cache"
    if not model.is_dir():
        build_tiny_sd3(test_sd3_config(), seed=0).save_pretrained(str(model), safe_serialization=True)
        (model / FLOWFORGE_META).write_text(json.dumps({"text_encoder": "minilm", "max_length": 16}))
    result = {}

    full = work / "full"
    pcfg = load_pipeline(write_pipeline(work / "full.yaml", model, full / "runs", cache,
                                        stages={"n_a": 4, "c_steps": 2, "student_serving": "in_process"},
                                        eval={"teacher_groups": 1}))
    check_pipeline(pcfg)
    result["full/status"] = run_pipeline(pcfg, progress=False).status
    result["full"] = digest(full)

    drop = work / "drop"
    drop.mkdir(parents=True, exist_ok=True)
    (drop / "token").write_text("s3cret")
    os.environ[TOKEN_ENV] = "s3cret"
    (drop / "script.json").write_text(json.dumps(["malformed", "wrong_count", "malformed"]))
    server, url = start(["-m", "tests.serve.judge_support", "scripted", "--script", str(drop / "script.json"),
                         "--token-file", str(drop / "token"), "--request-log", str(drop / "teacher.log")])
    try:
        pcfg = load_pipeline(write_pipeline(work / "drop.yaml", model, drop / "runs", cache, stages={"n_a": 4},
                                            teacher={"url": url + "/v1", "api_key_env": TOKEN_ENV, "scorer": "",
                                                     "model": "scripted",
                                                     "judge": {"frames": 1, "max_side": 32, "max_concurrency": 1,
                                                               "max_attempts": 3, "retry_backoff_s": 0.01}}))
        result["drop/status"] = run_pipeline(pcfg, stage="A", progress=False).status
    finally:
        stop(server)
    result["drop"] = digest(drop)

    from flowforge.cli import main as cli

    plain = work / "plain"
    example = Path(__file__).resolve().parents[2] / "examples" / "digits" / "grpo.yaml"
    rc = cli(["train", str(example), f"model.path={model}", f"run.output_dir={plain}", "run.name=t",
              f"data.cache_dir={cache}", "data.prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4",
              "sampler.num_sde_steps=2", "train.micro_batch_size=4", "train.steps=2", "eval.max_prompts=2",
              "eval.samples_per_prompt=2", "eval.every=0", "checkpoint.every=2", "run.num_threads=1",
              "--no-progress"])
    result["plain/rc"] = rc
    result["plain/eval.jsonl bytes sha256"] = hashlib.sha256((plain / "t" / "eval.jsonl").read_bytes()).hexdigest()
    result["plain"] = digest(plain)
    Path(out).write_text(json.dumps(result, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "/tmp/pipeline_digest", sys.argv[3:] == ["digest"])
