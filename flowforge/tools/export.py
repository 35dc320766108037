"""Export a trained run as a model other tools load: a merged diffusers transformer, or a diffusers / peft LoRA.

What and why
------------
A checkpoint (:mod:`flowforge.train.checkpoint`) stores only what flowforge needs to resume: the LoRA weights keyed without
the adapter name, and the contract ``{trainable, rank, alpha, targets, dropout}`` in ``trainer_state.json``. Users
want a model diffusers can load. :func:`export_run` writes one of two forms, for every registered family (``sd3``,
``flux``, ``qwen_image``, ``wan``; the table below) and, in the ``merged`` form, for any diffusers transformer class
(a ``pkg.module:Class`` adapter's base included: the class is read from the base's ``transformer/config.json``
``_class_name``):

==============  ===========================  =====================================================================
adapter         transformer                  ``save_lora_weights`` / ``load_lora_weights`` pipeline
==============  ===========================  =====================================================================
``sd3``         ``SD3Transformer2DModel``    ``StableDiffusion3Pipeline``
``flux``        ``FluxTransformer2DModel``   ``FluxPipeline``
``qwen_image``  ``QwenImageTransformer2D…``  ``QwenImagePipeline``
``wan``         ``WanTransformer3DModel``    ``WanPipeline`` (``WanImageToVideoPipeline`` for an i2v base)
==============  ===========================  =====================================================================

The pipeline class is the base directory's own (``model_index.json`` ``_class_name``) when it has
``save_lora_weights``, else the family's default above. All of them write the same diffusers format (keys
``transformer.<module>.lora_A.weight``, ``transformer_lora_adapter_metadata``) in diffusers 0.42.

``merged``
    The base transformer with the LoRA folded in, ``W' = W + (alpha / rank) * B A`` (diffusers
    ``ModelMixin.fuse_lora`` = peft ``LoraLayer.merge``, then ``unload_lora`` strips the peft wrappers), saved with
    ``save_pretrained`` (safetensors, fp32). A pipeline-directory base (``transformer/``, ``vae/``, text
    encoders) gives ``OUT/transformer/`` plus copies of every other component, so
    ``<Pipeline>.from_pretrained(OUT)`` works; a MiniLM demo base (``demo:base`` and what was trained from it)
    becomes a custom diffusers pipeline (``OUT/pipeline.py``, :mod:`flowforge.tools.export_card`); any other
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
    looks for ``.bin`` unless told ``use_safetensors=True`` or ``weight_name``).

Every export writes ``OUT/flowforge_export.json`` (run, checkpoint step, weights, form, LoRA contract, base path and
sha256, the verification result, and ``files``: every file of the export), the run's ``config.yaml`` and a model
card ``README.md`` (:mod:`flowforge.tools.export_card`). The marker makes ``OUT`` an export:
``overwrite=True`` replaces only a directory holding it and nothing it does not list, and deletes only the listed
files. ``OUT`` may not be, contain or lie inside a run directory, the checkpoint, the base model or the working
directory (:mod:`flowforge.tools.export_out` lists the rules). The export is assembled in a hidden sibling directory
and renamed to ``OUT`` only when complete (and verified, with ``verify=True``), so a failed export leaves ``OUT`` as
it was. Before anything is written the checkpoint's files are checked (a damaged one is named) and its tensors are
compared with the run's contract (:mod:`flowforge.tools.export_source`).

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

The report also gives ``max |v_trained - v_base|`` for LoRA runs, so an export that silently dropped the LoRA (a
no-op adapter) is visible.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from flowforge.train import checkpoint as ckpt
from flowforge.models import lora as lora_lib
from flowforge.models.base import Conditioning
from flowforge.demo.paths import DEMO_BASE, demo_base_dir
from flowforge.models.common import FLOWFORGE_META
from flowforge.runtime.errors import one_line
from flowforge.tools.export_card import (PIPELINE_FILE, is_demo_base, loading_snippet, write_card_and_config,
                                         write_demo_pipeline)
from flowforge.tools.export_out import (EXPORT_META, ExportError, check_location, check_out, install, listed_files,
                                        work_dir)
from flowforge.tools.export_source import (SUPPORTED_ADAPTERS, Source, check_contract, layout, load_source,
                                           pick_checkpoint, read_run_config, transformer_class)

log = logging.getLogger("flowforge")

FORMS = ("merged", "adapter")
WEIGHT_GROUPS = ("live", "ema", "old")
LORA_PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline", "qwen_image": "QwenImagePipeline",
                  "wan": "WanPipeline"}
"""Registered family -> the diffusers pipeline whose ``save_lora_weights`` writes its adapter export (default when the
base directory names no pipeline class of its own); its keys are ``SUPPORTED_ADAPTERS``."""
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
PEFT_WEIGHT_NAME = "adapter_model.safetensors"  # peft's own adapter file (PeftModel.save_pretrained)
PEFT_PREFIX = "base_model.model."
TOLERANCES = {"adapter": 1e-5, "merged": 1e-4, "full": 1e-5}
"""Verification tolerance relative to ``max(1, max |v_trained|)`` (see the module docstring for measurements)."""


class ExportVerificationError(RuntimeError):
    """The reloaded export's velocity differs from the trained policy's by more than the tolerance."""


@dataclass(frozen=True)
class VerifyReport:
    """Velocity comparison of a reloaded export with the trained policy on fixed inputs (fp32)."""

    max_abs_diff: float  # max |v_export - v_trained|
    max_abs_trained: float  # max |v_trained|
    base_diff: float | None  # max |v_trained - v_base| (LoRA runs): > 0 means the LoRA changes the model
    tolerance: float  # relative to max(1, max_abs_trained)
    passed: bool


# ------------------------------------------------------------------------------------------------ base
def _resolve_base(path: str | Path) -> Path:
    return demo_base_dir() if str(path) == DEMO_BASE else Path(path).expanduser()


def _require_base(src: Source, why: str) -> Path:
    if src.base is None:
        raise ExportError(
            f"base model {src.model_path!r} (model.path in {src.run_dir / 'config.yaml'}, or --base)",
            f"{why} needs the base model, but it does not exist here",
            "pass the base model directory with --base PATH (Python: export_run(..., base=PATH)); it must be the "
            "model the run was trained from (its sha256 is checked)")
    expected = src.checkpoint.trainer_state.get("base_model_sha256")
    if expected is not None:
        actual = ckpt.sha256_of_path(src.base)
        if actual != expected:
            raise ExportError(f"base model {src.base}", f"sha256 {actual[:12]}… says it is not the model the run "
                              f"was trained from (sha256 {expected[:12]}…)", "pass the original base with --base")
    return src.base


def _load_transformer(transformer_dir: Path) -> nn.Module:
    """The diffusers transformer in ``transformer_dir`` in fp32; a damaged weight file is named (diffusers' own
    message for a garbage safetensors header is "Cannot copy out of meta tensor")."""
    from safetensors import SafetensorError, safe_open

    cls = transformer_class(transformer_dir)
    for f in sorted(transformer_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as handle:
                handle.keys()
        except (OSError, SafetensorError) as exc:
            raise ExportError(f, f"cannot be read ({type(exc).__name__}: {one_line(str(exc))})",
                              "restore the base model's weights") from exc
    try:
        return cls.from_pretrained(str(transformer_dir), torch_dtype=torch.float32, local_files_only=True).eval()
    except (OSError, ValueError, RuntimeError, NotImplementedError) as exc:
        raise ExportError(transformer_dir, f"cannot be loaded as {cls.__name__} ({type(exc).__name__}: "
                          f"{one_line(str(exc))[:300]})", "restore the base model's files") from exc


def _trained_policy(src: Source, transformer_dir: Path) -> nn.Module:
    """The trained policy in fp32: base + injected LoRA + checkpoint weights (or the full fine-tuned weights).
    The weights fit (checked by :func:`~flowforge.tools.export_source.check_contract` before)."""
    transformer = _load_transformer(transformer_dir)
    if src.lora["trainable"] == "lora":
        lora_lib.inject_lora(transformer, int(src.lora["rank"]), float(src.lora["alpha"]), list(src.lora["targets"]))
        lora_lib.load_lora_state_dict(transformer, src.weights)
    else:
        # a sharded (FSDP) checkpoint holds the parameters only; buffers then come from the base
        transformer.load_state_dict({k: v.float() for k, v in src.weights.items()}, strict=False)
    return transformer.requires_grad_(False).eval()


def _peft_config(lora: dict):
    from peft import LoraConfig

    return LoraConfig(r=int(lora["rank"]), lora_alpha=float(lora["alpha"]), target_modules=list(lora["targets"]),
                      lora_dropout=0.0, bias="none", init_lora_weights=True)


# ------------------------------------------------------------------------------------------------ verification
def _probe_inputs(adapter: str, config) -> tuple[str, torch.Tensor, torch.Tensor, Conditioning]:
    """Fixed fp32 inputs from the transformer config of family ``adapter``: ``(adapter, x [2, *latent], sigma [2],
    seeded conditioning)``.

    Raises:
        ExportError: ``adapter`` is not a registered family (nothing says how to call its transformer).
    """
    if adapter not in SUPPORTED_ADAPTERS:
        raise ExportError("--verify", f"needs a registered model family, and model.adapter={adapter!r} is not one",
                          f"drop --verify to export unverified; verifiable: {list(SUPPORTED_ADAPTERS)}")
    gen = torch.Generator().manual_seed(20240601)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    if adapter == "sd3":
        patch = int(config.patch_size)
        cells = min(int(config.pos_embed_max_size or 16), int(config.sample_size) // patch, 16)
        side = max(cells, 1) * patch
        x = randn(2, int(config.in_channels), side, side)
        cond = Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                            pooled=randn(2, int(config.pooled_projection_dim)))
    elif adapter == "flux":  # unpacked latents: in_channels = 4 C (2x2 packing)
        x = randn(2, int(config.in_channels) // 4, 4, 4)
        cond = Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                            pooled=randn(2, int(config.pooled_projection_dim)))
    elif adapter == "qwen_image":
        x = randn(2, int(config.in_channels) // 4, 4, 4)
        cond = Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                            mask=torch.ones(2, 8, dtype=torch.long))
    else:  # wan: [B, C, F, H, W], H / W multiples of the spatial patch
        _, ph, pw = config.patch_size
        x = randn(2, int(config.in_channels), 2, 2 * ph, 2 * pw)
        image_dim = config.image_dim
        # With CLIP image tokens diffusers' Wan attention takes the last 512 context tokens as text (the length
        # the Wan pipelines pad to), so an image-conditioned transformer gets 512 text tokens here.
        text_len = 8 if image_dim is None else 512
        cond = Conditioning(prompt_embeds=randn(2, text_len, int(config.text_dim)),
                            pooled=None if image_dim is None else randn(2, 4 * int(image_dim)))
    return adapter, x, torch.tensor([0.3, 0.8]), cond


def _family_adapter(adapter: str, transformer: nn.Module):
    """The family's adapter around a bare ``transformer`` (no text encoder, no VAE)."""
    if adapter == "sd3":
        from flowforge.models.sd3 import SD3Adapter

        return SD3Adapter(transformer)
    if adapter == "flux":
        from flowforge.models.flux import FluxAdapter

        return FluxAdapter(transformer)
    if adapter == "qwen_image":
        from flowforge.models.qwen_image import QwenImageAdapter

        return QwenImageAdapter(transformer)
    from flowforge.models.wan import WanAdapter

    cfg = transformer.config
    return WanAdapter(transformer, task="i2v" if cfg.in_channels != cfg.out_channels else "t2v")


@torch.no_grad()
def _velocity(transformer: nn.Module, inputs) -> torch.Tensor:
    adapter, x, sigma, cond = inputs
    return _family_adapter(adapter, transformer).velocity(x, sigma, cond, 1.0)


def _report(v_export: torch.Tensor, v_trained: torch.Tensor, base_diff: float | None, tol: float) -> VerifyReport:
    diff = float((v_export - v_trained).abs().max())
    scale = float(v_trained.abs().max())
    return VerifyReport(max_abs_diff=diff, max_abs_trained=scale, base_diff=base_diff, tolerance=tol,
                        passed=bool(diff <= tol * max(1.0, scale)))


# ------------------------------------------------------------------------------------------------ writers
def _copy_components(base: Path, out: Path) -> None:
    for entry in sorted(base.iterdir()):
        if entry.name == "transformer" or entry.name.startswith("."):
            continue
        if entry.is_dir():
            shutil.copytree(entry, out / entry.name)
        else:
            shutil.copy2(entry, out / entry.name)


def _write_merged(src: Source, work: Path, verify: bool) -> VerifyReport | None:
    base = _require_base(src, "a merged export" if src.lora["trainable"] == "lora" else "exporting a full "
                         "fine-tune (for its config.json and pipeline components)")
    transformer_dir, is_pipeline = layout(base)
    policy = _trained_policy(src, transformer_dir)
    inputs = _probe_inputs(src.adapter, policy.config) if verify else None
    v_trained = _velocity(policy, inputs) if verify else None
    base_diff = None
    if src.lora["trainable"] == "lora":
        if verify:
            with lora_lib.adapters_disabled(policy):
                base_diff = float((_velocity(policy, inputs) - v_trained).abs().max())
        policy.fuse_lora(lora_scale=1.0, safe_fusing=True, adapter_names=["default"])
        policy.unload_lora()
    demo = not is_pipeline and is_demo_base(transformer_dir, src.adapter)  # becomes a custom diffusers pipeline
    out_transformer = work / "transformer" if is_pipeline or demo else work
    out_transformer.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(str(out_transformer), safe_serialization=True)
    if (transformer_dir / FLOWFORGE_META).is_file():  # the text encoder flowforge loads the model with
        shutil.copy2(transformer_dir / FLOWFORGE_META, out_transformer / FLOWFORGE_META)
    if is_pipeline:
        _copy_components(base, work)
    elif demo:
        write_demo_pipeline(work, transformer_dir, read_run_config(src.run_dir))
    del policy
    if not verify:
        return None
    reloaded = _load_transformer(out_transformer)
    kind = "merged" if src.lora["trainable"] == "lora" else "full"
    return _report(_velocity(reloaded, inputs), v_trained, base_diff, TOLERANCES[kind])


def _lora_pipeline(src: Source):
    """The diffusers pipeline class whose ``save_lora_weights`` writes this run's adapter: the base directory's own
    (``model_index.json`` ``_class_name``) when it has one, else the family's (:data:`LORA_PIPELINES`)."""
    import diffusers

    name = None
    if src.base is not None and (src.base / "model_index.json").is_file():
        index = src.base / "model_index.json"
        try:
            name = json.loads(index.read_text()).get("_class_name")
        except (OSError, ValueError, AttributeError) as exc:
            raise ExportError(index, f"cannot be read as a diffusers model index ({type(exc).__name__})",
                              "restore the base model's model_index.json") from exc
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if cls is not None and hasattr(cls, "save_lora_weights"):
        return cls
    if src.adapter in LORA_PIPELINES:
        return getattr(diffusers, LORA_PIPELINES[src.adapter])
    raise ExportError(f"model.adapter={src.adapter!r}", "no diffusers pipeline with save_lora_weights is known for "
                      f"it (base model_index.json names {name!r})", "export it with --form merged")


def _write_adapter(src: Source, work: Path, verify: bool) -> VerifyReport | None:
    if src.lora["trainable"] != "lora":
        raise ExportError("--form adapter", "this run fine-tuned the full transformer (lora.trainable='full'), so "
                          "it has no adapter", "export it with --form merged")
    peft_cfg = _peft_config(src.lora)
    # flowforge's checkpoint keys drop the adapter name exactly as peft's get_peft_model_state_dict does
    layers = {k: v.detach().float().contiguous() for k, v in sorted(src.weights.items())}
    _lora_pipeline(src).save_lora_weights(str(work), transformer_lora_layers=layers,
                                               transformer_lora_adapter_metadata=peft_cfg.to_dict(),
                                               weight_name=LORA_WEIGHT_NAME, safe_serialization=True)
    from safetensors.torch import save_file

    # peft's own layout, so PeftModel.from_pretrained(transformer, OUT) loads it without diffusers' loader
    save_file({PEFT_PREFIX + k: v for k, v in layers.items()}, str(work / PEFT_WEIGHT_NAME), metadata={"format": "pt"})
    peft_cfg.base_model_name_or_path = _base_name(src)
    peft_cfg.save_pretrained(str(work))
    if not verify:
        return None
    transformer_dir, _ = layout(_require_base(src, "verifying an adapter export"))
    policy = _trained_policy(src, transformer_dir)
    inputs = _probe_inputs(src.adapter, policy.config)
    v_trained = _velocity(policy, inputs)
    with lora_lib.adapters_disabled(policy):
        base_diff = float((_velocity(policy, inputs) - v_trained).abs().max())
    del policy
    fresh = _load_transformer(transformer_dir)
    fresh.load_lora_adapter(str(work), prefix="transformer", weight_name=LORA_WEIGHT_NAME, adapter_name="export")
    return _report(_velocity(fresh.eval(), inputs), v_trained, base_diff, TOLERANCES["adapter"])


# ------------------------------------------------------------------------------------------------ entry point
def _load_checked(run_dir: Path, out: Path, step: int | None, base, weights: str, overwrite: bool) -> Source:
    """The run's checkpoint and weights, after every rule for ``out`` (:func:`check_out`) and the contract
    (:func:`check_contract`) have passed; nothing is written."""
    check_location(out, {"run directory": run_dir})  # before anything is read, even a broken run's config
    cfg = read_run_config(run_dir)
    path = pick_checkpoint(run_dir, step)
    model_path = str(base if base is not None else cfg.model.path)
    base_dir = _resolve_base(model_path)
    check_out(out, {"run directory": run_dir, "checkpoint": path, "base model directory": base_dir}, overwrite)
    src = load_source(run_dir, cfg, path, weights, model_path, base_dir if base_dir.exists() else None)
    transformer_dir = None
    if src.base is not None:
        try:
            transformer_dir = layout(src.base)[0]
        except ExportError:  # not a diffusers directory: only an adapter export without --verify gets this far
            transformer_dir = None
    check_contract(src, transformer_dir)
    return src


def export_run(run_dir: str | Path, out: str | Path, *, form: str, step: int | None = None, verify: bool = False,
               base: str | Path | None = None, weights: str = "live", overwrite: bool = False) -> Path:
    """Export run ``run_dir``'s checkpoint as ``form`` (``merged`` | ``adapter``) into ``out``.

    Args:
        run_dir: the run directory (``config.yaml`` + ``checkpoints/``).
        out: the export directory: new, empty, or (with ``overwrite``) a previous export holding nothing else; never
            a run, checkpoint, base model or working directory, nor inside or around one
            (:mod:`flowforge.tools.export_out`).
        form: ``"merged"`` (a diffusers transformer / pipeline with the LoRA folded in; the only form of a full
            fine-tune) or ``"adapter"`` (a diffusers + peft LoRA).
        step: checkpoint step; ``None`` = the newest committed checkpoint.
        verify: reload the export through diffusers and compare velocities with the trained policy (module
            docstring); the report is written into ``out/flowforge_export.json``.
        base: base model directory overriding the config's ``model.path`` (``"demo:base"`` allowed).
        weights: which checkpoint weights: ``live`` (default), ``ema`` or ``old`` when the run kept them. An FSDP
            run's live weights are read from the checkpoint's sharded ``dcp/`` directory in this one process.
        overwrite: replace a previous export in ``out`` (only its own files are deleted).

    Returns:
        ``out`` (complete; assembled elsewhere and renamed into place).

    Raises:
        ExportError (a ``UserError``, so a ValueError): bad ``form`` / ``weights`` / ``step``; no committed
            checkpoint; a damaged checkpoint file (named); tensors that do not match the run's contract (the first
            bad key named); unsupported model family; a base that is needed but missing (merged LoRA export, full
            fine-tune, verify) or differs from the trained-from base; an unsafe or occupied ``out``;
            ``form="adapter"`` for a full fine-tune. ``out`` is left as it was.
        ExportVerificationError: ``verify`` and the difference exceeds the tolerance (``out`` is left as it was).
    """
    if form not in FORMS:
        raise ExportError("--form", f"{form!r} is not an export form", f"allowed: {list(FORMS)}")
    if weights not in WEIGHT_GROUPS:
        raise ExportError("--weights", f"{weights!r} is not a weight group", f"allowed: {list(WEIGHT_GROUPS)}")
    run_dir, out = Path(run_dir), Path(out).expanduser()
    src = _load_checked(run_dir, out, step, base, weights, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = work_dir(out)
    try:
        report = (_write_merged if form == "merged" else _write_adapter)(src, work, verify)
        if report is not None:
            log.info("export verify: max |v_export - v_trained| = %.3g (tolerance %.1g x max(1, %.3g)); "
                     "max |v_trained - v_base| = %s", report.max_abs_diff, report.tolerance,
                     report.max_abs_trained, "n/a" if report.base_diff is None else f"{report.base_diff:.3g}")
            if not report.passed:
                raise ExportVerificationError(
                    f"export verification failed: max |v_export - v_trained| = {report.max_abs_diff:.3g} > "
                    f"{report.tolerance:.1g} x max(1, {report.max_abs_trained:.3g}); nothing written to {out}")
        _write_card(src, work, out, form, weights)
        meta = {
            "run_dir": str(run_dir.resolve()), "checkpoint": str(src.checkpoint.path.resolve()),
            "step": src.checkpoint.step, "weights": weights, "form": form, "lora": src.lora,
            "base_model": src.model_path, "base_model_sha256": src.checkpoint.trainer_state.get("base_model_sha256"),
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


def _base_name(src: Source) -> str:
    """The base as a user names it: its local directory (a ``demo:`` name resolved), else ``model.path``."""
    return str(src.base.resolve()) if src.base is not None else src.model_path


def _write_card(src: Source, work: Path, out: Path, form: str, weights: str) -> None:
    """``config.yaml`` and the model card ``README.md`` (:mod:`flowforge.tools.export_card`) into ``work``."""
    cls_name, base_transformer = "SD3Transformer2DModel", _base_name(src)
    if src.base is not None:
        try:
            transformer_dir = layout(src.base)[0]
            cls_name, base_transformer = transformer_class(transformer_dir).__name__, str(transformer_dir.resolve())
        except ExportError:
            pass
    pipeline = None
    if form == "adapter":
        try:
            pipeline = _lora_pipeline(src).__name__
        except ExportError:
            pipeline = None
    elif (work / "model_index.json").is_file():
        name = json.loads((work / "model_index.json").read_text()).get("_class_name")
        pipeline = name if isinstance(name, str) else None
    kind = ("demo" if (work / PIPELINE_FILE).is_file() else "pipeline" if (work / "model_index.json").is_file()
            else "transformer")
    snippet = loading_snippet(form, out.resolve(), transformer_class=cls_name, base_transformer=base_transformer,
                              pipeline=pipeline, layout_kind=kind)
    write_card_and_config(work, out.resolve(), read_run_config(src.run_dir), run_dir=src.run_dir.resolve(),
                          step=src.checkpoint.step, weights=weights, form=form, base_model=src.model_path,
                          snippet=snippet)


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
