"""What an export holds besides the weights: the run's ``config.yaml``, a model card ``README.md``, and, for a demo
base, a diffusers pipeline directory around the merged transformer.

==========================  ==========================================================================================
file                        content
==========================  ==========================================================================================
``config.yaml``             the run's resolved config, so ``flowforge sample OUT`` works after the run directory is gone
``README.md``               model card: base model, algorithm, reward weights, checkpoint step, eval metrics (last and
                            max over the run's ``eval.jsonl``), the loading snippet of this export's form, the config
``pipeline.py`` (demo)      :mod:`flowforge.demo.pipeline` copied verbatim (it imports no flowforge)
``model_index.json`` (demo) ``_class_name = ["pipeline", "FlowforgeDigitsPipeline"]`` and the components below
``scheduler/`` (demo)       ``FlowMatchEulerDiscreteScheduler(shift=sampler.shift)``
``text_encoder/``,          the MiniLM text encoder (``BertModel``) and its tokenizer, saved with ``save_pretrained``
``tokenizer/`` (demo)
==========================  ==========================================================================================

A demo base is a bare SD3 transformer directory whose ``flowforge.json`` names the ``minilm`` text encoder (the
embedded ``demo:base`` and models trained from it): it has no diffusers pipeline of its own, so the merged export
becomes one (``DiffusionPipeline.from_pretrained(OUT, custom_pipeline=f"{OUT}/pipeline.py", trust_remote_code=True)``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from flowforge.config import dump_config
from flowforge.demo.paths import DEMO_DIR
from flowforge.models.common import FLOWFORGE_META

CARD_NAME = "README.md"
CONFIG_NAME = "config.yaml"
PIPELINE_FILE = "pipeline.py"
PIPELINE_CLASS = "FlowforgeDigitsPipeline"


def is_demo_base(transformer_dir: Path, adapter: str) -> bool:
    """Whether ``transformer_dir`` (a bare transformer directory) is a MiniLM-conditioned SD3 demo model."""
    meta = transformer_dir / FLOWFORGE_META
    if adapter != "sd3" or not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("text_encoder") == "minilm"
    except (OSError, ValueError, AttributeError):
        return False


def write_demo_pipeline(work: Path, transformer_dir: Path, cfg) -> None:
    """Make ``work`` (holding the merged ``transformer/``) a diffusers pipeline directory (module table).

    ``cfg`` is the run's config: ``sampler.shift`` / ``num_steps`` / ``guidance_scale`` and ``model.height`` /
    ``width`` become the scheduler's shift and the pipeline's defaults; the context length is the base's
    ``flowforge.json`` ``max_length``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import AutoModel, AutoTokenizer

    from flowforge.models.text import minilm_model_dir

    meta = json.loads((transformer_dir / FLOWFORGE_META).read_text())
    FlowMatchEulerDiscreteScheduler(shift=float(cfg.sampler.shift)).save_pretrained(str(work / "scheduler"))
    minilm = minilm_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(minilm, local_files_only=True)
    tokenizer.save_pretrained(str(work / "tokenizer"))
    encoder = AutoModel.from_pretrained(minilm, local_files_only=True)
    encoder.save_pretrained(str(work / "text_encoder"), safe_serialization=True)
    shutil.copy2(DEMO_DIR / PIPELINE_FILE, work / PIPELINE_FILE)
    import diffusers

    index = {
        "_class_name": ["pipeline", PIPELINE_CLASS], "_diffusers_version": diffusers.__version__,
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", type(encoder).__name__],
        "tokenizer": ["transformers", type(tokenizer).__name__],
        "max_length": int(meta.get("max_length", 16)), "height": int(cfg.model.height),
        "width": int(cfg.model.width), "num_inference_steps": int(cfg.sampler.num_steps),
        "guidance_scale": float(cfg.sampler.guidance_scale), "negative_prompt": "",
    }
    (work / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def _eval_table(run_dir: Path) -> str:
    """Markdown rows ``metric | last (step) | max (step)`` over ``run_dir/eval.jsonl``; unreadable lines skipped."""
    path = run_dir / "eval.jsonl"
    rows: list[dict] = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                rows.append(record)
    keys = sorted({k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))
                   and not isinstance(v, bool)})
    if not keys:
        return "No evaluation was recorded (`eval.jsonl` is absent or empty).\n"
    lines = ["| metric | last (step) | max (step) |", "|---|---|---|"]
    for key in keys:
        points = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
        last, best = points[-1], max(points, key=lambda p: p[1])
        lines.append(f"| `{key}` | {last[1]:.4g} ({last[0]}) | {best[1]:.4g} ({best[0]}) |")
    return "\n".join(lines) + "\n"


def loading_snippet(form: str, out: Path, *, transformer_class: str, base_transformer: str, pipeline: str | None,
                    layout_kind: str) -> str:
    """The Python that loads this export without flowforge.

    Args:
        form: ``"adapter"`` or ``"merged"``.
        transformer_class: the diffusers transformer class name; base_transformer: the base transformer directory.
        pipeline: the diffusers pipeline class with ``load_lora_weights`` (adapter) / of the base (merged).
        layout_kind: ``"demo"`` (custom pipeline), ``"pipeline"`` or ``"transformer"`` (merged only).
    """
    o = str(out)
    if form == "adapter":
        return (f"from diffusers import {transformer_class}\nfrom peft import PeftModel\n\n"
                "# peft: adapter_model.safetensors + adapter_config.json\n"
                f"model = PeftModel.from_pretrained({transformer_class}.from_pretrained({base_transformer!r}), "
                f"{o!r})\n\n"
                "# diffusers: pytorch_lora_weights.safetensors (or pipe.load_lora_weights(OUT) on a "
                f"{pipeline or 'diffusers'} of the base)\n"
                f"transformer = {transformer_class}.from_pretrained({base_transformer!r})\n"
                f"transformer.load_lora_adapter({o!r}, prefix=\"transformer\", use_safetensors=True)\n")
    if layout_kind == "demo":
        return ("import torch\nfrom diffusers import DiffusionPipeline\n\n"
                f"out = {o!r}\n"
                f"pipe = DiffusionPipeline.from_pretrained(out, custom_pipeline=out + \"/{PIPELINE_FILE}\", "
                "trust_remote_code=True)\n"
                "images = pipe([\"the digit 7\"], generator=torch.Generator().manual_seed(0)).images\n")
    if layout_kind == "pipeline":
        name = pipeline or "DiffusionPipeline"
        return f"from diffusers import {name}\n\npipe = {name}.from_pretrained({o!r})\n"
    return f"from diffusers import {transformer_class}\n\nmodel = {transformer_class}.from_pretrained({o!r})\n"


def _sample_prompt(cfg) -> str:
    """The prompt flag of the card's sample command: an image task's prompts need their condition image (a world
    model's its first frame), so they come from the run's eval prompt file."""
    from flowforge.data.prompts import IMAGE_TASKS

    if cfg.model.task in IMAGE_TASKS and cfg.data.eval_prompts:
        return f"--prompt-file {cfg.data.eval_prompts}"
    return '--prompt "..."'


def write_card_and_config(work: Path, out: Path, cfg, *, run_dir: Path, step: int, weights: str, form: str,
                          base_model: str, snippet: str) -> None:
    """Write ``work/config.yaml`` (the run's resolved config) and the model card ``work/README.md``."""
    own = run_dir / CONFIG_NAME  # verbatim: the file the run resolved and trained with
    config_text = own.read_text(encoding="utf-8") if own.is_file() else dump_config(cfg)
    (work / CONFIG_NAME).write_text(config_text, encoding="utf-8")
    rewards = ", ".join(f"`{k}` x {v:g}" for k, v in dict(cfg.reward.weights).items()) or "none"
    card = "\n".join([
        f"# {out.name}: {cfg.train.algorithm} post-training of {base_model}", "",
        "Exported by `flowforge export` (form `" + form + "`).", "",
        "| field | value |", "|---|---|",
        f"| base model | `{base_model}` (adapter `{cfg.model.adapter}`, task `{cfg.model.task}`) |",
        f"| algorithm | `{cfg.train.algorithm}` |",
        f"| reward(s) | {rewards} |",
        f"| steps | checkpoint step {step} of `train.steps` = {cfg.train.steps} ({weights} weights) |",
        f"| trainable | `{cfg.lora.trainable}` |",
        f"| run | `{run_dir}` |", "",
        "## Evaluation (held-out prompts, `eval.jsonl`)", "", _eval_table(run_dir),
        "## Loading", "", "```python", snippet.rstrip("\n"), "```", "",
        f"With flowforge: `flowforge sample {out} {_sample_prompt(cfg)} --out grid.png`.", "",
        "## Config", "", "```yaml", config_text.rstrip("\n"), "```", ""])
    (work / CARD_NAME).write_text(card, encoding="utf-8")
