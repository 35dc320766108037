"""What trains in a transformer, and its frozen named copies: the parts the policy bank is built from.

The policy bank (:class:`flowforge.policy.Policy`) keeps ``live`` plus named copies (``old``, ``ref``, ``ema``) of
exactly the weights that train. ``lora.trainable`` picks one or two *parts*; each holds live and its copies of one
kind of trained weight, and the bank applies every operation to all of its parts:

=======  ===================================  ================================  ====================================
part     live                                 a named copy (``old`` / ``ema``)  evaluating a copy / ``ref``
=======  ===================================  ================================  ====================================
LoRA     peft adapter ``"default"`` on the    peft adapter ``<name>`` (frozen)  that adapter active / adapters off
         targets (fp32)                                                         (``ref`` needs no copy)
modules  the exact submodules (fp32)          deep copies of those submodules   the copies swapped into the tree
whole    the whole transformer (fp32)         a deep copy of it                 ``adapter.transformer`` replaced
=======  ===================================  ================================  ====================================

==================  ===================================
``lora.trainable``  parts
==================  ===================================
``lora``            LoRA
``full``            whole
``module``          modules
``module+lora``     modules + LoRA (disjoint, below)
==================  ===================================

Under ``module+lora`` no LoRA layer may lie inside, around or at a trained submodule
(:func:`check_disjoint`): its weight would train twice (in full and through the adapter), and the module copies would
carry LoRA layers of their own. Disjoint parts name their tensors apart: LoRA keys are ``<layer>.lora_A.weight`` /
``<layer>.lora_B.weight`` (no adapter name, :func:`flowforge.models.lora.lora_parameters`), module keys
``<path>.<state-dict key>`` of layers outside every LoRA layer.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from flowforge.models import lora as lora_lib
from flowforge.models import submodules
from flowforge.settings.sections import TRAINABLE_MODES

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (copy's tensor, live tensor)


def lora_layer_names(root: nn.Module, targets: Sequence[str]) -> list[str]:
    """Names of the modules of ``root`` that LoRA targets ``targets`` select (peft's rule for a list of targets:
    the name equals a target or ends with ``.<target>``), in module order."""
    return [name for name, _ in root.named_modules()
            if name and any(name == t or name.endswith("." + t) for t in targets)]


def check_disjoint(root: nn.Module, paths: Sequence[str], targets: Sequence[str]) -> None:
    """Check that no module LoRA targets ``targets`` select is one of the submodules ``paths``, inside one or
    around one (``module+lora``: the same weight would train twice).

    Raises:
        ValueError: one line naming the first such path and LoRA layer.
    """
    for layer in lora_layer_names(root, targets):
        for path in paths:
            if layer == path or layer.startswith(path + ".") or path.startswith(layer + "."):
                where = "is the LoRA layer" if layer == path else (
                    "contains the LoRA layer" if layer.startswith(path + ".") else "lies inside the LoRA layer")
                raise ValueError(f"lora.modules entry {path!r} {where} {layer!r} (a LoRA target): under "
                                 "lora.trainable='module+lora' its weights would train twice, in full and through "
                                 "LoRA; train submodules without LoRA targets in them (e.g. "
                                 "latent_state_rollout.transition) or narrow lora.targets")


class LoraPart:
    """LoRA adapters on ``targets`` of ``transformer`` (injected here: adapter ``"default"`` trains, fp32)."""

    def __init__(self, transformer: nn.Module, rank: int, alpha: float, targets: Sequence[str]):
        self.root, self.rank, self.alpha, self.targets = transformer, rank, alpha, list(targets)
        lora_lib.add_adapter(transformer, "default", rank, alpha, self.targets, trainable=True)
        lora_lib.set_active_adapter(transformer, "default")

    def add(self, name: str) -> None:
        if name != "ref":  # the reference is the base with the adapters off: nothing to copy
            lora_lib.add_adapter(self.root, name, self.rank, self.alpha, self.targets, trainable=False)
            lora_lib.copy_adapter(self.root, "default", name)

    def has(self, name: str) -> bool:
        return name in ("live", "ref") or name in lora_lib.adapter_names(self.root)

    def using(self, name: str):
        if name == "live":
            return contextlib.nullcontext()
        if name == "ref":
            return lora_lib.adapters_disabled(self.root)
        return lora_lib.using_adapter(self.root, name)

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        return dict(lora_lib.lora_parameters(self.root, "default" if name == "live" else name))

    def pairs(self, name: str) -> Pairs:
        live, other = self.tensors("live"), self.tensors(name)
        return [(other[k], live[k]) for k in live]


class ModulesPart:
    """Exact submodules ``paths`` of ``transformer`` trained in full (made fp32 and trainable here)."""

    def __init__(self, transformer: nn.Module, paths: Sequence[str]):
        self.root = transformer
        self.paths = submodules.check_submodules(transformer, paths)
        self.copies: dict[str, nn.ModuleList] = {}
        for path in self.paths:
            transformer.get_submodule(path).float().requires_grad_(True)

    def _live(self) -> nn.ModuleList:
        """The live trained submodules, in ``paths`` order (a view; nothing is copied)."""
        return nn.ModuleList(self.root.get_submodule(p) for p in self.paths)

    def add(self, name: str) -> None:
        self.copies[name] = copy.deepcopy(self._live()).requires_grad_(False).eval()

    def has(self, name: str) -> bool:
        return name == "live" or name in self.copies

    def using(self, name: str):
        if name == "live":
            return contextlib.nullcontext()
        return submodules.swapped_submodules(self.root, self.paths, list(self.copies[name]))

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        parts = self._live() if name == "live" else self.copies[name]
        return {f"{p}.{k}": v for p, m in zip(self.paths, parts) for k, v in m.state_dict(keep_vars=True).items()}

    def pairs(self, name: str) -> Pairs:
        return list(zip(self.copies[name].parameters(), self._live().parameters()))


class WholePart:
    """The whole ``adapter.transformer`` trained (made fp32 and trainable here); copies replace it while in use."""

    def __init__(self, adapter):
        self.adapter, self.root = adapter, adapter.transformer
        self.root.float().requires_grad_(True)
        self.copies: dict[str, nn.Module] = {}

    def add(self, name: str) -> None:
        self.copies[name] = copy.deepcopy(self.root).requires_grad_(False).eval()

    def has(self, name: str) -> bool:
        return name == "live" or name in self.copies

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[None]:
        if name == "live":
            yield
            return
        self.adapter.transformer = self.copies[name]
        try:
            yield
        finally:
            self.adapter.transformer = self.root

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        return dict((self.root if name == "live" else self.copies[name]).state_dict(keep_vars=True))

    def pairs(self, name: str) -> Pairs:
        return list(zip(self.copies[name].parameters(), self.root.parameters()))


def build_parts(adapter, mode: str, *, rank: int, alpha: float, targets: Sequence[str],
                modules: Sequence[str]) -> list:
    """Freeze ``adapter.transformer`` and build the parts of ``mode`` (module table) on it, in place.

    Raises:
        ValueError: an unknown mode; module paths that are not exact submodules
            (:func:`flowforge.models.submodules.check_submodules`); LoRA targets matching no module; under
            ``module+lora`` a LoRA layer at, inside or around a trained submodule (:func:`check_disjoint`).
    """
    transformer: nn.Module = adapter.transformer
    if mode == "full":
        transformer.requires_grad_(False)
        return [WholePart(adapter)]
    if mode not in TRAINABLE_MODES:
        raise ValueError(f"trainable mode {mode!r} is not one of {list(TRAINABLE_MODES)}")
    paths = submodules.check_submodules(transformer, modules) if mode != "lora" else ()
    if mode == "module+lora":
        check_disjoint(transformer, paths, targets)
    transformer.requires_grad_(False)
    parts: list = []
    if mode != "lora":
        parts.append(ModulesPart(transformer, paths))
    if mode != "module":
        parts.append(LoraPart(transformer, rank, alpha, targets))
    return parts
