"""Host (CPU) memory for the optimizer and the frozen policy copies: ``distributed.offload``.

Two modes (:data:`flowforge.settings.distributed.OFFLOAD_MODES`; the config reference and
docs/guides/scaling.md say the same):

* ``params``: FSDP2's own ``CPUOffloadPolicy`` on every ``fully_shard`` (:func:`offload_policy`,
  :func:`flowforge.runtime.distributed.wrap`): sharded parameters, their gradients and the AdamW states live on the
  host; FSDP copies a block's shard to the device before its all-gather and each reduced gradient shard back.
* ``optimizer``: :class:`HostOffloadAdamW`: the AdamW states live on the host beside a host copy of each trained
  shard and of its gradient; the step runs there and the new weights are copied back to the device. The weights and
  the backward's gradients stay on the device.

Pinned host memory (faster, asynchronous copies) needs an accelerator: on a CPU-only torch ``Tensor.pin_memory()``
raises "Cannot access accelerator device when none is available" (FSDP2 pins in
``FSDPParam._init_sharded_param``), so pinning is on only when the compute device is not the CPU.

Notation: ``p`` a trained parameter (a DTensor shard under FSDP), ``local(p)`` its local tensor, ``host(p)`` its host
copy; the AdamW arithmetic is torch's own (``torch.optim.adam.adam``), on ``host(p)``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from itertools import chain

import torch
from torch import nn
from torch.optim.optimizer import _get_scalar_dtype

HOST = torch.device("cpu")


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (the tensor itself otherwise); in-place writes reach the DTensor."""
    return t.to_local() if _is_dtensor(t) else t


def pin(device: torch.device) -> bool:
    """Whether host buffers serving ``device`` are pinned (only for an accelerator: see the module docstring)."""
    return torch.device(device).type != "cpu"


def offload_policy(device: torch.device):
    """FSDP2's ``CPUOffloadPolicy`` for modules computing on ``device`` (pinned host memory unless it is the CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=pin(device))


def _host_like(t: torch.Tensor, *, pinned: bool = False) -> torch.Tensor:
    """Zeros on the host shaped like ``t``'s local tensor; a DTensor (same mesh, placements, global shape) when ``t``
    is one, so sharded state dicts (torch.distributed.checkpoint) see the same layout as a device-resident state."""
    zeros = torch.zeros(local(t).shape, dtype=t.dtype, device=HOST, pin_memory=pinned)
    if not _is_dtensor(t):
        return zeros
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(zeros, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device == HOST:
        return t
    out = _host_like(t)
    local(out).copy_(local(t))
    return out


class HostOffloadAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose states and step live on the host (``distributed.offload: optimizer``).

    The parameter groups hold the device parameters (so ``state_dict`` / ``load_state_dict`` and
    ``torch.distributed.checkpoint.state_dict`` see the same parameters and keys as a plain AdamW, and checkpoints move
    between the two freely). At each step every parameter with a gradient is copied into its host buffer (the device
    weights are the truth: nothing on the host can go stale after a resume or a weight load), its gradient into a
    host gradient buffer, torch's AdamW update runs on those buffers and the states (``exp_avg``, ``exp_avg_sq``:
    host tensors, DTensors with host locals under FSDP; ``step``: a CPU scalar as in torch), then the buffers are
    copied back into the device parameters. The arithmetic is torch's (single-tensor kernels on the CPU), so on a
    CPU device the result is bit-identical to ``AdamW`` there.

    Memory (host): the states (8 bytes per element), the weight and gradient buffers (2 x the parameters' dtype).
    Device: none of these.

    Raises:
        ValueError: ``fused`` / ``capturable`` / ``differentiable`` (device-side modes with no meaning here).
    """

    def __init__(self, params: Iterable[torch.Tensor], **kwargs):
        for key in ("fused", "capturable", "differentiable"):
            if kwargs.get(key):
                raise ValueError(f"HostOffloadAdamW: {key}=True is not supported (the step runs on the host)")
        super().__init__(params, **kwargs)
        self._host_buffers: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}  # p -> (host(p), host(grad))
        self._stepped: list[tuple[torch.Tensor, torch.Tensor]] = []  # (p, host(p)) of the step under way

    def _init_group(self, group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        has_complex = False
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("HostOffloadAdamW does not support sparse gradients")
            has_complex |= torch.is_complex(p)
            if p not in self._host_buffers:
                pinned = pin(local(p).device)
                self._host_buffers[p] = (local(_host_like(p, pinned=pinned)), local(_host_like(p, pinned=pinned)))
            host, host_grad = self._host_buffers[p]
            host.copy_(local(p).detach())
            host_grad.copy_(local(p.grad))
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(), device=HOST)
                state["exp_avg"] = _host_like(p)
                state["exp_avg_sq"] = _host_like(p)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = _host_like(p)
            params_with_grad.append(host)
            grads.append(host_grad)
            exp_avgs.append(local(state["exp_avg"]))
            exp_avg_sqs.append(local(state["exp_avg_sq"]))
            if group["amsgrad"]:
                max_exp_avg_sqs.append(local(state["max_exp_avg_sq"]))
            state_steps.append(state["step"])
            self._stepped.append((p, host))
        return has_complex

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step on the host, then the new weights copied into the device parameters."""
        self._stepped = []
        loss = super().step(closure)
        for p, host in self._stepped:
            local(p).copy_(host)
        self._stepped = []
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """``AdamW.load_state_dict`` with the per-parameter states put straight on the host: a checkpoint of a plain
        AdamW resumes here, and this one's resumes there.

        torch's own load casts every state to its parameter's device (``Optimizer._cast`` calls
        ``Optimizer._process_value_according_to_param_policy`` by class name, so a subclass cannot override it), which
        would make the whole AdamW state transit the device at resume: the memory this optimizer exists to save. So
        the parameter groups load through torch with no state, and each state is then copied to the host with
        torch's dtype rule (floating states take their parameter's dtype; ``step`` keeps its own).

        Raises:
            ValueError: as ``Optimizer.load_state_dict`` (group count or sizes differ).
        """
        states = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        by_id = dict(zip(saved, params, strict=True))  # super() checked the groups' sizes
        for key, state in states.items():
            p = by_id.get(key)
            if p is None:  # state of no parameter: kept as is, as torch does
                self.state[key] = state
                continue
            self.state[p] = {name: _host_state(p, name, value) if torch.is_tensor(value) else copy.deepcopy(value)
                             for name, value in state.items()}


def _host_state(p: torch.Tensor, name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` (state ``name`` of parameter ``p``, on any device) on the host, never through ``p``'s device: torch's
    ``_process_value_according_to_param_policy`` with the host for the device (``fused`` / ``capturable``, the cases
    where torch moves ``step`` too, are refused here)."""
    value = _to_host(value)
    if name != "step" and p.is_floating_point():
        value = value.to(dtype=p.dtype)
    return value


@contextlib.contextmanager
def on_device(module: nn.Module, device: torch.device) -> Iterator[None]:
    """``module`` (a frozen policy copy whose home is the host) moved to ``device`` for the block, then back to the
    host. ``nn.Module.to`` keeps the parameter objects, so references to them (blend pairs) stay valid."""
    if torch.device(device) == HOST:
        yield
        return
    module.to(device)
    try:
        yield
    finally:
        module.to(HOST)
