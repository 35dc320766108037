"""Generate images with a trained run or an export: ``flowforge sample RUN_OR_EXPORT --prompt "..." --out grid.png``.

What is loaded
--------------
================================  ==================================================================================
source                            model
================================  ==================================================================================
a run directory (``config.yaml``  the base (``model.path`` of the run's config, or ``base``) with the newest
+ ``checkpoints/``)               committed checkpoint's ``live`` weights: the LoRA injected as the trainer does
                                  (:func:`flowforge.models.lora.inject_lora`), or the full fine-tuned state dict
a ``merged`` export               the export directory itself (a diffusers transformer or pipeline directory)
an ``adapter`` export             the base (the export's ``base_model``, or ``base``) with the exported LoRA
================================  ==================================================================================

Every model is loaded through the adapter registry (:func:`flowforge.models.build_adapter`) with the run's
``model.adapter``, ``task``, ``dtype``, so every family the adapters support samples the way it trains, with its own
text encoder. An export's settings come from the run's config: ``OUT/config.yaml`` when the export holds one, else
the ``config.yaml`` of the run directory named in ``OUT/flowforge_export.json``.

How it samples
--------------
The held-out eval's sampler (:meth:`flowforge.train.trainer.Trainer.evaluate`): the deterministic ODE (Euler)
sampler :func:`flowforge.rollout.generate` on the run's schedule (``sampler.num_steps``, ``schedule``, ``shift``,
``mu``; a dynamic-shift family's own pipeline schedule), with the run's ``sampler.guidance_scale``; ``steps`` and
``guidance`` override those two. The initial noise of image ``j`` of prompt ``p`` (``N`` images per prompt) is
:func:`flowforge.rollout.candidate_noise` of candidate id ``p * N + j`` with ``seed`` in slot ``-1``: a function of
``(seed, p, j)`` only, so a seed gives the same images on every run, batch size and device order (and the eval
prompts with ``seed = eval.seed`` and ``N = eval.samples_per_prompt`` give the eval's own noise).

Image-conditioned tasks (``i2i``, ``i2v``) need a JSONL ``prompt_file`` whose records name their image
(``metadata.image``, the training prompt schema).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowforge.config import Config, load_config
from flowforge.data.images import load_condition_images
from flowforge.data.prompts import IMAGE_TASKS, PromptRecord, load_prompts
from flowforge.demo.paths import resolve_demo_path
from flowforge.models import build_adapter
from flowforge.models import lora as lora_lib
from flowforge.models.base import Conditioning, FlowModel
from flowforge.rollout import candidate_noise, decode_media, generate, sigmas_for
from flowforge.runtime.dtypes import resolve_dtype
from flowforge.runtime.durable import atomic_write
from flowforge.runtime.errors import UserError, file_error
from flowforge.tools.export import LORA_WEIGHT_NAME
from flowforge.tools.export_out import EXPORT_META
from flowforge.tools.export_source import check_contract, layout, load_source, pick_checkpoint, read_run_config
from flowforge.tools.sample_grid import labelled_grid, save_png, to_pil

log = logging.getLogger("flowforge")

PEFT_WEIGHT_NAME = "adapter_model.safetensors"
"""peft's own file name (``PeftModel.save_pretrained``); read when an adapter export has no diffusers LoRA file."""


@dataclass
class SampleModel:
    """A loaded model ready to sample, and the run config it was trained with."""

    adapter: FlowModel
    cfg: Config  # the run's config (model, sampler sections are used)
    source: str  # what was loaded, for logs and the sidecar


@dataclass(frozen=True)
class SampleResult:
    """What :func:`run_sample` wrote."""

    grid: Path  # the labelled grid
    images: list[Path]  # one PNG per image, prompt-major: image j of prompt p is images[p * num + j]
    media: torch.Tensor  # [P * num, 3, H, W] (video [P * num, 3, F, H, W]) float32 in [0, 1]


# ------------------------------------------------------------------------------------------------ loading
def _pick_device(cfg: Config, device: str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    wanted = cfg.run.device
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        log.warning("the run used device %s, which is not available here: sampling on cpu", wanted)
        return torch.device("cpu")
    return torch.device(wanted)


def _build(cfg: Config, path: str | Path, device: torch.device) -> FlowModel:
    m = cfg.model
    adapter = build_adapter(m.adapter, resolve_demo_path(str(path)), task=m.task,
                            dtype=resolve_dtype(m.dtype, key="model.dtype"), device=device)
    adapter.transformer.requires_grad_(False).eval()
    return adapter


def _load_run(run_dir: Path, device: str | None, base: str | None) -> SampleModel:
    """The run's base with its newest committed checkpoint's live weights (module table)."""
    cfg = read_run_config(run_dir)
    path = pick_checkpoint(run_dir, None)
    model_path = str(base if base is not None else cfg.model.path)
    base_dir = Path(resolve_demo_path(model_path))
    src = load_source(run_dir, cfg, path, "live", model_path, base_dir if base_dir.exists() else None)
    if src.base is None:
        raise UserError(f"model.path {model_path!r} of {run_dir / 'config.yaml'}", "the base model is not here",
                        "pass the base model directory with --base PATH")
    check_contract(src, layout(src.base)[0])
    adapter = _build(cfg, src.base, _pick_device(cfg, device))
    t = adapter.transformer
    if src.lora["trainable"] == "lora":
        lora_lib.inject_lora(t, int(src.lora["rank"]), float(src.lora["alpha"]), list(src.lora["targets"]))
        lora_lib.load_lora_state_dict(t, src.weights)
    else:  # a sharded (FSDP) checkpoint holds the parameters only; buffers then come from the base
        t.load_state_dict(src.weights, strict=False)
    t.requires_grad_(False).eval()
    return SampleModel(adapter, cfg, f"run {run_dir} checkpoint {path.name} (live weights)")


def _export_config(out: Path, meta: dict) -> Config:
    """The config of the run an export came from (module docstring)."""
    own = out / "config.yaml"
    candidates = [own] if own.is_file() else []
    run_dir = meta.get("run_dir")
    if isinstance(run_dir, str) and (Path(run_dir) / "config.yaml").is_file():
        candidates.append(Path(run_dir) / "config.yaml")
    if not candidates:
        raise UserError(out, f"has no config.yaml and the run it came from ({run_dir}) has none either, so the "
                        "model family and sampler settings are unknown", "copy the run's config.yaml into it")
    return load_config(candidates[0])


def _read_lora(out: Path) -> dict[str, torch.Tensor]:
    """The exported LoRA keyed as :func:`flowforge.models.lora.lora_state_dict` keys it."""
    for name, prefixes in ((LORA_WEIGHT_NAME, ("transformer.",)), (PEFT_WEIGHT_NAME, ("base_model.model.", ""))):
        path = out / name
        if path.is_file():
            try:
                state = load_file(str(path))
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for a damaged header
                raise file_error(path, exc, "export the run again") from exc
            prefix = next(p for p in prefixes if all(k.startswith(p) for k in state))
            return {k[len(prefix):]: v for k, v in state.items()}
    raise UserError(out, f"is an adapter export without {LORA_WEIGHT_NAME} or {PEFT_WEIGHT_NAME}",
                    "export the run again with --form adapter")


def _load_export(out: Path, device: str | None, base: str | None) -> SampleModel:
    try:
        meta = json.loads((out / EXPORT_META).read_text())
    except (OSError, ValueError) as exc:
        raise file_error(out / EXPORT_META, exc, "export the run again") from exc
    cfg = _export_config(out, meta)
    dev = _pick_device(cfg, device)
    if meta.get("form") == "merged":
        return SampleModel(_build(cfg, out, dev), cfg, f"merged export {out}")
    lora = meta.get("lora") or {}
    if lora.get("trainable") != "lora":
        raise UserError(out / EXPORT_META, f"form {meta.get('form')!r} with LoRA contract {lora} is not a LoRA "
                        "adapter export", "export the run again")
    base_path = base if base is not None else meta.get("base_model") or cfg.model.path
    adapter = _build(cfg, base_path, dev)
    lora_lib.inject_lora(adapter.transformer, int(lora["rank"]), float(lora["alpha"]), list(lora["targets"]))
    lora_lib.load_lora_state_dict(adapter.transformer, _read_lora(out))
    adapter.transformer.requires_grad_(False).eval()
    return SampleModel(adapter, cfg, f"adapter export {out} on base {base_path}")


def load_for_sampling(source: str | Path, *, device: str | None = None, base: str | None = None) -> SampleModel:
    """Load a run directory or an export directory for sampling (module table).

    Args:
        source: a run directory (``config.yaml`` + committed checkpoints) or an export (``flowforge_export.json``).
        device: where to run (default: the run's ``run.device``; cpu when that is CUDA and none is available).
        base: the base model directory when it moved (a run, or an adapter export).

    Raises:
        UserError (a ``ValueError``; ``ExportError`` included): ``source`` is neither; no committed checkpoint; a
            damaged file (named); a missing base; weights that do not fit the run's LoRA contract.
    """
    source = Path(source)
    if (source / EXPORT_META).is_file():
        return _load_export(source, device, base)
    if (source / "config.yaml").is_file():
        return _load_run(source, device, base)
    raise UserError(source, "is neither a run directory (config.yaml) nor a flowforge export (flowforge_export.json)",
                    "give the directory `flowforge train` or `flowforge export` wrote")


# ------------------------------------------------------------------------------------------------ sampling
def read_prompts(prompts: Sequence[str], prompt_file: str | Path | None, task: str) -> list[PromptRecord]:
    """``prompts`` then the prompts of ``prompt_file``: a JSONL prompt file (the training schema, ``.jsonl``) or
    plain text, one prompt per non-empty line.

    Raises:
        UserError: no prompt at all, or an image task (``i2i`` / ``i2v``) whose prompts name no image.
    """
    records = [PromptRecord(p, {"task": task, "sample_id": f"prompt{i}"}) for i, p in enumerate(prompts)]
    if prompt_file is not None:
        path = Path(prompt_file)
        if path.suffix == ".jsonl":
            records += load_prompts(path)
        else:
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise file_error(path, exc, "give a text file with one prompt per line, or a .jsonl prompt file") \
                    from exc
            records += [PromptRecord(t.strip(), {"task": task, "sample_id": f"line{i}"})
                        for i, t in enumerate(lines) if t.strip()]
    if not records:
        raise UserError("--prompt", "no prompt given", 'pass --prompt "..." or --prompt-file F')
    if task in IMAGE_TASKS and any("image" not in r.metadata for r in records):
        raise UserError("--prompt", f"model.task={task!r} needs a condition image per prompt",
                        "give a .jsonl --prompt-file whose records name metadata.image")
    return records


def schedule(model: SampleModel, steps: int | None) -> torch.Tensor:
    """The run's ``[T+1]`` fp32 sampling schedule with ``T = steps`` (default ``sampler.num_steps``), computed as
    the trainer does (:meth:`flowforge.train.trainer.Trainer._schedule`)."""
    s, m = model.cfg.sampler, model.cfg.model
    if steps is not None:
        s = dataclasses.replace(s, num_steps=int(steps))
    if s.schedule == "dynamic" and s.mu is None:
        pipeline = model.adapter.pipeline_sigmas(s.num_steps, m.height, m.width)
        if pipeline is not None:
            return pipeline.float().cpu()
    return sigmas_for(s, tuple(model.adapter.latent_shape(m.height, m.width, m.frames)))


def _conditioning(model: SampleModel, records: list[PromptRecord], device: torch.device) -> Conditioning:
    m = model.cfg.model
    cond = model.adapter.encode([r.prompt for r in records]).to(device)
    if m.task not in IMAGE_TASKS:
        return cond
    images = load_condition_images([r.metadata["image"] for r in records], m.height, m.width)
    shape = tuple(model.adapter.latent_shape(m.height, m.width, m.frames))
    return model.adapter.condition_on_images(cond, [r.prompt for r in records], images.to(device), shape)


@torch.no_grad()
def sample(model: SampleModel, records: list[PromptRecord], *, num: int = 1, seed: int = 0,
           guidance: float | None = None, steps: int | None = None, batch_size: int = 8) -> torch.Tensor:
    """``num`` images per prompt with the ODE sampler (module docstring).

    Returns:
        ``[P * num, 3, H, W]`` (video ``[P * num, 3, F, H, W]``) float32 in [0, 1] on CPU, prompt-major.

    Raises:
        ValueError: ``num``, ``steps`` or ``batch_size`` < 1.
    """
    if num < 1 or batch_size < 1 or (steps is not None and steps < 1):
        raise UserError("--num / --steps / --batch-size", f"must be >= 1, got {num} / {steps} / {batch_size}")
    m = model.cfg.model
    g = model.cfg.sampler.guidance_scale if guidance is None else float(guidance)
    device = next(model.adapter.transformer.parameters()).device
    sigmas = schedule(model, steps)
    latent_shape = tuple(model.adapter.latent_shape(m.height, m.width, m.frames))
    cond = _conditioning(model, records, device)
    prompt_idx = torch.arange(len(records)).repeat_interleave(num)
    ids = list(range(len(records) * num))  # = p * num + j
    x_T = candidate_noise(ids, latent_shape, seed, -1)
    finals = []
    for start in range(0, len(ids), batch_size):
        rows = prompt_idx[start:start + batch_size]
        finals.append(generate(model.adapter, cond.index(rows), x_T[start:start + batch_size].to(device), sigmas,
                               g).cpu())
    return decode_media(model.adapter, torch.cat(finals).to(device), batch_size).float().cpu()


def run_sample(source: str | Path, out: str | Path, *, prompts: Sequence[str] = (),
               prompt_file: str | Path | None = None, num: int = 1, seed: int = 0, guidance: float | None = None,
               steps: int | None = None, device: str | None = None, base: str | None = None,
               batch_size: int = 8) -> SampleResult:
    """Load ``source`` (:func:`load_for_sampling`), sample (:func:`sample`) and write the PNGs.

    Writes ``<out stem>_<i>.png`` per image beside ``out`` (``i = p * num + j``), the labelled grid ``out`` (one
    row per prompt, the prompt under each image) and ``<out stem>.json`` (source, settings, the file and prompt of
    every image).

    Raises:
        UserError: as :func:`load_for_sampling`, :func:`read_prompts` and :func:`sample`; ``out`` not a ``.png``.
    """
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise UserError("--out", f"{out} is not a .png file", "name the grid e.g. grid.png")
    model = load_for_sampling(source, device=device, base=base)
    records = read_prompts(prompts, prompt_file, model.cfg.model.task)
    media = sample(model, records, num=num, seed=seed, guidance=guidance, steps=steps, batch_size=batch_size)
    tiles = [to_pil(x) for x in media]
    paths = [save_png(tile, out.with_name(f"{out.stem}_{i}.png")) for i, tile in enumerate(tiles)]
    labels = [records[i // num].prompt for i in range(len(tiles))]
    save_png(labelled_grid(tiles, labels, ncol=num if len(records) > 1 else min(num, 8)), out)
    info = {"source": model.source, "seed": seed, "num": num, "guidance_scale": model.cfg.sampler.guidance_scale
            if guidance is None else guidance, "num_steps": int(schedule(model, steps).numel() - 1),
            "images": [{"file": p.name, "prompt": lab} for p, lab in zip(paths, labels)]}
    text = json.dumps(info, indent=1) + "\n"
    atomic_write(out.with_suffix(".json"), lambda tmp: tmp.write_text(text, encoding="utf-8"))
    log.info("sampled %d image(s) from %s", len(tiles), model.source)
    return SampleResult(grid=out, images=paths, media=media)
