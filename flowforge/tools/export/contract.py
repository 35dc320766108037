"""The check that a checkpoint's tensors are the ones its run's contract says they are, before anything is exported.

The contract (``trainer_state.json`` ``"lora"``) fixes which tensors a checkpoint holds:

=============  =========================================================================================
trainable      tensors (keys as the policy bank, :class:`flowforge.policy.Policy`, writes them)
=============  =========================================================================================
``lora``       ``<module>.lora_A.weight`` ``[rank, in]`` and ``<module>.lora_B.weight`` ``[out, rank]`` for
               every module of the base transformer matching a target (peft's rule: the name equals the
               target or ends with ``.<target>``)
``module``     the state-dict entries of exactly the submodules ``modules`` (exact paths), under their full
               names (``latent_state_rollout.transition.delta.weight``); every parameter of them, buffers optional
``full``       the base transformer's state-dict keys and shapes (every parameter; buffers optional)
``module+      both: the ``module`` entries of ``modules`` and the ``lora`` weights of ``targets`` (a key
lora``         under a trained submodule's path is a module entry, every other key a LoRA weight)
=============  =========================================================================================

:func:`check_contract` compares them with the base transformer built on the ``meta`` device from its
``config.json`` (no weights are read; :func:`meta_model`: a diffusers class named by ``_class_name``, or the world
model's own ``FlowforgeWorldModel``), or, without a local base, checks the LoRA keys' form, targets, ranks and
A / B pairs. The first key that does not fit is named.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from torch import nn

from flowforge.runtime.errors import one_line
from flowforge.tools.export.out import ExportError
from flowforge.tools.export.source import Source, _as_export_error, transformer_class

_LORA_KEY = re.compile(r"(.+)\.(lora_A|lora_B)\.weight")


def meta_model(transformer_dir: Path) -> nn.Module:
    """The model of ``transformer_dir/config.json`` built on the ``meta`` device (shapes only, nothing read but the
    config): the world model for ``_class_name = "FlowforgeWorldModel"``, else the diffusers class it names.

    Raises:
        ExportError: the config cannot be read, names no known class, or does not build.
    """
    from flowforge.models.world_model.adapter import CLASS_NAME as WORLD_CLASS

    config_file = transformer_dir / "config.json"
    try:
        raw = json.loads(config_file.read_text())
        name = raw.get("_class_name")
    except (OSError, ValueError, AttributeError) as exc:
        raise _as_export_error(config_file, exc, "restore the base model's config.json") from exc
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        if name == WORLD_CLASS:
            from flowforge.models.world_model.config import WorldModelConfig
            from flowforge.models.world_model.network import WorldModel

            try:
                return WorldModel(WorldModelConfig.from_dict(raw))
            except (TypeError, ValueError) as exc:
                raise ExportError(config_file, f"is not a valid world-model config ({one_line(str(exc))})",
                                  "restore the base model's config.json") from exc
        cls = transformer_class(transformer_dir)
        return cls.from_config(cls.load_config(str(transformer_dir)))


def _expected_tensors(transformer_dir: Path, lora: dict) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """``(key -> shape the contract allows, keys it requires)`` from the base transformer built on ``meta`` (both
    experts of a two-expert Wan base, keys ``transformer.`` / ``transformer_2.``)."""
    from flowforge.tools.export.wan_experts import is_two_expert_base, meta_experts

    two = transformer_dir.name == "transformer" and is_two_expert_base(transformer_dir.parent)
    model = meta_experts(transformer_dir.parent) if two else meta_model(transformer_dir)
    if lora["trainable"] == "module+lora":  # the submodules' entries first: LoRA injection renames no key of theirs
        module_shapes, module_required = _expected_of(model, {**lora, "trainable": "module"}, transformer_dir)
        lora_shapes, lora_required = _expected_of(model, {**lora, "trainable": "lora"}, transformer_dir)
        return {**module_shapes, **lora_shapes}, module_required | lora_required
    return _expected_of(model, lora, transformer_dir)


def _expected_of(model: nn.Module, lora: dict, transformer_dir: Path) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """:func:`_expected_tensors` of one contract kind (``full`` | ``module`` | ``lora``) on ``model``."""
    from flowforge.models import lora as lora_lib
    from flowforge.models.submodules import check_submodules

    if lora["trainable"] == "full":
        return ({k: tuple(v.shape) for k, v in model.state_dict().items()},
                {name for name, _ in model.named_parameters()})
    if lora["trainable"] == "module":
        try:
            paths = check_submodules(model, list(lora["modules"]))
        except ValueError as exc:
            raise ExportError(transformer_dir, f"does not fit the run's module contract ({one_line(str(exc))})",
                              "pass the base the run was trained from with --base PATH") from exc
        parts = {p: model.get_submodule(p) for p in paths}
        return ({f"{p}.{k}": tuple(v.shape) for p, m in parts.items() for k, v in m.state_dict().items()},
                {f"{p}.{k}" for p, m in parts.items() for k, _ in m.named_parameters()})
    try:
        lora_lib.inject_lora(model, int(lora["rank"]), float(lora["alpha"]), list(lora["targets"]))
    except ValueError as exc:
        raise ExportError(transformer_dir, f"does not fit the run's LoRA contract ({one_line(str(exc))})",
                          "pass the base the run was trained from with --base PATH") from exc
    params = lora_lib.lora_parameters(model, "default")
    return {k: tuple(p.shape) for k, p in params.items()}, set(params)


def _lora_form_problem(key: str, value: torch.Tensor, lora: dict) -> str | None:
    match = _LORA_KEY.fullmatch(key)
    if match is None:
        return "is not a LoRA weight (<module>.lora_A.weight / <module>.lora_B.weight)"
    module, kind = match.groups()
    if not any(module == t or module.endswith("." + t) for t in lora["targets"]):
        return f"is on module {module!r}, which matches none of the targets {list(lora['targets'])}"
    rank = int(lora["rank"])
    if value.dim() != 2 or value.shape[0 if kind == "lora_A" else 1] != rank:
        return f"has shape {tuple(value.shape)}, not a rank-{rank} {kind}"
    return None


def _module_form_problem(key: str, lora: dict) -> str | None:
    if not any(key.startswith(m + ".") for m in lora["modules"]):
        return f"is not in the trained submodules {list(lora['modules'])}"
    return None


def _describe(lora: dict) -> str:
    if lora["trainable"] == "full":
        return "full fine-tune"
    module = f"module fine-tune of {list(lora.get('modules') or [])}"
    if lora["trainable"] == "module":
        return module
    lora_text = f"LoRA rank {lora.get('rank')} on {list(lora.get('targets') or [])}"
    return f"{module} + {lora_text}" if lora["trainable"] == "module+lora" else lora_text


def check_contract(src: Source, transformer_dir: Path | None) -> None:
    """Check that ``src.weights`` are exactly the tensors of the run's contract (module table).

    Args:
        src: the loaded checkpoint and its weights.
        transformer_dir: the base transformer directory to build the expected keys from; ``None`` (no local base)
            checks the keys' form only (LoRA: form, targets, rank and A / B pairs; module: inside the modules;
            module+lora: a key inside the modules is a module entry, every other one must be a LoRA weight).

    Raises:
        ExportError: naming the weights file and the first key that is unexpected, missing or of the wrong shape.
    """
    def bad(key: str, problem: str) -> ExportError:
        base = f" of base {transformer_dir}" if transformer_dir is not None else ""
        return ExportError(src.weights_file, f"tensor {key!r} {problem}",
                           f"the checkpoint does not match the run's contract ({_describe(lora)}{base}): it was "
                           f"edited or belongs to another run or base; export another step with --step N or pass "
                           f"the trained-from base with --base PATH")

    lora = src.lora
    trainable = lora["trainable"]
    module_keys = ({k for k in src.weights if _module_form_problem(k, lora) is None} if trainable == "module+lora"
                   else set(src.weights) if trainable == "module" else set())
    if trainable == "module":
        for key in sorted(src.weights):
            problem = _module_form_problem(key, lora)
            if problem is not None:
                raise bad(key, problem)
    if trainable in ("lora", "module+lora"):
        pairs: dict[str, set[str]] = {}
        for key in sorted(set(src.weights) - module_keys):
            problem = _lora_form_problem(key, src.weights[key], lora)
            if problem is not None:
                raise bad(key, problem)
            module, kind = _LORA_KEY.fullmatch(key).groups()
            pairs.setdefault(module, set()).add(kind)
        for module, kinds in sorted(pairs.items()):
            if len(kinds) != 2:
                (present,) = kinds
                missing = "lora_B" if present == "lora_A" else "lora_A"
                raise bad(f"{module}.{missing}.weight", f"is missing (its {present} is present)")
    if transformer_dir is None:
        return
    shapes, required = _expected_tensors(transformer_dir, lora)
    for key in sorted(src.weights):
        if key not in shapes:
            raise bad(key, "is not in the contract")
        if tuple(src.weights[key].shape) != shapes[key]:
            raise bad(key, f"has shape {tuple(src.weights[key].shape)}, the contract's is {shapes[key]}")
    missing = sorted(required - set(src.weights))
    if missing:
        raise bad(missing[0], f"is missing ({len(missing)} contract tensors are)")
