"""LoRA adapters on a transformer via peft, and the switches the policy needs.

* **Injection** (:func:`inject_lora`): peft ``LoraConfig`` with ``lora_dropout = 0`` (the first-update ratio must be
  exactly 1) and peft's default init (``A`` Kaiming-uniform, ``B = 0``), so the output is unchanged at step 0.
  The effective update is ``W x + (alpha / rank) * B A x``. Trainable LoRA weights are kept in fp32 whatever the
  base dtype; every other parameter is frozen.
* **Reference policy** = adapters off (:func:`adapters_disabled`): the base layer alone, bit for bit.
* **Named adapters** (:func:`add_adapter`, :func:`set_active_adapter`, :func:`copy_adapter`) let a policy bank keep
  e.g. ``"default"`` (live) and ``"old"`` adapters on the same base weights and switch which one is evaluated.

peft's own ``set_adapter`` / ``enable_adapters`` also flip ``requires_grad``; the helpers here leave every
``requires_grad`` flag as it was, so *which weights train* is decided once, at injection, and never by a switch.

State dicts returned by :func:`lora_state_dict` drop the adapter name from the keys
(``blocks.0.attn.to_q.lora_A.weight``), so weights move between adapters with :func:`load_lora_state_dict`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

_LORA_PARAM_KINDS = ("lora_A", "lora_B")

JOINT_ATTENTION_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
"""LoRA targets of diffusers' joint (two-stream) attention blocks: the image stream's q / k / v / out projections and
the text stream's added ones. The SD3, FLUX.1 and Qwen-Image adapters use these; the families' LoRA recipes
(flow_grpo, Flow-Factory) name the same modules."""


def _tuner_layers(module: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def _keep_requires_grad(module: nn.Module) -> Iterator[None]:
    flags = [(p, p.requires_grad) for p in module.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def adapter_names(module: nn.Module) -> list[str]:
    """Names of the LoRA adapters present in ``module`` (sorted)."""
    names: set[str] = set()
    for layer in _tuner_layers(module):
        names.update(layer.lora_A.keys())
    return sorted(names)


def lora_parameters(module: nn.Module, adapter_name: str) -> dict[str, nn.Parameter]:
    """``{portable key: parameter}`` of adapter ``adapter_name``; the key omits the adapter name."""
    out = {}
    for name, param in module.named_parameters():
        parts = name.split(".")
        for i in range(len(parts) - 1):
            if parts[i] in _LORA_PARAM_KINDS and parts[i + 1] == adapter_name:
                out[".".join(parts[: i + 1] + parts[i + 2 :])] = param
                break
    return out


def _make_config(rank: int, alpha: float, targets: Sequence[str]):
    from peft import LoraConfig

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if not targets:
        raise ValueError("LoRA targets must name at least one module (e.g. 'attn.to_q')")
    return LoraConfig(r=int(rank), lora_alpha=float(alpha), target_modules=list(targets), lora_dropout=0.0,
                      init_lora_weights=True, bias="none")


def add_adapter(transformer: nn.Module, adapter_name: str, rank: int, alpha: float, targets: Sequence[str],
                *, trainable: bool = True) -> list[nn.Parameter]:
    """Add LoRA adapter ``adapter_name`` (fp32, output unchanged at init) to the modules matching ``targets``.

    Leaves the active adapter and every existing ``requires_grad`` flag unchanged; the new adapter's weights get
    ``requires_grad = trainable``. Returns the new adapter's parameters.

    Raises:
        ValueError: the adapter exists already; bad rank / targets; no module matches ``targets``.
    """
    from peft import inject_adapter_in_model

    if adapter_name in adapter_names(transformer):
        raise ValueError(f"LoRA adapter {adapter_name!r} already exists; present: {adapter_names(transformer)}")
    active = active_adapter(transformer) if _tuner_layers(transformer) else None
    config = _make_config(rank, alpha, targets)
    with _keep_requires_grad(transformer), warnings.catch_warnings():
        # peft warns whenever a second adapter is added; several named adapters are intended here.
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        try:
            inject_adapter_in_model(config, transformer, adapter_name=adapter_name)
        except ValueError as exc:
            raise ValueError(f"LoRA targets {list(targets)} match no module of {type(transformer).__name__}: {exc}")
    params = lora_parameters(transformer, adapter_name)
    if not params:
        raise ValueError(f"LoRA targets {list(targets)} matched no module of {type(transformer).__name__}")
    for p in params.values():
        p.data = p.data.float()
        p.requires_grad_(trainable)
    set_active_adapter(transformer, active if active is not None else adapter_name)
    return list(params.values())


def inject_lora(transformer: nn.Module, rank: int, alpha: float, targets: Sequence[str],
                adapter_name: str = "default") -> list[nn.Parameter]:
    """Freeze ``transformer`` and add the trainable LoRA adapter ``adapter_name``; make it the active one.

    After this, exactly the adapter's ``lora_A`` / ``lora_B`` weights (fp32) require grad, and the output equals
    the base output (``B = 0``). Returns those parameters.
    """
    transformer.requires_grad_(False)
    params = add_adapter(transformer, adapter_name, rank, alpha, targets, trainable=True)
    set_active_adapter(transformer, adapter_name)
    return params


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``module`` with ``requires_grad``, in ``named_parameters`` order."""
    return [p for p in module.parameters() if p.requires_grad]


def active_adapter(transformer: nn.Module) -> str:
    """Name of the active LoRA adapter. Raises ValueError when there is no LoRA layer."""
    layers = _tuner_layers(transformer)
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no LoRA layers")
    active = layers[0].active_adapters
    return active[0] if len(active) == 1 else ",".join(active)


def set_active_adapter(transformer: nn.Module, adapter_name: str) -> None:
    """Make ``adapter_name`` the adapter every LoRA layer applies. ``requires_grad`` flags are left untouched.

    Raises:
        ValueError: unknown adapter name (the allowed names are listed).
    """
    names = adapter_names(transformer)
    if adapter_name not in names:
        raise ValueError(f"unknown LoRA adapter {adapter_name!r}; present: {names}")
    with _keep_requires_grad(transformer):
        for layer in _tuner_layers(transformer):
            layer.set_adapter(adapter_name)


@contextlib.contextmanager
def using_adapter(transformer: nn.Module, adapter_name: str) -> Iterator[None]:
    """Within the context the adapter ``adapter_name`` is active; the previous one is restored afterwards."""
    previous = active_adapter(transformer)
    set_active_adapter(transformer, adapter_name)
    try:
        yield
    finally:
        set_active_adapter(transformer, previous)


@contextlib.contextmanager
def adapters_disabled(transformer: nn.Module) -> Iterator[None]:
    """Within the context every LoRA layer returns its base layer's output exactly (the reference policy).

    ``requires_grad`` flags are unchanged inside and after the context; the active adapter is kept. A module
    without LoRA layers is unaffected (the context is then a no-op).
    """
    layers = _tuner_layers(transformer)
    with _keep_requires_grad(transformer):
        with _keep_requires_grad(transformer):
            for layer in layers:
                layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)


def lora_state_dict(transformer: nn.Module, adapter_name: str = "default") -> dict[str, Tensor]:
    """Detached copies of adapter ``adapter_name``'s weights, keyed without the adapter name.

    Raises:
        ValueError: unknown adapter name.
    """
    params = lora_parameters(transformer, adapter_name)
    if not params:
        raise ValueError(f"unknown LoRA adapter {adapter_name!r}; present: {adapter_names(transformer)}")
    return {k: p.detach().clone() for k, p in params.items()}


@torch.no_grad()
def load_lora_state_dict(transformer: nn.Module, state: Mapping[str, Tensor], adapter_name: str = "default") -> None:
    """Copy ``state`` (keys as from :func:`lora_state_dict`) into adapter ``adapter_name`` in place.

    Raises:
        ValueError: unknown adapter; missing / unexpected keys; shape mismatch.
    """
    params = lora_parameters(transformer, adapter_name)
    if not params:
        raise ValueError(f"unknown LoRA adapter {adapter_name!r}; present: {adapter_names(transformer)}")
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"LoRA state dict mismatch for {adapter_name!r}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]} ({len(missing)} / {len(unexpected)} in all)")
    for key, param in params.items():
        value = state[key]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{key}: shape {tuple(value.shape)} does not match {tuple(param.shape)}")
        param.copy_(value.to(device=param.device, dtype=param.dtype))


def copy_adapter(transformer: nn.Module, source: str, target: str) -> None:
    """Copy adapter ``source``'s weights into adapter ``target`` (same targets and rank), in place."""
    load_lora_state_dict(transformer, lora_state_dict(transformer, source), target)


@torch.no_grad()
def merge_lora(transformer: nn.Module, adapter_name: str = "default") -> nn.Module:
    """Fold adapter ``adapter_name`` into the base weights, ``W' = W + (alpha / rank) * B A`` (peft
    ``LoraLayer.merge``, computed in the weight's dtype), and put every LoRA layer's base layer back in its place,
    so no peft wrapper is left (any other adapter is dropped). In place; returns ``transformer``.

    Raises:
        ValueError: ``adapter_name`` is not an adapter of ``transformer``.
    """
    names = adapter_names(transformer)
    if adapter_name not in names:
        raise ValueError(f"unknown LoRA adapter {adapter_name!r}; present: {names}")
    tuner = {id(m) for m in _tuner_layers(transformer)}
    layers = [(name, m) for name, m in transformer.named_modules() if id(m) in tuner]
    for name, layer in layers:
        layer.merge(adapter_names=[adapter_name])
        parent, _, leaf = name.rpartition(".")
        setattr(transformer.get_submodule(parent) if parent else transformer, leaf, layer.get_base_layer())
    if hasattr(transformer, "peft_config"):  # set by peft's inject_adapter_in_model
        del transformer.peft_config
    return transformer
