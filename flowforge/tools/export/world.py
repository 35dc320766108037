"""Export of a world-model run (``model.adapter: world_model``) in the world model's own format.

The world model is not a diffusers class: its files are what
:meth:`~flowforge.models.world_model.adapter.WorldModelAdapter.save_pretrained` writes and
:func:`~flowforge.models.world_model.adapter.load_world_model` reads (``config.json`` with ``_class_name =
"FlowforgeWorldModel"``, ``diffusion_pytorch_model.safetensors``, ``flowforge.json`` with the action names).
:func:`flowforge.tools.export.export_run` calls :func:`write_merged` / :func:`write_adapter` for this family
(everything else of an export -- the checks, the marker, the card, the hidden work directory -- is shared):

===========  =========================  ===========================================================================
form         trainable                  what is written
===========  =========================  ===========================================================================
``merged``   ``module`` / ``full``      the base with the checkpoint's tensors overlaid, in the own format
``merged``   ``lora``                   the base with the LoRA folded in, ``W' = W + (alpha / rank) B A``
                                        (:func:`flowforge.models.lora.merge_lora`), in the own format
``adapter``  ``module``                 ``trained_modules.safetensors`` + ``.json``: exactly the trained tensors
                                        (:mod:`flowforge.tools.export.weights`)
``adapter``  ``lora``                   peft's ``adapter_model.safetensors`` + ``adapter_config.json`` (the
                                        coupling attention's q / k / v / out): ``PeftModel.from_pretrained(
                                        load_world_model(BASE).transformer, OUT)``
``merged``   ``module+lora``            the base with the submodules' tensors overlaid and the LoRA folded in
``adapter``  ``module+lora``            both: ``trained_modules.*`` (the submodules) and peft's files (the LoRA);
                                        load the modules (``load_state_dict(..., strict=False)``), then peft
===========  =========================  ===========================================================================

A merged export is a world-model directory: ``model.path=OUT`` with ``model.adapter: world_model`` loads it in
``flowforge train`` / ``flowforge sample``. The base (the source checkpoint) is only read: ``OUT`` may not overlap it
(:mod:`flowforge.tools.export.out`), and ``save_pretrained`` refuses a directory overlapping its source again.

Verification: seeded ``x [2, C, F, H, W]`` (``C = in_channels``, ``F = max_frames``, ``H = W = sample_size`` of
the network's config), ``sigma = [0.3, 0.8]``, one-hot actions ``[2, F, A]`` as ``cond.prompt_embeds`` and a seeded
first frame ``cond.image [2, C, 1, H, W]``, guidance 1, fp32, through
:meth:`~flowforge.models.world_model.adapter.WorldModelAdapter.velocity` (0 on slot 0). Tolerances are
:data:`flowforge.tools.export.verify.TOLERANCES`: ``merged`` for a folded LoRA (``module+lora`` included), ``full``
for module / full runs (bit-equal expected), ``adapter`` for the peft adapter (with or without the module file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from flowforge.models import lora as lora_lib
from flowforge.models.base import Conditioning
from flowforge.demo.paths import is_demo_name
from flowforge.models.world_model.adapter import PROVENANCE_NAME, WorldModelAdapter, load_world_model
from flowforge.models.world_model.network import WorldModel
from flowforge.runtime.errors import one_line
from flowforge.tools.export.card import OUT_LINE
from flowforge.tools.export.out import ExportError
from flowforge.tools.export.source import Source, base_name, require_base
from flowforge.tools.export.verify import VerifyReport, verify_report
from flowforge.tools.export.weights import (MODULES_WEIGHT_NAME, PEFT_WEIGHT_NAME, apply_trained, overlay,
                                            read_trained_modules, split_module_lora, write_module_adapter,
                                            write_peft_adapter, write_trained_modules)

Probe = tuple[torch.Tensor, torch.Tensor, Conditioning]


def _load(base: Path) -> WorldModelAdapter:
    """The world model in ``base`` in fp32, read-only with provenance (:func:`load_world_model`)."""
    try:
        adapter = load_world_model(base, dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as exc:  # ProvenanceError is a ValueError
        raise ExportError(base, f"cannot be loaded as a world model ({type(exc).__name__}: "
                          f"{one_line(str(exc))[:300]})", "pass the trained-from base with --base PATH") from exc
    adapter.transformer.requires_grad_(False)
    return adapter


def probe_inputs(model: WorldModel) -> Probe:
    """Fixed fp32 inputs from ``model.config`` (module docstring): ``(x [2, C, F, H, W], sigma [2], cond)``."""
    c = model.config
    gen = torch.Generator().manual_seed(20240601)
    x = torch.randn(2, c.in_channels, c.max_frames, c.sample_size, c.sample_size, generator=gen)
    actions = torch.randint(0, c.num_actions, (2, c.max_frames), generator=gen)
    first = torch.rand(2, c.in_channels, 1, c.sample_size, c.sample_size, generator=gen) * 2 - 1
    cond = Conditioning(prompt_embeds=torch.nn.functional.one_hot(actions, c.num_actions).float(),
                        mask=torch.ones(2, c.max_frames, dtype=torch.long), image=first)
    return x, torch.tensor([0.3, 0.8]), cond


@torch.no_grad()
def velocity(model: WorldModel, inputs: Probe) -> torch.Tensor:
    """The world model's velocity ``[2, C, F, H, W]`` fp32 on ``inputs`` (guidance 1)."""
    x, sigma, cond = inputs
    names = [f"A{i}" for i in range(model.config.num_actions)]  # the velocity reads ids only
    return WorldModelAdapter(model.eval(), action_names=names).velocity(x, sigma, cond, 1.0)


def _apply(src: Source, model: WorldModel) -> None:
    """The checkpoint's weights into ``model`` (:func:`~flowforge.tools.export.weights.apply_trained`), for eval."""
    apply_trained(src, model)
    model.requires_grad_(False).eval()


def write_merged(src: Source, work: Path, verify: bool) -> VerifyReport | None:
    """The trained world model in its own format into ``work`` (module table); the verify report or None."""
    adapter = _load(require_base(src, "a merged export"))
    model = adapter.transformer
    inputs = probe_inputs(model) if verify else None
    v_base = velocity(model, inputs) if verify else None
    _apply(src, model)
    v_trained = velocity(model, inputs) if verify else None
    lora = src.lora["trainable"] in ("lora", "module+lora")
    if lora:
        lora_lib.merge_lora(model)
    adapter.save_pretrained(work)  # refuses a directory overlapping the source checkpoint
    _portable_provenance(work, src)
    del adapter, model
    if not verify:
        return None
    reloaded = load_world_model(work, dtype=torch.float32).transformer
    return verify_report(velocity(reloaded, inputs), v_trained, float((v_trained - v_base).abs().max()),
                         "merged" if lora else "full")


def write_adapter(src: Source, work: Path, verify: bool) -> VerifyReport | None:
    """Exactly the trained tensors of a module, LoRA or module+lora world-model run into ``work`` (module table).

    Raises:
        ExportError: a full fine-tune (it has no adapter); ``verify`` without the base.
    """
    trainable = src.lora["trainable"]
    if trainable == "full":
        raise ExportError("--form adapter", "this run fine-tuned the whole world model (lora.trainable='full'), so "
                          "it has no adapter", "export it with --form merged")
    if trainable == "module":
        base = require_base(src, "verifying an adapter export") if verify else None
        return write_module_adapter(src, work, verify, base_name=base_name(src),
                                    load_base=(lambda: _load(base).transformer) if verify else None,
                                    velocity=lambda m: velocity(m, probe_inputs(m)))
    modules, lora = split_module_lora(src) if trainable == "module+lora" else (None, src)
    if modules is not None:
        write_trained_modules(modules, work, base_name(src))
    write_peft_adapter(lora, work, base_name(src))
    if not verify:
        return None
    base = require_base(src, "verifying an adapter export")
    model = _load(base).transformer
    inputs = probe_inputs(model)
    v_base = velocity(model, inputs)
    _apply(src, model)
    v_trained = velocity(model, inputs)
    del model
    from peft import PeftModel

    fresh = _load(base).transformer
    if modules is not None:
        overlay(fresh, read_trained_modules(work))  # the written module file, as a user loads it
    PeftModel.from_pretrained(fresh, str(work))  # peft injects the adapter into ``fresh`` in place
    return verify_report(velocity(fresh, inputs), v_trained, float((v_trained - v_base).abs().max()), "adapter")


def _portable_provenance(work: Path, src: Source) -> None:
    """``work/source_provenance.json`` with every source path (this machine's realpath of the base's weights file)
    named as the export names the base (``demo:world/diffusion_pytorch_model.safetensors``, or relative to the
    export): an export carries no path of the machine that wrote it (:mod:`flowforge.tools.export.portable`)."""
    path = work / PROVENANCE_NAME
    if not path.is_file():
        return
    record = json.loads(path.read_text())
    named: dict[str, str] = {}
    for source in record.get("sources", []):
        for key in ("path", "realpath"):
            if isinstance(source.get(key), str):
                named[source[key]] = f"{base_name(src)}/{Path(source[key]).name}"
                source[key] = named[source[key]]
    for row in record.get("tensors", []):
        if isinstance(row.get("source"), str):
            row["source"] = named.get(row["source"], f"{base_name(src)}/{Path(row['source']).name}")
    path.write_text(json.dumps(record, indent=1) + "\n")


def loading_snippet(src: Source, form: str, out: Path, work: Path) -> str:
    """The Python that loads this export (``work`` holds it before it is renamed to ``out``), every path relative to
    the export directory ``out`` (which the snippet does not name) and the base as the export names it."""
    base = base_name(src)
    head = ("import os\n\nfrom flowforge.demo.paths import resolve_demo_path\n"
            "from flowforge.models.world_model import load_world_model\n\n" + OUT_LINE)
    if is_demo_name(base):
        base_line = f"base = resolve_demo_path({base!r})\n"
    elif os.path.isabs(base) or not base.startswith(".."):
        base_line = f"base = {base!r}\n"
    else:
        base_line = f"base = os.path.join(out, {base!r})  # the base world model, relative to this export\n"
    weights = f"os.path.join(out, {MODULES_WEIGHT_NAME!r})"
    if form == "merged":
        return head + ("model = load_world_model(out)  # WorldModelAdapter: encode / velocity / decode; "
                       ".transformer is the network\n")
    if (work / MODULES_WEIGHT_NAME).is_file() and (work / PEFT_WEIGHT_NAME).is_file():  # module+lora
        return head + ("from peft import PeftModel\nfrom safetensors.torch import load_file\n\n" + base_line
                       + "model = load_world_model(base)\n"
                       f"model.transformer.load_state_dict(load_file({weights}), strict=False)  # exactly the "
                       "trained submodules\n"
                       f"PeftModel.from_pretrained(model.transformer, out)  # {PEFT_WEIGHT_NAME}: LoRA in place\n")
    if (work / MODULES_WEIGHT_NAME).is_file():
        return head + ("from safetensors.torch import load_file\n\n" + base_line
                       + "model = load_world_model(base)\n"
                       f"model.transformer.load_state_dict(load_file({weights}), strict=False)  # exactly the "
                       "trained submodules\n")
    return head + ("from peft import PeftModel\n\n" + base_line
                   + "model = load_world_model(base)\n"
                   f"PeftModel.from_pretrained(model.transformer, out)  # {PEFT_WEIGHT_NAME}: LoRA in place\n")
