"""The policy bank: live, old, ref and EMA weights — four distinct things — plus the optimizer and LR schedule.

=======  ==========================================  ===================================  ======================
name     what it is                                  under LoRA                           under full fine-tune
=======  ==========================================  ===================================  ======================
live     the weights being optimized (fp32)          peft adapter ``"default"``           the transformer
old      the sampling policy of the current batch    peft adapter ``"old"`` (frozen)      a frozen copy
ref      the immutable starting point (KL terms)     adapters off                         a frozen copy
ema      optional eval EMA of live                   peft adapter ``"ema"`` (frozen)      a frozen copy
=======  ==========================================  ===================================  ======================

Under ``module`` mode (``lora.trainable: module``) live is exactly the submodules ``lora.modules`` (e.g. a world
model's transition module) and old / ref / EMA are frozen copies of those submodules only, swapped into the module
tree while they are evaluated (:mod:`flowforge.models.submodules`); the rest is one frozen backbone for all of them.
Under ``module+lora`` both train at once: live = those submodules + the ``"default"`` LoRA adapter on the targets
(which may not lie inside a trained submodule), and each other policy is the submodules' copies + its own named
adapter (``ref``: the copies + adapters off); switching swaps both, and the weights, blends, EMA and state dicts cover
both (:mod:`flowforge.models.trained_parts` holds the parts).

``old`` and ``ema`` exist only when asked for (``Policy(..., keep_old=True, ema_decay=...)``); ``ref`` under full
fine-tuning (and module modes) is copied only when asked for (``keep_ref=True``).

Soft updates toward live, ``name <- d * name + (1 - d) * live`` (:meth:`Policy.blend`), with the decay ``d`` of
:mod:`flowforge.algorithms.ema` (``n`` = optimizer steps so far, counting the one just taken):

* ``old``, after each batch, by the forward-process objectives: DiffusionNFT's ``old_policy_decay(n)`` ("linear"
  ``min(decay_rate * n, decay_max)`` or "flat_ramp"), so ``old`` tracks ``live`` exactly at first and lags more as
  training goes;
* ``ema``, after every optimizer step (:meth:`Policy.step`): ``ema_decay(n, schedule, decay)``, the constant
  ``decay`` or NVlabs' warm-up ``min((1 + n) / (10 + n), decay)`` (``ema_schedule="warmup"``).

Weights can be switched only between live forwards: :meth:`Policy.using` raises while a live forward's autograd
graph is pending (registered with :meth:`Policy.pending` and released by :meth:`Policy.backward`), because a
forward under another policy inside that window is almost always a bug (old / ref outputs must not join the live
graph).

The LR schedule is counted in optimizer steps: linear warmup over ``warmup_steps`` then constant, linear decay to 0
or cosine decay to 0 at ``total_steps``.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from flowforge.algorithms.ema import EMA_SCHEDULES, ema_decay as ema_decay_at
from flowforge.models import trained_parts
from flowforge.runtime import offload as offload_lib
from flowforge.settings.distributed import OFFLOAD_MODES
from flowforge.settings.sections import LORA_MODES, LR_SCHEDULES, TRAINABLE_MODES

POLICY_NAMES = ("live", "old", "ref", "ema")


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly FSDP-sharded) parameter; a collective under FSDP."""
    return t.full_tensor() if _is_dtensor(t) else t


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """Multiplier of the base LR after ``n`` optimizer steps (warmup, then constant / linear / cosine to 0)."""

    def f(n: int) -> float:
        if warmup_steps > 0 and n < warmup_steps:
            return (n + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (n - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"lr_schedule={schedule!r} is not one of {list(LR_SCHEDULES)}")

    return f


@dataclass(frozen=True)
class TrainableWeights:
    """Which weights of the transformer train: LoRA adapters (``mode="lora"``), every weight (``"full"``), exact
    submodules (``"module"``) or those submodules and LoRA together (``"module+lora"``)."""

    mode: str  # "lora" | "full" | "module" | "module+lora"
    rank: int  # LoRA rank r (read under "lora" / "module+lora")
    alpha: float  # LoRA alpha; the adapter's update is scaled by alpha / r (read under "lora" / "module+lora")
    targets: tuple[str, ...] | None = None  # LoRA target module names; None (or empty): adapter.lora_targets
    modules: tuple[str, ...] = ()  # "module" / "module+lora": exact submodule paths trained in full

    @classmethod
    def from_section(cls, lora) -> "TrainableWeights":
        """From a ``lora`` config section (rank 8 and alpha = rank when unset)."""
        return cls(mode=lora.trainable, rank=lora.resolved_rank, alpha=lora.resolved_alpha, targets=lora.targets,
                   modules=tuple(lora.modules or ()))


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW (decoupled weight decay), gradient-norm clipping and the LR schedule, counted in optimizer steps."""

    lr: float  # base learning rate
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    schedule: str  # "constant" | "linear" | "cosine" after warmup (see lr_lambda)
    warmup_steps: int  # linear warmup from lr / warmup_steps to lr
    grad_clip: float  # max global gradient L2 norm

    @classmethod
    def from_section(cls, train) -> "OptimizerSettings":
        """From a ``train`` config section."""
        return cls(lr=train.lr, betas=tuple(train.adam_betas), eps=train.adam_eps, weight_decay=train.weight_decay,
                   schedule=train.lr_schedule, warmup_steps=train.warmup_steps, grad_clip=train.grad_clip)


class Policy:
    """Trainable weights of ``adapter.transformer``, the other policies of the bank, and the optimizer.

    Args:
        adapter: a FlowModel; its ``transformer`` is modified in place (LoRA injected, grads enabled).
        trainable: which weights train (mode; LoRA rank, alpha, targets; the module modes' submodules).
        optim: optimizer, gradient clipping and LR schedule.
        total_optimizer_steps: length of the LR schedule.
        keep_old: build the ``old`` policy (a copy of live at the start).
        keep_ref: the reference policy is needed (full / module modes keep a frozen copy of what trains; LoRA's
            is free).
        ema_decay: > 0 builds the ``ema`` policy with this decay (the cap of the "warmup" schedule).
        ema_schedule: "constant" (``d = ema_decay``) | "warmup" (``d = min((1 + n) / (10 + n), ema_decay)`` after the
            ``n``-th optimizer step, NVlabs DiffusionNFT's eval EMA): :func:`flowforge.algorithms.ema.ema_decay`.
        wrap: makes the transformer data-parallel in place (:func:`flowforge.runtime.distributed.wrap`); called after the
            bank is built and before the optimizer collects the (possibly sharded) trainable parameters.
        offload: ``distributed.offload`` (``"none"`` | ``"optimizer"`` | ``"params"``, see
            :mod:`flowforge.runtime.offload`): other than ``"none"``, the frozen copies of full / module training
            (old, ref, EMA) live on the host and are moved to ``device`` only while :meth:`using` evaluates them;
            ``"optimizer"`` also makes the optimizer :class:`~flowforge.runtime.offload.HostOffloadAdamW`
            (``"params"``: FSDP's ``CPUOffloadPolicy``, set by ``wrap``, puts the sharded weights, gradients and
            AdamW states on the host).
        device: the compute device (where host copies go while in use); ``None``: the transformer's.

    Raises:
        ValueError: ``trainable.mode`` is not one of ``TRAINABLE_MODES``; ``ema_schedule`` not one of
            ``EMA_SCHEDULES``; module-mode paths that are not exact submodules
            (:func:`flowforge.models.submodules.check_submodules`); LoRA targets that match no module; under
            ``module+lora`` a LoRA layer at, inside or around a trained submodule
            (:func:`flowforge.models.trained_parts.check_disjoint`).
    """

    def __init__(self, adapter, trainable: TrainableWeights, optim: OptimizerSettings, total_optimizer_steps: int,
                 *, keep_old: bool = False, keep_ref: bool = False, ema_decay: float = 0.0,
                 ema_schedule: str = "constant", wrap: Callable[[], None] | None = None, offload: str = "none",
                 device: torch.device | None = None):
        if trainable.mode not in TRAINABLE_MODES:
            raise ValueError(f"trainable mode {trainable.mode!r} is not one of {list(TRAINABLE_MODES)}")
        if ema_schedule not in EMA_SCHEDULES:
            raise ValueError(f"ema_schedule={ema_schedule!r} is not one of {list(EMA_SCHEDULES)}")
        self.adapter = adapter
        transformer: nn.Module = adapter.transformer
        self.live_module = transformer
        self.lora = trainable.mode in LORA_MODES  # LoRA adapters train (alone, or beside module copies)
        self.rank, self.alpha = trainable.rank, trainable.alpha
        self.targets = list(trainable.targets or adapter.lora_targets) if self.lora else []
        # live / old / ref / EMA hold exactly what trains: LoRA adapters, exact submodules (the rest one shared
        # frozen backbone), both, or the whole transformer
        self._parts = trained_parts.build_parts(adapter, trainable.mode, rank=self.rank, alpha=self.alpha,
                                                targets=self.targets, modules=trainable.modules)
        self.modules = next((p.paths for p in self._parts if isinstance(p, trained_parts.ModulesPart)), ())
        transformer.eval()  # no dropout anywhere: rollout and replay must be the same function
        self.ema_decay, self.ema_schedule = ema_decay, ema_schedule
        if keep_old:
            self._add("old")
        if ema_decay > 0:
            self._add("ema")
        if keep_ref:
            self._add("ref")  # nothing is copied for LoRA: its reference is the base with the adapters off
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"distributed.offload={offload!r} is not one of {list(OFFLOAD_MODES)}")
        self.offload = offload
        self.device = torch.device(device) if device is not None else next(transformer.parameters()).device
        if offload != "none":  # the copies' home is the host (the memory plan's host lines); before wrap shards
            for module in self._copies.values():
                module.to(offload_lib.HOST)
        if wrap is not None:
            wrap()
        self.params = [p for p in transformer.parameters() if p.requires_grad]
        optimizer_cls = offload_lib.HostOffloadAdamW if offload == "optimizer" else torch.optim.AdamW
        self.optimizer = optimizer_cls(self.params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                           weight_decay=optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(optim.schedule, optim.warmup_steps, total_optimizer_steps))
        self.grad_clip = optim.grad_clip
        self.optim_settings = optim
        self.optimizer_steps = 0
        self._pending: weakref.ref | None = None

    # ------------------------------------------------------------------------------------------------ bank
    def _add(self, name: str) -> None:
        for part in self._parts:
            part.add(name)

    @property
    def _copies(self) -> dict[str, nn.Module]:
        """The deep copies of the module / whole-transformer part, by policy name (none under pure LoRA)."""
        return {name: m for part in self._parts for name, m in getattr(part, "copies", {}).items()}

    def has(self, name: str) -> bool:
        return all(part.has(name) for part in self._parts)

    def pending(self, live_output: torch.Tensor) -> torch.Tensor:
        """Register a live forward's output whose graph is pending until :meth:`backward`; returns it."""
        self._pending = weakref.ref(live_output) if live_output.requires_grad else None
        return live_output

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` and release the pending live graph. A loss that reaches no trainable weight (a
        two-expert Wan micro-batch all on the expert without LoRA) contributes a zero gradient: nothing to run."""
        if loss.requires_grad:
            loss.backward()
        self._pending = None

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[None]:
        """Within the context ``adapter.velocity`` evaluates policy ``name`` (``live | old | ref | ema``).

        Raises:
            ValueError: unknown name or a policy this bank does not hold.
            RuntimeError: a live forward's graph is pending (switch before the live forward, or after backward).
        """
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r}; allowed: {list(POLICY_NAMES)}")
        if not self.has(name):
            raise ValueError(f"this run keeps no {name!r} policy (kept: "
                             f"{[n for n in POLICY_NAMES if self.has(n)]})")
        if name == "live":
            yield
            return
        if self._pending is not None and self._pending() is not None:
            raise RuntimeError(f"cannot switch to the {name!r} policy while a live forward's graph is pending; "
                               "evaluate other policies before the live forward or after backward")
        with contextlib.ExitStack() as stack:
            if self.offload != "none" and name in self._copies:  # a host copy computes on the device while in use
                stack.enter_context(offload_lib.on_device(self._copies[name], self.device))
            for part in self._parts:
                stack.enter_context(part.using(name))
            yield

    def _tensors(self, name: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part in self._parts:
            out.update(part.tensors(name))  # disjoint parts: their keys never collide (trained_parts)
        return out

    def named_weights(self, name: str) -> dict[str, torch.Tensor]:
        """Detached full (unsharded) copies of policy ``name``'s own weights: LoRA weights (keys without the adapter
        name), the trained submodules' state-dict entries under full names, both (``module+lora``), or the state dict.
        Under FSDP every rank must call this (it gathers shards)."""
        return {k: _full(v).detach().clone() for k, v in self._tensors(name).items()}

    @torch.no_grad()
    def load_named_weights(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (as from :meth:`named_weights`) into policy ``name`` in place (re-sharding under FSDP).

        Raises:
            ValueError: missing / unexpected keys or shape mismatch.
        """
        target = self._tensors(name)
        missing, unexpected = sorted(set(target) - set(state)), sorted(set(state) - set(target))
        if missing or unexpected:
            raise ValueError(f"weights of policy {name!r} do not match: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]} ({len(missing)} / {len(unexpected)} in all)")
        for key, param in target.items():
            value = state[key].to(device=param.device, dtype=param.dtype)
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{name}.{key}: shape {tuple(value.shape)} does not match {tuple(param.shape)}")
            if _is_dtensor(param):
                from torch.distributed.tensor import distribute_tensor

                # this rank's shard, written into the local tensor in place: under FSDP's CPUOffloadPolicy that
                # local tensor is on the host while the mesh (where distribute_tensor puts the shard) is the device's
                value = offload_lib.local(distribute_tensor(value, param.device_mesh, param.placements))
                param = offload_lib.local(param)
            param.copy_(value)

    def _pairs(self, name: str):
        return [pair for part in self._parts for pair in part.pairs(name)]

    @torch.no_grad()
    def blend(self, name: str, decay: float) -> None:
        """``name <- decay * name + (1 - decay) * live`` in place (``name`` in old / ema)."""
        if name not in ("old", "ema"):
            raise ValueError(f"only 'old' and 'ema' are blended toward live, got {name!r}")
        for target, source in self._pairs(name):
            # under FSDP full fine-tuning live is sharded (DTensor) while the old / EMA copy made before wrapping is
            # whole on every rank: gather live (a collective; every rank blends in lockstep)
            source = source if _is_dtensor(target) else _full(source).to(target.device)  # host copies: offload
            target.mul_(decay).add_(source, alpha=1.0 - decay)

    # ------------------------------------------------------------------------------------------------ optim
    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.params)

    def step(self) -> torch.Tensor:
        """Clip gradients, take one optimizer + LR-schedule step, zero the gradients, update the EMA with
        :meth:`current_ema_decay`. Returns the pre-clip gradient norm (0-d tensor)."""
        grad_norm = _full(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        if self.ema_decay > 0:
            self.blend("ema", self.current_ema_decay())
        return grad_norm.detach()

    def current_ema_decay(self) -> float:
        """The EMA's decay after the optimizer step just taken (``n = optimizer_steps``); 0.0 without an EMA."""
        if self.ema_decay <= 0:
            return 0.0
        return ema_decay_at(self.optimizer_steps, schedule=self.ema_schedule, decay=self.ema_decay)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Shorthand for ``using("ref")`` without gradients."""
        with torch.no_grad(), self.using("ref"):
            yield

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The bank's state (``torch.distributed.checkpoint.stateful.Stateful``); every rank calls it under FSDP.

        Returns:
            ``weights``: ``{name: {key: tensor}}``, :meth:`named_weights` of each of live / old / ema held (``ref``
            is the immutable base and is never saved); ``scheduler``: the LR schedule's state dict;
            ``optimizer_steps``: int; then either ``optimizer`` (``optimizer.state_dict()``) or, when the live
            parameters are FSDP-sharded (DTensor), ``sharded``: ``{"model", "optim"}`` sharded state dicts of the
            trainable weights and the optimizer for torch.distributed.checkpoint (frozen weights left out) — live
            is then not in ``weights``.
        """
        sharded = any(_is_dtensor(p) for p in self.params)
        names = [n for n in ("live", "old", "ema") if self.has(n) and not (n == "live" and sharded)]
        state = {"weights": {name: self.named_weights(name) for name in names},
                 "scheduler": self.scheduler.state_dict(), "optimizer_steps": self.optimizer_steps}
        if sharded:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict)

            opts = StateDictOptions(ignore_frozen_params=True)
            state["sharded"] = {"model": get_model_state_dict(self.live_module, options=opts),
                                "optim": get_optimizer_state_dict(self.live_module, self.optimizer, options=opts)}
        else:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (each policy of ``weights``, ``optimizer`` and / or ``sharded``, the LR
        schedule, the optimizer-step counter).

        Raises:
            ValueError: weights that do not match a policy's (:meth:`load_named_weights`).
        """
        for name, tensors in state["weights"].items():
            self.load_named_weights(name, tensors)
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if "sharded" in state:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)

            opts = StateDictOptions(ignore_frozen_params=True, strict=False)  # frozen base weights are not saved
            set_model_state_dict(self.live_module, state["sharded"]["model"], options=opts)
            set_optimizer_state_dict(self.live_module, self.optimizer, state["sharded"]["optim"], options=opts)
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self._apply_settings()

    def _apply_settings(self) -> None:
        """Put this policy's :class:`OptimizerSettings` back over a restored state: the optimizer's state dict
        carries each param group's ``lr`` / ``betas`` / ``eps`` / ``weight_decay`` and the schedule's its base LRs, so
        a resume with another ``train.lr`` or ``train.adam_*`` (stage C's ``stages.c_overrides``, or a user's
        override) would otherwise train on with the checkpoint's, silently. The LR is the settings' base LR times the
        schedule's multiplier at its restored position (the formula of ``LambdaLR.get_lr``), so with unchanged
        settings every value is the one restored, bit for bit; the Adam moments and step counts are kept."""
        o, sched = self.optim_settings, self.scheduler
        sched.base_lrs = [o.lr] * len(self.optimizer.param_groups)
        lrs = [base * f(sched.last_epoch) for f, base in zip(sched.lr_lambdas, sched.base_lrs, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group.update(lr=lr, initial_lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        sched._last_lr = list(lrs)
