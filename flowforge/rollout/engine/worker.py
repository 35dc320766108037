"""A rollout worker: the model built once from a recipe, weights received by verified sync, rollouts by the one loop.

The worker builds the adapter exactly as the trainer does (same loader, dtype and device), frees its text encoder
(the trainer ships encoded conditioning), and prepares the transformer the way the policy bank prepares the live
one (:class:`flowforge.policy.Policy`): LoRA injected with the same rank / alpha / targets, the trained submodules
in fp32 (``module``; both under ``module+lora``), or the whole transformer in fp32 under full fine-tuning, in eval
mode. Its weights then come only from committed syncs
(:mod:`flowforge.rollout.engine.weight_sync`), and it refuses to roll out before the first one. A rollout is
:func:`flowforge.rollout.loop.rollout_chunked` itself, so the same candidates, chunks and weights give the same bits
as the trainer's own rollout.

:class:`RolloutWorker` is plain Python: the process backend calls its methods from a message loop
(:func:`serve`), the Ray backend makes it an actor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from flowforge.models import build_adapter, set_sampler_options
from flowforge.models import lora as lora_lib
from flowforge.models.base import Conditioning
from flowforge.rollout.engine.weight_sync import SyncManifest, SyncReceiver, WeightSyncError
from flowforge.rollout.loop import RolloutSpec, Trajectory, rollout_chunked
from flowforge.runtime.distributed import portable_error
from flowforge.runtime.dtypes import resolve_dtype


@dataclass(frozen=True)
class WorkerRecipe:
    """How a worker builds its model: what the trainer built, minus the optimizer."""

    adapter: str  # registered family or "pkg.module:Class"
    path: str  # model weights, demo names already resolved
    task: str
    dtype: str  # model.dtype name
    device: str
    trainable: str  # "lora" | "full" | "module" | "module+lora"
    lora_rank: int = 8
    lora_alpha: float = 8.0
    lora_targets: tuple[str, ...] = ()  # resolved (the adapter's defaults filled in), under "lora" / "module+lora"
    modules: tuple[str, ...] = ()  # under "module" / "module+lora": the submodule paths trained in full
    threads: int = 1  # torch CPU threads of the worker
    sampler_options: tuple[tuple[str, float], ...] = ()  # the set family sampler keys (SamplerConfig.model_options)

    @property
    def sync_mode(self) -> str:
        """The only weight-sync mode this worker takes."""
        return "adapter" if self.trainable == "lora" else "full"


@dataclass(frozen=True)
class RolloutTask:
    """One worker's share of a rollout: consecutive rows, chunked like the trainer's micro-batches."""

    cond: Conditioning  # [b, ...] rows of this share
    candidate_ids: tuple[int, ...]  # [b]
    sigmas: torch.Tensor  # [T+1] fp32
    spec: RolloutSpec
    latent_shape: tuple[int, ...]
    seed: int
    batch_size: int  # rollout chunk size


class RolloutWorker:
    """The model of one worker and its committed policy version (``-1``: nothing committed yet)."""

    def __init__(self, recipe: WorkerRecipe):
        torch.set_num_threads(recipe.threads)
        self.recipe = recipe
        self.device = torch.device(recipe.device)
        self.adapter = build_adapter(recipe.adapter, recipe.path, task=recipe.task,
                                     dtype=resolve_dtype(recipe.dtype, key="model.dtype"), device=self.device)
        set_sampler_options(self.adapter, dict(recipe.sampler_options))
        self.adapter.release_text_encoder()
        transformer = self.adapter.transformer
        transformer.requires_grad_(False)
        if recipe.trainable in ("lora", "module+lora"):
            lora_lib.inject_lora(transformer, recipe.lora_rank, recipe.lora_alpha, recipe.lora_targets)
        if recipe.trainable != "lora":  # the policy bank trains (and rolls out) the trained modules in fp32
            for module in self._trained_modules().values():
                module.float()
        transformer.eval()
        self.version = -1
        self._receiver: SyncReceiver | None = None

    def _trained_modules(self) -> dict[str, torch.nn.Module]:
        """Full / module modes: the trained modules by path prefix (``""``: the whole transformer)."""
        t = self.adapter.transformer
        if self.recipe.trainable in ("module", "module+lora"):
            return {f"{path}.": t.get_submodule(path) for path in self.recipe.modules}
        return {"": t}

    def targets(self) -> dict[str, torch.Tensor]:
        """The tensors a sync writes, named as :meth:`flowforge.policy.Policy.named_weights` names them: the LoRA
        tensors (``adapter``), or the state dict of every trained module (``full``; under ``module+lora`` plus the
        LoRA tensors, which lie outside every trained module)."""
        lora = dict(lora_lib.lora_parameters(self.adapter.transformer, "default"))
        if self.recipe.sync_mode == "adapter":
            return lora
        modules = {prefix + k: v for prefix, module in self._trained_modules().items()
                   for k, v in module.state_dict(keep_vars=True).items()}
        return {**modules, **lora} if self.recipe.trainable == "module+lora" else modules

    def info(self) -> dict:
        """``{"pid", "version", "threads"}`` of this worker."""
        return {"pid": os.getpid(), "version": self.version, "threads": torch.get_num_threads()}

    # ------------------------------------------------------------------------------------------------ sync
    def sync_begin(self, manifest: SyncManifest) -> None:
        """Start a sync (an unfinished earlier one is dropped). Raises :class:`WeightSyncError` when the manifest's
        mode or layout is not this worker's."""
        self._receiver = None
        self._receiver = SyncReceiver(manifest, self.targets(), self.recipe.sync_mode)

    def sync_bucket(self, index: int, data: bytes) -> None:
        """Take bucket ``index`` of the current sync (problems surface at :meth:`sync_verify`)."""
        if self._receiver is not None:
            self._receiver.add(index, data)

    def sync_verify(self) -> None:
        """Verify the current sync against its manifest; a failure drops it (the weights are untouched)."""
        if self._receiver is None:
            raise WeightSyncError("weight sync verify without a manifest (sync_begin was refused or never sent)")
        try:
            self._receiver.verify()
        except WeightSyncError:
            self._receiver = None
            raise

    def sync_commit(self) -> int:
        """Copy the verified weights in and take their version; returns it."""
        if self._receiver is None:
            raise WeightSyncError("weight sync commit without a verified sync")
        receiver, self._receiver = self._receiver, None
        self.version = receiver.commit()
        return self.version

    def sync_abort(self) -> None:
        """Drop the current sync; weights and version stay as committed."""
        self._receiver = None

    # ------------------------------------------------------------------------------------------------ rollout
    def rollout(self, task: RolloutTask) -> tuple[Trajectory, int]:
        """:func:`~flowforge.rollout.loop.rollout_chunked` of ``task`` under the committed weights; returns the
        trajectory and the policy version that produced it.

        Raises:
            WeightSyncError: no weights committed yet.
        """
        if self.version < 0:
            raise WeightSyncError("rollout refused: this worker has no committed weights yet (sync first)")
        traj = rollout_chunked(self.adapter, task.cond.to(self.device), list(task.candidate_ids), task.sigmas,
                               task.spec, latent_shape=task.latent_shape, seed=task.seed,
                               batch_size=task.batch_size, device=self.device)
        return trajectory_to(traj, "cpu"), self.version


def trajectory_to(traj: Trajectory, device: torch.device | str) -> Trajectory:
    """``traj`` with every tensor moved to ``device`` (CPU is what crosses the process boundary)."""
    from dataclasses import fields, replace

    moved = {f.name: getattr(traj, f.name).to(device) for f in fields(traj)
             if isinstance(getattr(traj, f.name), torch.Tensor)}
    return replace(traj, **moved)


def serve(conn, recipe: WorkerRecipe) -> None:
    """The worker process's message loop over a ``multiprocessing`` connection.

    Messages are ``(kind, seq, method, args)``: ``kind`` ``"call"`` is answered with ``("ok", seq, result)`` or
    ``("error", seq, exception)``, ``"cast"`` (sync buckets: streamed without waiting) is not answered.
    ``("close",)`` ends the loop. The first message sent is ``("ready", 0, info)`` once the model is built, or
    ``("error", 0, exc)``.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer stops us
    try:
        worker = RolloutWorker(recipe)
    except Exception as exc:  # reported to the trainer, which raises it
        conn.send(("error", 0, portable_error(exc)))
        return
    conn.send(("ready", 0, worker.info()))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the trainer went away
            return
        if message[0] == "close":
            return
        kind, seq, method, args = message
        try:
            result = getattr(worker, method)(*args)
        except Exception as exc:
            if kind == "call":
                conn.send(("error", seq, portable_error(exc)))
            continue
        if kind == "call":
            conn.send(("ok", seq, result))


def split_rows(num_rows: int, batch_size: int, num_workers: int) -> list[slice]:
    """Consecutive row ranges, one per worker that gets work, cut on chunk boundaries (multiples of
    ``batch_size``) with the chunks spread as evenly as possible; earlier workers take the extra chunk."""
    chunks = -(-num_rows // batch_size)
    base, extra = divmod(chunks, num_workers)
    out, start = [], 0
    for w in range(num_workers):
        n = base + (w < extra)
        if n == 0:
            break
        stop = min(num_rows, start + n * batch_size)
        out.append(slice(start, stop))
        start = stop
    return out


def worker_tasks(cond: Conditioning, candidate_ids: Sequence[int], sigmas: torch.Tensor, spec: RolloutSpec, *,
                 latent_shape: Sequence[int], seed: int, batch_size: int, num_workers: int) -> list[RolloutTask]:
    """The rollout of ``len(candidate_ids)`` rows split into per-worker :class:`RolloutTask` s (:func:`split_rows`);
    concatenating their trajectories in order gives the rows in order."""
    tasks = []
    for rows in split_rows(len(candidate_ids), batch_size, num_workers):
        tasks.append(RolloutTask(cond=cond.index(torch.arange(rows.start, rows.stop)),
                                 candidate_ids=tuple(int(c) for c in candidate_ids[rows]), sigmas=sigmas.cpu(),
                                 spec=spec, latent_shape=tuple(latent_shape), seed=seed, batch_size=batch_size))
    return tasks
