"""Generate images with a trained run or an export: ``flowforge sample RUN_OR_EXPORT --prompt "..." --out grid.png``.

What is loaded
--------------
================================  ==================================================================================
source                            model
================================  ==================================================================================
a run directory (``config.yaml``  the base (``model.path`` of the run's config, or ``base``) with the newest
+ ``checkpoints/``)               committed checkpoint's weights that its evals measured (``ema`` when the run kept an
                                  EMA, else ``live``, as ``export`` picks them): the LoRA injected as the trainer does
                                  (:func:`flowforge.models.lora.inject_lora`), or the full fine-tuned state dict
a ``merged`` export               the export directory itself (a diffusers transformer or pipeline directory)
an ``adapter`` export             the base (the export's ``base_model``, or ``base``) with the exported LoRA
a base model: ``demo:base``,      the base as it is, untrained: a shipped base with the settings its examples train
``demo:world``, or a model        it with (:data:`~flowforge.tools.sample.load.DEMO_BASES`); any other model
directory / Hub id + ``config``   directory or Hub id with ``config``'s (a training config: model and sampler
                                  sections, ``model.path`` replaced by the base)
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
``guidance`` override those two. CFG's unconditional branch encodes ``sampler.negative_prompt`` (or
``negative_prompt``), set on the adapter before any prompt is encoded, as the trainer does. The initial noise of image
``j`` of prompt ``p`` (``N`` images per prompt) is :func:`flowforge.rollout.candidate_noise` of candidate id
``p * N + j`` with ``seed`` in slot ``-1``: a function of ``(seed, p, j)`` only, so a seed gives the same images on
every run, batch size and device order (and the eval prompts with ``seed = eval.seed`` and
``N = eval.samples_per_prompt`` give the eval's own noise).

Image-conditioned tasks (``i2i``, ``i2v``) need a JSONL ``prompt_file`` whose records name their image
(``metadata.image``, the training prompt schema); a packaged set (``demo:world-eval``: first frames + action
sequences for the world model) is one. A world model (``model.adapter: world_model``) samples from any of its runs
and exports: the prompt is its action sequence, the image its first frame, and each sample is a video strip.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from flowforge.data.images import condition_inputs
from flowforge.data.prompts import IMAGE_TASKS, PromptRecord, condition_images, load_prompts
from flowforge.demo.paths import is_demo_name, resolve_demo_path
from flowforge.models.base import Conditioning
from flowforge.rollout import candidate_noise, decode_media, generate, sigmas_for
from flowforge.runtime.durable import atomic_write
from flowforge.runtime.errors import UserError, file_error
from flowforge.runtime.write_guard import check_write_target
from flowforge.tools.sample.grid import labelled_grid, save_png, to_pil
from flowforge.tools.sample.load import SampleModel, load_for_sampling, source_config

__all__ = ["SampleModel", "SampleResult", "load_for_sampling", "read_prompts", "run_sample", "sample", "schedule",
           "source_config"]

log = logging.getLogger("flowforge")


@dataclass(frozen=True)
class SampleResult:
    """What :func:`run_sample` wrote."""

    grid: Path  # the labelled grid
    images: list[Path]  # one PNG per image, prompt-major: image j of prompt p is images[p * num + j]
    media: torch.Tensor  # [P * num, 3, H, W] (video [P * num, 3, F, H, W]) float32 in [0, 1]


# ------------------------------------------------------------------------------------------------ sampling
def read_prompts(prompts: Sequence[str], prompt_file: str | Path | None, task: str, *,
                 image_prompts: str | None = None) -> list[PromptRecord]:
    """``prompts`` then the prompts of ``prompt_file``: a JSONL prompt file (the training schema, ``.jsonl``, or a
    packaged set such as ``demo:world-eval``) or plain text, one prompt per non-empty line.

    Args:
        image_prompts: a prompt file that names images (the run's ``data.eval_prompts``), suggested when an image
            task's prompts name none.

    Raises:
        UserError: no prompt at all, or an image task (``i2i`` / ``i2v``) whose prompts name no image (a world
            model's first frame included).
    """
    records = [PromptRecord(p, {"task": task, "sample_id": f"prompt{i}"}) for i, p in enumerate(prompts)]
    if prompt_file is not None:
        path = Path(prompt_file)
        if is_demo_name(str(prompt_file)) or path.suffix == ".jsonl":
            records += load_prompts(str(prompt_file) if is_demo_name(str(prompt_file)) else path)
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
    if task in IMAGE_TASKS and any(not condition_images(r.metadata) for r in records):
        example = f" (e.g. this run's eval prompts: --prompt-file {image_prompts})" if image_prompts else ""
        raise UserError("--prompt", f"model.task={task!r} needs a condition image per prompt (--prompt gives none)",
                        f"give a .jsonl --prompt-file whose records name metadata.image{example}")
    return records


MAX_IMAGES = 4096
"""Most images (prompts x ``num``) one ``sample`` call makes: every one is held in memory until the grid is drawn."""
MAX_PIXELS = 2**28
"""Most output pixels (images x frames x H x W) of one call: 256 Mi pixels, 3 GiB as float32 RGB."""


def check_budget(n_prompts: int, num: int, height: int, width: int, frames: int | None) -> None:
    """Refuse, before anything is allocated, a call whose images or pixels exceed :data:`MAX_IMAGES` /
    :data:`MAX_PIXELS`.

    Raises:
        UserError: naming ``--num`` and the counts.
    """
    images = n_prompts * num
    pixels = images * max(1, frames or 1) * height * width
    if images > MAX_IMAGES or pixels > MAX_PIXELS:
        raise UserError("--num", f"{num} images for each of {n_prompts} prompt(s) is {images} images of "
                        f"{max(1, frames or 1)}x{height}x{width} ({pixels} pixels), over the limit of {MAX_IMAGES} "
                        f"images and {MAX_PIXELS} pixels per call", "sample in several calls with other --seed values")


def schedule(model: SampleModel, steps: int | None) -> torch.Tensor:
    """The run's ``[T+1]`` fp32 sampling schedule with ``T = steps`` (default ``sampler.num_steps``), computed as
    the trainer does (:meth:`flowforge.train.trainer.Trainer._schedule`)."""
    s, m = model.cfg.sampler, model.cfg.model
    if steps is not None:
        s = dataclasses.replace(s, num_steps=int(steps))
    shape = tuple(model.adapter.latent_shape(m.height, m.width, m.frames))  # first, as the trainer: it may fix the
    # geometry a pipeline schedule reads (LTX-2's mu counts the video tokens of m.frames)
    if s.schedule == "dynamic" and s.mu is None:
        pipeline = model.adapter.pipeline_sigmas(s.num_steps, m.height, m.width)
        if pipeline is not None:
            return pipeline.float().cpu()
    return sigmas_for(s, shape)


def _conditioning(model: SampleModel, records: list[PromptRecord], device: torch.device) -> Conditioning:
    m = model.cfg.model
    cond = model.adapter.encode([r.prompt for r in records]).to(device)
    if m.task not in IMAGE_TASKS:
        return cond
    images = condition_inputs([condition_images(r.metadata) for r in records], m.height, m.width,
                              originals=model.adapter.takes_original_images)
    images = images.to(device) if isinstance(images, torch.Tensor) else images  # PIL: the adapter resizes them
    shape = tuple(model.adapter.latent_shape(m.height, m.width, m.frames))
    return model.adapter.condition_on_images(cond, [r.prompt for r in records], images, shape)


@torch.no_grad()
def sample(model: SampleModel, records: list[PromptRecord], *, num: int = 1, seed: int = 0,
           guidance: float | None = None, steps: int | None = None, batch_size: int = 8) -> torch.Tensor:
    """``num`` images per prompt with the ODE sampler (module docstring).

    Returns:
        ``[P * num, 3, H, W]`` (video ``[P * num, 3, F, H, W]``) float32 in [0, 1] on CPU, prompt-major.

    Raises:
        UserError: ``num``, ``steps`` or ``batch_size`` < 1; a non-finite ``guidance``; more than
            :data:`MAX_IMAGES` images or :data:`MAX_PIXELS` pixels (:func:`check_budget`), checked before the noise is
            allocated.
    """
    if num < 1 or batch_size < 1 or (steps is not None and steps < 1):
        raise UserError("--num / --steps / --batch-size", f"must be >= 1, got {num} / {steps} / {batch_size}")
    if guidance is not None and not math.isfinite(float(guidance)):
        raise UserError("--guidance", f"is {guidance}", "give a finite number")
    m = model.cfg.model
    check_budget(len(records), num, m.height, m.width, m.frames)
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


def check_sample_targets(out: Path, *, source: str | Path, prompt_file: str | Path | None = None,
                         base: str | Path | None = None, config: str | Path | None = None) -> None:
    """Refuse (before anything is loaded or written) a grid ``out`` whose files — the grid, ``<stem>.json`` and the
    per-image PNGs beside it — would land inside a run directory, a checkpoint, the sampled source, the base model
    or the prompt file (the shared rule, :func:`flowforge.runtime.write_guard.check_write_target`).

    Raises:
        UserError: naming ``--out`` and the directory that protects it.
    """
    protected = {"sampled run, export or base model": resolve_demo_path(source) if is_demo_name(source) else source,
                 "base model": base, "config file": config,
                 "prompt file": None if prompt_file is None or is_demo_name(str(prompt_file)) else prompt_file}
    for target in (out, out.with_suffix(".json"), out.with_name(f"{out.stem}_0.png")):
        check_write_target(target, "--out", protected=protected)


def run_sample(source: str | Path, out: str | Path, *, prompts: Sequence[str] = (),
               prompt_file: str | Path | None = None, num: int = 1, seed: int = 0, guidance: float | None = None,
               steps: int | None = None, device: str | None = None, base: str | None = None,
               batch_size: int = 8, config: str | Path | None = None,
               negative_prompt: str | None = None) -> SampleResult:
    """Load ``source`` (:func:`load_for_sampling`: a run, an export or a base model), sample (:func:`sample`) and
    write the PNGs. ``negative_prompt`` overrides the config's ``sampler.negative_prompt`` (CFG's unconditional
    prompt; used when the guidance scale is not 1, warned otherwise).

    Writes ``<out stem>_<i>.png`` per image beside ``out`` (``i = p * num + j``), the labelled grid ``out`` (one
    row per prompt, the prompt under each image) and ``<out stem>.json`` (source, settings, the file and prompt of
    every image).

    Raises:
        UserError: as :func:`load_for_sampling`, :func:`read_prompts` and :func:`sample`; ``out`` not a ``.png``.
    """
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise UserError("--out", f"{out} is not a .png file", "name the grid e.g. grid.png")
    cfg = source_config(source, config=config, base=base)  # the prompts are checked before any model loads
    check_sample_targets(out, source=source, prompt_file=prompt_file, base=base, config=config)
    negative = cfg.sampler.negative_prompt if negative_prompt is None else negative_prompt
    scale = cfg.sampler.guidance_scale if guidance is None else guidance
    if negative is not None and scale == 1.0:
        log.warning("negative prompt %r is not used: classifier-free guidance runs only when the guidance scale is "
                    "not 1 (--guidance)", negative)
    if num < 1:
        raise UserError("--num", f"must be >= 1, got {num}")
    records = read_prompts(prompts, prompt_file, cfg.model.task, image_prompts=cfg.data.eval_prompts)
    check_budget(len(records), num, cfg.model.height, cfg.model.width, cfg.model.frames)  # before any model loads
    model = load_for_sampling(source, device=device, base=base, config=config, negative_prompt=negative_prompt)
    media = sample(model, records, num=num, seed=seed, guidance=guidance, steps=steps, batch_size=batch_size)
    tiles = [to_pil(x) for x in media]
    paths = [save_png(tile, out.with_name(f"{out.stem}_{i}.png")) for i, tile in enumerate(tiles)]
    labels = [records[i // num].prompt for i in range(len(tiles))]
    save_png(labelled_grid(tiles, labels, ncol=num if len(records) > 1 else min(num, 8)), out)
    info = {"source": model.source, "seed": seed, "num": num, "guidance_scale": model.cfg.sampler.guidance_scale
            if guidance is None else guidance, "negative_prompt": model.cfg.sampler.negative_prompt,
            "num_steps": int(schedule(model, steps).numel() - 1),
            "images": [{"file": p.name, "prompt": lab} for p, lab in zip(paths, labels)]}
    text = json.dumps(info, indent=1) + "\n"
    atomic_write(out.with_suffix(".json"), lambda tmp: tmp.write_text(text, encoding="utf-8"))
    log.info("sampled %d image(s) from %s", len(tiles), model.source)
    return SampleResult(grid=out, images=paths, media=media)
