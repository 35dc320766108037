"""What an export holds besides the weights: the run's ``config.yaml``, a model card ``README.md``, and, for a demo
base, a diffusers pipeline directory around the merged transformer.

==========================  ==========================================================================================
file                        content
==========================  ==========================================================================================
``config.yaml``             the run's resolved config, so ``flowforge sample OUT`` works after the run directory is gone
                            (portable: the base as the export names it, absolute paths relative to ``OUT``)
``README.md``               model card: base model, algorithm, reward weights, checkpoint step, eval metrics (last and
                            max over the run's ``eval.jsonl``), the loading snippet of this export's form (every path
                            relative to ``out = "."``), the config's sections this run's algorithm reads
``base/`` (demo, adapter)   the base as a diffusers pipeline (the files below, the untrained transformer in
                            ``base/transformer/``): :func:`flowforge.tools.export.diffusers.carry_demo_base`
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
from flowforge.tools.export import portable

CARD_NAME = "README.md"
CONFIG_NAME = "config.yaml"
PIPELINE_FILE = "pipeline.py"
PIPELINE_CLASS = "FlowforgeDigitsPipeline"
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
"""How the saved MiniLM files name their origin (transformers writes ``_name_or_path``; the local package directory
it was read from is a path of this machine)."""


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
    tokenizer.name_or_path = MINILM_HUB_ID  # not this machine's package directory (the saved files name it)
    tokenizer.save_pretrained(str(work / "tokenizer"))
    encoder = AutoModel.from_pretrained(minilm, local_files_only=True)
    encoder.config._name_or_path = MINILM_HUB_ID
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


OUT_LINE = 'out = "."  # this export\'s directory (where this README lies); set it when running from elsewhere\n'
"""The first line of every loading snippet: the snippet names every file relative to ``out``, so it runs wherever the
export was moved (:mod:`flowforge.tools.export.portable`)."""
CARRIED_BASE = "base"
"""The sub-directory an adapter export of a demo-style base carries the base in, as a diffusers pipeline (that base has
no pipeline anywhere else: :func:`write_demo_pipeline`)."""


def base_expr(base: str) -> str:
    """Python for the base named ``base`` in a snippet: a path relative to the export joined to ``out``; a hub id as
    it is; a ``demo:`` name (a flowforge-packaged base) through flowforge's resolver."""
    from flowforge.demo.paths import is_demo_name

    if is_demo_name(base):
        return f"{base!r}  # a flowforge demo name: flowforge.demo.paths.resolve_demo_path gives its directory"
    if base.startswith(("../", "./")) or base in (".", ".."):
        return f"os.path.join(out, {base!r})  # the base model, relative to this export"
    return f"{base!r}"


def loading_snippet(form: str, *, transformer_class: str, base: str, pipeline: str | None, layout_kind: str,
                    base_layout: str) -> str:
    """The Python that loads this export without flowforge, from wherever it lies (every path relative to ``out``).

    Args:
        form: ``"adapter"`` or ``"merged"``.
        transformer_class: the diffusers transformer class name; base: the base as the export names it
            (:func:`flowforge.tools.export.portable.base_ref`).
        pipeline: the diffusers pipeline class with ``load_lora_weights`` (adapter) / of the base (merged).
        layout_kind: the export's layout: ``"demo"`` (custom pipeline), ``"pipeline"`` or ``"transformer"`` (merged
            only).
        base_layout: the base's layout (adapter only): ``"carried"`` (a demo-style base carried in
            ``OUT/base/``), ``"pipeline"`` (a diffusers pipeline directory or hub id) or ``"transformer"``.
    """
    head = "import os\n\n" + OUT_LINE
    if form == "adapter":
        if base_layout == "carried":
            return (head + "import torch\nfrom diffusers import DiffusionPipeline, SD3Transformer2DModel\n"
                    "from peft import PeftModel\n\n"
                    f"base = os.path.join(out, {CARRIED_BASE!r})  # the base as a diffusers pipeline, carried in the "
                    "export\n"
                    f"pipe = DiffusionPipeline.from_pretrained(base, custom_pipeline=os.path.join(base, "
                    f"{PIPELINE_FILE!r}), trust_remote_code=True)\n"
                    "pipe.transformer.load_lora_adapter(out, prefix=\"transformer\", use_safetensors=True)  "
                    "# pytorch_lora_weights.safetensors\n"
                    "images = pipe([\"the digit 7\"], generator=torch.Generator().manual_seed(0)).images\n\n"
                    "# peft: adapter_model.safetensors + adapter_config.json on the bare base transformer\n"
                    "model = PeftModel.from_pretrained(SD3Transformer2DModel.from_pretrained(os.path.join(base, "
                    "\"transformer\")), out)\n")
        if base_layout == "pipeline" and pipeline:
            return (head + f"from diffusers import {pipeline}, {transformer_class}\nfrom peft import PeftModel\n\n"
                    f"base = {base_expr(base)}\n"
                    f"pipe = {pipeline}.from_pretrained(base)\n"
                    "pipe.load_lora_weights(out)  # pytorch_lora_weights.safetensors\n\n"
                    "# peft: adapter_model.safetensors + adapter_config.json on the bare base transformer\n"
                    f"model = PeftModel.from_pretrained({transformer_class}.from_pretrained(base, "
                    "subfolder=\"transformer\"), out)\n")
        # a bare transformer base, or a pipeline of a family none of whose pipelines has a LoRA loader: the
        # transformer loads it (pipe.transformer = transformer puts it back into the base's pipeline)
        sub = ", subfolder=\"transformer\"" if base_layout == "pipeline" else ""
        return (head + f"from diffusers import {transformer_class}\nfrom peft import PeftModel\n\n"
                f"base = {base_expr(base)}\n"
                "# diffusers: pytorch_lora_weights.safetensors\n"
                f"transformer = {transformer_class}.from_pretrained(base{sub})\n"
                "transformer.load_lora_adapter(out, prefix=\"transformer\", use_safetensors=True)\n\n"
                "# peft: adapter_model.safetensors + adapter_config.json\n"
                f"model = PeftModel.from_pretrained({transformer_class}.from_pretrained(base{sub}), out)\n")
    if layout_kind == "demo":
        return (head + "import torch\nfrom diffusers import DiffusionPipeline\n\n"
                f"pipe = DiffusionPipeline.from_pretrained(out, custom_pipeline=os.path.join(out, {PIPELINE_FILE!r}), "
                "trust_remote_code=True)\n"
                "images = pipe([\"the digit 7\"], generator=torch.Generator().manual_seed(0)).images\n")
    if layout_kind == "pipeline":
        name = pipeline or "DiffusionPipeline"
        return head + f"from diffusers import {name}\n\npipe = {name}.from_pretrained(out)\n"
    return head + f"from diffusers import {transformer_class}\n\nmodel = {transformer_class}.from_pretrained(out)\n"


def _imports_first(snippet: str) -> str:
    """``snippet`` with its ``out = ...`` line (:data:`OUT_LINE`) moved below the import lines that open it."""
    lines = snippet.splitlines(keepends=True)
    out_line = OUT_LINE
    if out_line not in lines:
        return snippet
    lines.remove(out_line)
    last_import = max((i for i, line in enumerate(lines) if line.startswith(("import ", "from "))), default=-1)
    while last_import + 1 < len(lines) and lines[last_import + 1].strip() == "":
        last_import += 1
    return "".join(lines[:last_import + 1] + [out_line] + lines[last_import + 1:])


def _sample_prompt(cfg, data: dict) -> str:
    """The prompt flag of the card's sample command: an image task's prompts need their condition image (a world
    model's its first frame), so they come from the run's eval prompt file (as the portable config ``data`` names
    it)."""
    from flowforge.data.prompts import IMAGE_TASKS

    if cfg.model.task in IMAGE_TASKS and cfg.data.eval_prompts:
        return f"--prompt-file {data.get('data', {}).get('eval_prompts', cfg.data.eval_prompts)}"
    return '--prompt "..."'


def write_card_and_config(work: Path, out: Path, cfg, *, run_dir: Path, step: int, weights: str, form: str,
                          base_model: str, snippet: str) -> None:
    """Write ``work/config.yaml`` (the run's resolved config, portable) and the model card ``work/README.md``.

    ``base_model`` is the base as the export names it (:func:`flowforge.tools.export.portable.base_ref`); ``out`` is
    where the export will lie (paths in the config become relative to it). The card names no path of this machine:
    the run by its name, the config with the run's own sections only (:func:`~flowforge.tools.export.portable.
    own_sections`).
    """
    own = run_dir / CONFIG_NAME  # the file the run resolved and trained with
    config_text = own.read_text(encoding="utf-8") if own.is_file() else dump_config(cfg)
    data = portable.portable_config(config_text, out, base_model)
    (work / CONFIG_NAME).write_text(portable.dump(data), encoding="utf-8")
    card_config = portable.dump(portable.own_sections(data, cfg.train.algorithm))
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
        f"| run | `{cfg.run.name}` |", "",
        "## Evaluation (held-out prompts, `eval.jsonl`)", "", _eval_table(run_dir),
        "## Loading", "",
        "Every path below is relative to this export's directory (`out`), so the code runs wherever the export was "
        "moved" + (" (a local base is named relative to it: move it along)" if base_model.startswith("..") else "")
        + ".", "",
        "```python", _imports_first(snippet).rstrip("\n"), "```", "",
        f"With flowforge, from this directory: `flowforge sample . {_sample_prompt(cfg, data)} --out grid.png`.", "",
        f"## Config ({cfg.train.algorithm}'s sections; every key: `config.yaml`)", "",
        "```yaml", card_config.rstrip("\n"), "```", ""])
    (work / CARD_NAME).write_text(card, encoding="utf-8")
