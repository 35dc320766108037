"""The memory plan of every ``examples/gpu/*.yaml`` run config, as a Markdown table written into
``docs/guides/memory_plan.md`` and ``README.md`` (between their ``plan-table`` markers), so it can be regenerated after
a change.

    python bench/plan_table.py [--gpu h100-80gb] [--check] [--only a.yaml b.yaml ...]

GPUs per config: the ``torchrun --nproc_per_node N`` of the config's header comment (1 when it names none). Each row
is planned, not measured on a GPU. A config whose model the planner cannot size offline (no local
``config.json``, no published entry) is listed with the reason. Pipeline configs (a ``stages`` section) are skipped.
``--check`` exits 1 when the page's table differs from a fresh one (nothing is written). ``--only`` plans just the
named configs and keeps the page's other rows as they are (a measurement at real width takes minutes on a small CPU).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
PAGE = ROOT / "docs" / "guides" / "memory_plan.md"
PAGES = (PAGE, ROOT / "README.md")  # the same table in both; tests/docs checks they agree
START, END = "<!-- plan-table:start -->", "<!-- plan-table:end -->"


def gpus_of(path: Path) -> int:
    m = re.search(r"--nproc_per_node[ =](\d+)", path.read_text())
    return int(m.group(1)) if m else 1


def page_rows() -> dict[str, str]:
    """The page's current table rows, by config file name."""
    table = PAGE.read_text().split(START, 1)[1].split(END, 1)[0]
    return {line.split("|")[1].strip(): line for line in table.strip().splitlines()[2:]}


def rows(gpu: str, only: list[str] | None = None) -> list[str]:
    import torch

    from flowforge.config import load_config
    from flowforge.orchestrate.config import is_pipeline_file
    from flowforge.tools.plan import plan_config

    torch.set_num_threads(max(1, torch.get_num_threads()))
    kept = page_rows() if only is not None else {}
    out = [f"| config | model | algorithm | trains | GPUs | per-rank peak (GB) | fits on {gpu}? |",
           "|---|---|---|---|---:|---:|---|"]
    for path in sorted((ROOT / "examples" / "gpu").glob("*.yaml")):
        if is_pipeline_file(path):
            continue
        if only is not None and path.name not in only:
            out.append(kept[path.name])
            continue
        cfg = load_config(path)
        n = gpus_of(path)
        trains = "LoRA r{}".format(cfg.lora.rank or 8) if cfg.lora.trainable == "lora" else cfg.lora.trainable
        head = f"| {path.name} | {Path(cfg.model.path).name} | {cfg.train.algorithm} | {trains} | {n} |"
        try:
            plan = plan_config(cfg, n, gpu)
        except ValueError as exc:
            reason = "no published config offline" if "knows offline" in str(exc) else str(exc).split(";")[0]
            out.append(f"{head} - | not planned: {reason} |")
            continue
        total = plan.peak / 1e9 + plan.as_dict()["context_gb"]
        verdict = "yes" if plan.fits else f"no; {plan.fix}"
        out.append(f"{head} {total:.1f} ({plan.peak_phase}) | {verdict} |")
        print(out[-1], flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="h100-80gb")
    p.add_argument("--check", action="store_true")
    p.add_argument("--only", nargs="+", metavar="CONFIG", help="plan only these examples/gpu file names")
    args = p.parse_args(argv)
    table = "\n".join(rows(args.gpu, args.only))
    changed = {}
    for page in PAGES:
        text = page.read_text()
        before, rest = text.split(START, 1)
        _, after = rest.split(END, 1)
        new = f"{before}{START}\n{table}\n{END}{after}"
        if new != text:
            changed[page] = new
    if args.check:
        return 1 if changed else 0
    for page, new in changed.items():
        page.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
