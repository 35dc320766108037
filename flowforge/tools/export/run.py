"""Export a trained run as a model other tools load: a merged diffusers transformer, or a diffusers / peft LoRA.

What and why
------------
A checkpoint (:mod:`flowforge.train.checkpoint`) stores only what flowforge needs to resume: the LoRA weights keyed
without the adapter name, and the contract ``{trainable, rank, alpha, targets, dropout}`` in ``trainer_state.json``.
Users want a model diffusers can load. :func:`export_run` writes one of two forms, for every registered family (the
table below; the family's spec, :class:`flowforge.models.family.Family`, names the pipeline and the verification
inputs) and, in the ``merged`` form, for any diffusers transformer class (a ``pkg.module:Class`` adapter's
base included: the class is read from the base's ``transformer/config.json`` ``_class_name``):

===================  ================================  =========================================================
adapter              transformer                       ``save_lora_weights`` / ``load_lora_weights`` pipeline
===================  ================================  =========================================================
``sd3``              ``SD3Transformer2DModel``         ``StableDiffusion3Pipeline``
``flux``             ``FluxTransformer2DModel``        ``FluxPipeline`` (``FluxKontextPipeline`` base: its own)
``qwen_image``       ``QwenImageTransformer2DModel``   ``QwenImagePipeline`` (an Edit base: its own)
``wan``              ``WanTransformer3DModel``         ``WanPipeline`` (``WanImageToVideoPipeline`` for an i2v base)
``flux2``            ``Flux2Transformer2DModel``       ``Flux2Pipeline`` (a Klein base: ``Flux2KleinPipeline``)
``z_image``          ``ZImageTransformer2DModel``      ``ZImagePipeline``
``ltx2``             ``LTX2VideoTransformer3DModel``   ``LTX2Pipeline``
``hunyuan_video15``  ``HunyuanVideo15Transformer3D…``  none has a LoRA loader (diffusers 0.42): the same file is
                                                       written by ``LoraBaseMixin.pack_weights`` +
                                                       ``write_lora_layers`` (what every ``save_lora_weights``
                                                       does) and loads on the transformer (below)
===================  ================================  =========================================================

A two-expert Wan 2.2 A14B base (``transformer_2/``) is written by :mod:`flowforge.tools.export.wan_experts` (both
experts, in either form). Families with a file format of their own are written by their own writer
(:data:`WRITERS`, one dispatch in :func:`export_run`): the world model (``model.adapter: world_model``) by
:mod:`flowforge.tools.export.world`, in the format ``load_world_model`` reads. Everything else below (checks, marker,
card, verification rule) is shared. A ``module`` run (``lora.trainable: module``: exact submodules fine-tuned in full)
exports ``merged`` as a full fine-tune does, and ``adapter`` as exactly its trained tensors
(:mod:`flowforge.tools.export.weights`). A ``module+lora`` run (both at once) exports for the world model only:
``merged`` with the submodules overlaid and the LoRA folded in, ``adapter`` as both files; a diffusers family's is
refused (:class:`ExportError`).

The pipeline class is the base directory's own (``model_index.json`` ``_class_name``) when it has
``save_lora_weights``, else the family's default above. All of them write the same diffusers format (keys
``transformer.<module>.lora_A.weight``, ``transformer_lora_adapter_metadata``) in diffusers 0.42.

``merged``
    The base transformer with the LoRA folded in, ``W' = W + (alpha / rank) * B A`` (diffusers
    ``ModelMixin.fuse_lora`` = peft ``LoraLayer.merge``, then ``unload_lora`` strips the peft wrappers), saved with
    ``save_pretrained`` (safetensors, fp32). A pipeline-directory base (``transformer/``, ``vae/``, text
    encoders) gives ``OUT/transformer/`` plus copies of every other component, so
    ``<Pipeline>.from_pretrained(OUT)`` works; a MiniLM demo base (``demo:base`` and what was trained from it)
    becomes a custom diffusers pipeline (``OUT/pipeline.py``, :mod:`flowforge.tools.export.card`); any other
    bare-transformer base gives a transformer directory at ``OUT``. The base's ``flowforge.json`` (its text
    encoder) is copied beside the new ``config.json``, so ``flowforge`` (``model.path=OUT``) loads it. A full
    fine-tune saves its live weights the same way (the base is needed for its config and components only).

``adapter``
    ``OUT/pytorch_lora_weights.safetensors`` written by the family pipeline's ``save_lora_weights`` (above)
    (keys ``transformer.<module>.lora_A.weight`` — peft's ``get_peft_model_state_dict`` format with diffusers'
    component prefix) with ``transformer_lora_adapter_metadata`` = the peft ``LoraConfig`` dict, stored in the
    safetensors header under ``lora_adapter_metadata``. diffusers rebuilds the ``LoraConfig`` from that metadata
    (``load_lora_adapter`` → ``_create_lora_config(metadata=...)``), so ``lora_alpha`` is honoured; without it
    diffusers would assume ``alpha = rank`` and scale the update wrongly whenever ``alpha != rank``. Also
    peft's own ``OUT/adapter_model.safetensors`` (keys ``base_model.model.<module>.lora_A.weight``) and
    ``adapter_config.json`` (with ``base_model_name_or_path``): ``PeftModel.from_pretrained(transformer, OUT)``.
    Load with the pipeline's ``load_lora_weights(OUT)`` (e.g. ``FluxPipeline``) or
    ``<Transformer>.load_lora_adapter(OUT, prefix="transformer", use_safetensors=True)`` (the model-level call
    looks for ``.bin`` unless told ``use_safetensors=True`` or ``weight_name``); a family without a pipeline LoRA
    loader (HunyuanVideo 1.5) with the latter on ``pipe.transformer``, or ``PeftModel.from_pretrained(
    pipe.transformer, OUT)`` (injects the LoRA into ``pipe.transformer`` in place).

Every export writes ``OUT/flowforge_export.json`` (run, checkpoint step, weights, form, LoRA contract, base and its
sha256, the verification result, and ``files``: every file of the export), the run's ``config.yaml`` and a model
card ``README.md`` (:mod:`flowforge.tools.export.card`). No file names a path of the machine that wrote it: the base
as the user named it (hub id, ``demo:`` name, or a local directory relative to ``OUT``), the run relative to ``OUT``
(:mod:`flowforge.tools.export.portable`); a demo-style base travels inside an adapter export as ``OUT/base/``.
The marker makes ``OUT`` an export:
``overwrite=True`` replaces only a directory holding it and nothing it does not list, and deletes only the listed
files. ``OUT`` may not be, contain or lie inside a run directory, the checkpoint, the base model or the working
directory (:mod:`flowforge.tools.export.out` lists the rules). The export is assembled in a hidden sibling directory
and renamed to ``OUT`` only when complete (and verified, with ``verify=True``), so a failed export leaves ``OUT`` as
it was. Before anything is written the checkpoint's files are checked (a damaged one is named) and its tensors are
compared with the run's contract (:mod:`flowforge.tools.export.contract`).

Verification
------------
``verify=True`` reloads the export the way a user would — ``<Transformer>.from_pretrained`` (merged), or a fresh
base + ``load_lora_adapter`` from the written file (adapter) — and compares its velocity with the trained policy's
(base + peft LoRA injected by :func:`flowforge.models.lora.inject_lora` + the checkpoint weights; the full state dict
for full fine-tunes) on fixed inputs, through the family's own adapter (so packing and timestep units are the
family's): seeded latents ``x [2, *latent]`` (``[2, C, h, w]``; Wan ``[2, C, 2, h, w]``), ``sigma = [0.3, 0.8]``,
seeded conditioning shaped from the transformer config, guidance 1, all fp32. Verification needs a registered family
(a ``pkg.module:Class`` adapter exports unverified). It fails when
``max |v_export - v_trained| > tol * max(1, max |v_trained|)``:

==========  ==========  =========================================================================================
form        ``tol``     measured on the tests' tiny SD3 (rank 4, alpha 8, fp32)
==========  ==========  =========================================================================================
adapter     1e-5        0 (the same peft layers and scaling compute the same thing)
merged      1e-4        ~4e-7 abs at max |v| ~2 (``(W + s B A) x`` rounds differently from ``W x + s B (A x)``)
full        1e-5        0 (the same weights, saved and reloaded)
==========  ==========  =========================================================================================

The report also gives ``max |v_trained - v_base|`` for LoRA runs (and the world model's every run, and module
adapters), so an export that silently dropped the training (a no-op adapter) is visible; for a merged ``full`` or
``module`` fine-tune the log line says ``n/a`` and why (:func:`~flowforge.tools.export.verify.describe`). The rule
is :mod:`flowforge.tools.export.verify`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flowforge.runtime.quiet import quiet_library_fallbacks
from flowforge.tools.export import diffusers as export_diffusers, portable, world as export_world
from flowforge.tools.export import wan_experts as export_wan_experts
from flowforge.tools.export.card import write_card_and_config
from flowforge.tools.export.contract import check_contract
from flowforge.tools.export.diffusers import LORA_WEIGHT_NAME
from flowforge.tools.export.out import (EXPORT_META, ExportError, check_location, check_out, install, listed_files,
                                        work_dir)
from flowforge.tools.export.source import Source, layout, load_source, pick_checkpoint, read_run_config, resolve_base
from flowforge.tools.export.verify import TOLERANCES, ExportVerificationError, VerifyReport
from flowforge.tools.export.verify import describe as describe_verify
from flowforge.tools.export.weights import PEFT_PREFIX, PEFT_WEIGHT_NAME

log = logging.getLogger("flowforge")

FORMS = ("merged", "adapter")
WEIGHT_GROUPS = ("live", "ema", "old")
__all__ = ["EXPORT_META", "ExportError", "ExportVerificationError", "FORMS", "LORA_WEIGHT_NAME",
           "PEFT_PREFIX", "PEFT_WEIGHT_NAME", "TOLERANCES", "VerifyReport", "WRITERS", "export_run",
           "read_export_meta"]


@dataclass(frozen=True)
class Writer:
    """How one family's export is written into the work directory (``(src, work, verify) -> VerifyReport | None``
    for each form) and how its model card says to load it (``(src, form, out, work) -> str``)."""

    merged: Callable[[Source, Path, bool], VerifyReport | None]
    adapter: Callable[[Source, Path, bool], VerifyReport | None]
    snippet: Callable[[Source, str, Path, Path], str]


# ------------------------------------------------------------------------------------------------ entry point
def _load_checked(run_dir: Path, out: Path, step: int | None, base, weights: str | None,
                  overwrite: bool) -> Source:
    """The run's checkpoint and weights, after every rule for ``out`` (:func:`check_out`) and the contract
    (:func:`check_contract`) have passed; nothing is written."""
    check_location(out, {"run directory": run_dir})  # before anything is read, even a broken run's config
    cfg = read_run_config(run_dir)
    path = pick_checkpoint(run_dir, step)
    model_path = str(base if base is not None else cfg.model.path)
    base_dir = resolve_base(model_path)
    check_out(out, {"run directory": run_dir, "checkpoint": path, "base model directory": base_dir}, overwrite)
    src = load_source(run_dir, cfg, path, weights, model_path, base_dir if base_dir.exists() else None)
    transformer_dir = None
    if src.base is not None:
        try:
            transformer_dir = layout(src.base)[0]
        except ExportError:  # not a model directory: only an adapter export without --verify gets this far
            transformer_dir = None
    check_contract(src, transformer_dir)
    return src


def export_run(run_dir: str | Path, out: str | Path, *, form: str, step: int | None = None, verify: bool = False,
               base: str | Path | None = None, weights: str | None = None, overwrite: bool = False) -> Path:
    """Export run ``run_dir``'s checkpoint as ``form`` (``merged`` | ``adapter``) into ``out``.

    Args:
        run_dir: the run directory (``config.yaml`` + ``checkpoints/``).
        out: the export directory: new, empty, or (with ``overwrite``) a previous export holding nothing else; never
            a run, checkpoint, base model or working directory, nor inside or around one
            (:mod:`flowforge.tools.export.out`).
        form: ``"merged"`` (a diffusers transformer / pipeline, or a world-model directory, with the training
            folded in; the only form of a full fine-tune) or ``"adapter"`` (a diffusers + peft LoRA; a module run's
            trained tensors).
        step: checkpoint step; ``None`` = the newest committed checkpoint.
        verify: reload the export as a user would (diffusers / peft / ``load_world_model``) and compare velocities
            with the trained policy (module docstring); the report is written into ``out/flowforge_export.json``.
        base: base model directory overriding the config's ``model.path`` (``demo:`` names allowed).
        weights: which checkpoint weights: ``live``, ``ema`` or ``old`` when the run kept them; ``None`` (default):
            the ones the run's held-out evals measured, ``ema`` when the run kept an EMA (``nft.ema_decay`` /
            ``grpo.ema_decay`` > 0; flow_grpo saves and evaluates its EMA too), else ``live``. An FSDP
            run's live weights are read from the checkpoint's sharded ``dcp/`` directory in this one process.
        overwrite: replace a previous export in ``out`` (only its own files are deleted).

    Returns:
        ``out`` (complete; assembled elsewhere and renamed into place).

    Raises:
        ExportError (a ``UserError``, so a ValueError): bad ``form`` / ``weights`` / ``step``; no committed
            checkpoint; a damaged checkpoint file (named); tensors that do not match the run's contract (the first
            bad key named); unsupported model family; a base that is needed but missing (merged LoRA export, full
            or module fine-tune, verify) or differs from the trained-from base; an unsafe or occupied ``out`` (the
            base, the world model's source checkpoint included, is never written); ``form="adapter"`` for a full
            fine-tune. ``out`` is left as it was.
        ExportVerificationError: ``verify`` and the difference exceeds the tolerance (``out`` is left as it was).
    """
    with quiet_library_fallbacks():  # transformers' torchvision fallback warnings when diffusers pipelines import
        return _export_run(run_dir, out, form=form, step=step, verify=verify, base=base, weights=weights,
                           overwrite=overwrite)


def _export_run(run_dir: str | Path, out: str | Path, *, form: str, step: int | None, verify: bool,
                base: str | Path | None, weights: str | None, overwrite: bool) -> Path:
    if form not in FORMS:
        raise ExportError("--form", f"{form!r} is not an export form", f"allowed: {list(FORMS)}")
    if weights is not None and weights not in WEIGHT_GROUPS:
        raise ExportError("--weights", f"{weights!r} is not a weight group", f"allowed: {list(WEIGHT_GROUPS)}")
    run_dir, out = Path(run_dir), Path(out).expanduser()
    src = _load_checked(run_dir, out, step, base, weights, overwrite)
    chosen, weights = weights, src.weights_group
    log.info("exporting %s of %s: its %s weights%s", src.checkpoint.path.name, run_dir, weights.upper()
             if weights == "ema" else weights, " (--weights)" if chosen is not None else
             " (the ones its held-out evals measured; --weights live for the live ones)" if weights == "ema" else
             " (the run kept no EMA)")
    # every file names the base as the user did, a local one relative to OUT (no path of this machine: portable)
    src = dataclasses.replace(src, base_ref=portable.base_ref(src.model_path, src.base, out))
    writer = WAN_EXPERTS_WRITER if export_wan_experts.is_two_expert_base(src.base) else \
        WRITERS.get(src.adapter, DIFFUSERS_WRITER)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = work_dir(out)
    try:
        report = (writer.merged if form == "merged" else writer.adapter)(src, work, verify)
        if report is not None:
            log.info("export verify: %s", describe_verify(report, src.lora["trainable"]))
            if not report.passed:
                raise ExportVerificationError(
                    f"export verification failed: max |v_export - v_trained| = {report.max_abs_diff:.3g} > "
                    f"{report.tolerance:.1g} x max(1, {report.max_abs_trained:.3g}); nothing written to {out}")
        snippet = writer.snippet(src, form, out.resolve(), work)
        write_card_and_config(work, out.resolve(), read_run_config(src.run_dir), run_dir=src.run_dir.resolve(),
                              step=src.checkpoint.step, weights=weights, form=form, base_model=src.base_ref,
                              snippet=snippet)
        meta = {
            "run_dir": portable.relative_to(run_dir, out),
            "checkpoint": src.checkpoint.path.resolve().relative_to(run_dir.resolve()).as_posix(),
            "step": src.checkpoint.step, "weights": weights, "form": form, "lora": src.lora,
            "base_model": src.base_ref, "base_model_sha256": src.checkpoint.trainer_state.get("base_model_sha256"),
            "weights_sha256": _tensors_sha256(src.weights), "verify": asdict(report) if report else None,
            "files": sorted({*listed_files(work), EXPORT_META}),
        }
        (work / EXPORT_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        # again: OUT may have changed while the export ran (a file dropped in, a directory made)
        protected = {"run directory": run_dir, "checkpoint": src.checkpoint.path}
        previous = check_out(out, protected | ({"base model directory": src.base} if src.base else {}), overwrite)
        install(work, out, previous)
    finally:
        if work.exists():
            shutil.rmtree(work)
    return out


def _tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(k.encode() + b"\0" + str(t.dtype).encode() + str(tuple(t.shape)).encode() + b"\0")
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def read_export_meta(out: str | Path) -> dict:
    """``out/flowforge_export.json`` as a dict (includes the ``verify`` report when verified)."""
    return json.loads((Path(out) / EXPORT_META).read_text())


DIFFUSERS_WRITER = Writer(merged=export_diffusers.write_merged, adapter=export_diffusers.write_adapter,
                          snippet=export_diffusers.card_snippet)
"""The writer of every diffusers family (registered or ``pkg.module:Class``)."""
WAN_EXPERTS_WRITER = Writer(merged=export_wan_experts.write_merged, adapter=export_wan_experts.write_adapter,
                            snippet=export_wan_experts.loading_snippet)
"""The writer of a two-expert Wan 2.2 A14B base (both experts; :mod:`flowforge.tools.export.wan_experts`)."""
WRITERS: dict[str, Writer] = {
    "world_model": Writer(merged=export_world.write_merged, adapter=export_world.write_adapter,
                          snippet=export_world.loading_snippet),
}
"""``model.adapter`` -> the writer of a family with its own file format (every other family:
:data:`DIFFUSERS_WRITER`)."""
