"""torch.distributed for flowforge: process group from torchrun's environment, collectives, DDP / FSDP2 wrapping.

Launch: ``torchrun --nproc_per_node N -m flowforge.cli train CONFIG ...`` (multi-node through torchrun's
rendezvous). No process management here: torchrun sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_*``
and :func:`init` joins the group (on CUDA NCCL for CUDA tensors and gloo for CPU tensors, so small CPU
bookkeeping collectives work beside NCCL; gloo alone on CPU).

Data parallelism of one step (M prompts x K candidates, canonical group-major order from the K-repeat sampler):

* each rank rolls out and scores its contiguous share of the candidates;
* rewards are all-gathered in canonical order so group statistics see every group whole
  (:func:`all_gather_cat`), advantages are computed identically on every rank and each rank keeps its share;
* gradients are averaged by the wrapper: ``replicate`` (composable DDP) or ``fully_shard`` (FSDP2, applied to
  ``adapter.blocks()`` then the root, ``MixedPrecisionPolicy`` for param / reduce dtypes). Every rank rolls out the
  same number of samples (preflight requires divisibility). Objectives that then drop rows (NFT guard, DPO ties)
  scale each rank's loss by its share of the rows trained over all ranks and pad with zero-weight micro-batches, so
  every rank runs the same forwards / backwards (:meth:`flowforge.objectives.ForwardProcessObjective.optimize`);
  their metrics are reduced over ranks inside the objective, weighted by rows. Trainer metrics are averaged over
  the ranks that have a value (:func:`mean_across_ranks`).

Candidate noise depends on the candidate's sample id (never on the rank), so two ranks never draw the same candidate.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flowforge.runtime.dtypes import DTYPES

STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: object = None  # the process group of these ranks (None: the default group, every process)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(device: str = "cpu", *, timeout_s: float | None = None) -> DistInfo:
    """Join the process group torchrun describes (no-op for a single process; an already joined group is kept,
    whatever its timeout). ``timeout_s``: how long a collective waits for the other ranks (torch's default when
    None). Returns this rank's info."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        import datetime

        backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
        extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group(backend=backend, **extra)
    info = DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if device.startswith("cuda"):
        torch.cuda.set_device(info.local_rank)
    return info


def all_gather_cat(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Concatenate equal-shaped ``tensor`` of every rank of ``info`` (its group) along dim 0, in rank order
    (identity when single)."""
    if not info.enabled:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(info.world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=info.group)
    return torch.cat(parts)


def check_same_keys(keys: list[str]) -> None:
    """Raise unless every process holds the same sorted ``keys`` (a no-op on one process). Call before reducing
    per-key values: a rank that took another code path would otherwise mix up values or hang the collective.

    Raises:
        RuntimeError: naming the keys some ranks lack.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    every: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, keys)
    if any(k != keys for k in every):
        differ = sorted(set().union(*every) - set.intersection(*map(set, every)))
        raise RuntimeError(f"ranks hold different metric keys (a rank took another code path): {differ}")


def mean_across_ranks(scalars: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Average a dict of floats over the ranks where each value is not NaN (NaN only where every rank has NaN: a
    rank can legitimately lack a value, e.g. within-group diversity on a rank holding no two members of a group).

    Raises:
        RuntimeError: the ranks hold different keys (:func:`check_same_keys`).
    """
    if not info.enabled:
        return scalars
    keys = sorted(scalars)
    check_same_keys(keys)
    if not keys:
        return scalars
    values = torch.tensor([scalars[k] for k in keys], dtype=torch.float64)
    present = ~torch.isnan(values)
    t = torch.stack([torch.where(present, values, 0.0), present.double()])
    dist.all_reduce(t)
    return {k: float(s / n) if n > 0 else float("nan") for k, s, n in zip(keys, t[0].tolist(), t[1].tolist())}


def all_reduce_processes(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """``tensor`` (CPU) reduced over every process of the default group (``op``: ``"sum"`` | ``"max"`` |
    ``"min"``); ``tensor`` itself when no process group is initialised (a single process). For code that holds no
    :class:`DistInfo`."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    out = tensor.clone()
    dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return out


def all_gather_objects(item: object) -> list[object]:
    """``item`` of every process of the default group, in rank order (picklable objects; ``[item]`` when no
    process group is initialised). A collective: every process must call it."""
    if not (dist.is_available() and dist.is_initialized()):
        return [item]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, item)
    return out


def portable_error(error: Exception) -> Exception:
    """``error`` when it survives pickling (to be raised on the other ranks too), else a RuntimeError quoting it."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def broadcast_from_main(item: object) -> object:
    """Rank 0's ``item`` on every process of the default group (picklable; ``item`` itself when no process group is
    initialised). A collective: every process must call it (the others' ``item`` is ignored)."""
    if not (dist.is_available() and dist.is_initialized()):
        return item
    box = [item]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown() -> None:
    """Destroy the default process group if this process joined one (a no-op otherwise).

    Called at the end of a torchrun job: leaving the group to interpreter teardown can abort the process after its
    work is done ("terminate called without an active exception", seen with FSDP + DCP on gloo).
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_now(rc: int) -> None:
    """End this process with status ``rc`` without interpreter teardown when it ran under ``torchrun``
    (``$TORCHELASTIC_RUN_ID`` set): stdio flushed, then ``os._exit``. A no-op outside torchrun.

    Why: after the work is done and the process group destroyed (:func:`shutdown`), C++ objects of the c10d / gloo
    stack can still hold a joinable thread at static destruction; the rank then aborts ("terminate called without an
    active exception", SIGABRT) and torchrun reports a finished, successful job as failed. Seen intermittently with
    FSDP + DCP on gloo (tests/test_distributed.py). Call it last, after every file is closed.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(rc)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def wrap(adapter, strategy: str, *, param_dtype: str = "float32", reduce_dtype: str = "float32",
         offload: str = "none") -> None:
    """Make ``adapter.transformer`` data-parallel in place (call after LoRA injection, before the optimizer).

    ``"ddp"``: ``torch.distributed._composable.replicate`` (DDP's gradient all-reduce, keeps the module's class and
    attributes). ``"fsdp"``: FSDP2 ``fully_shard`` on each of ``adapter.blocks()`` then the root, with
    ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``; trainable master weights stay fp32. (Activation
    checkpointing is the adapter's: diffusers' ``enable_gradient_checkpointing``, which keeps parameter names.)
    ``offload="params"`` adds FSDP2's ``CPUOffloadPolicy`` to every ``fully_shard`` (shards, gradients and optimizer
    states on the host: :func:`flowforge.runtime.offload.offload_policy`); ``"optimizer"`` changes nothing here (the
    optimizer is :class:`flowforge.runtime.offload.HostOffloadAdamW`).

    Raises:
        ValueError: unknown strategy / dtype / offload (allowed values listed); offload other than ``"none"`` without
            ``strategy="fsdp"``.
    """
    from flowforge.settings.distributed import OFFLOAD_MODES

    if strategy not in STRATEGIES:
        raise ValueError(f"distributed.strategy={strategy!r} is not one of {list(STRATEGIES)}")
    for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if value not in DTYPES:
            raise ValueError(f"distributed.{name}={value!r} is not one of {sorted(DTYPES)}")
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"distributed.offload={offload!r} is not one of {list(OFFLOAD_MODES)}")
    if offload != "none" and strategy != "fsdp":
        raise ValueError(f"distributed.offload={offload!r} needs distributed.strategy='fsdp' (got {strategy!r}); "
                         "allowed without FSDP: ['none']")
    if strategy == "ddp":
        from torch.distributed._composable import replicate

        replicate(adapter.transformer)
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from flowforge.runtime.offload import offload_policy

    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])}
    if offload == "params":  # pinned host memory only when the compute device is an accelerator
        kwargs["offload_policy"] = offload_policy(next(adapter.transformer.parameters()).device)
    for block in adapter.blocks():
        fully_shard(block, **kwargs)
    fully_shard(adapter.transformer, **kwargs)
