"""Where a rollout worker runs: a ``torch.multiprocessing`` process (spawn) or a Ray actor.

Both run the same :class:`~flowforge.rollout.engine.worker.RolloutWorker` and expose the same handle:

* ``submit(method, *args) -> Pending`` calls a worker method without waiting; ``Pending.result()`` waits for it and
  raises what the worker raised (a :class:`~flowforge.rollout.engine.weight_sync.WeightSyncError` arrives as one);
* ``cast(method, *args)`` sends without a reply (weight-sync buckets are streamed this way);
* ``pid``, ``alive()``, ``close()``.

A worker that ends while the trainer waits on it (``kill -9``, a crash, out of memory) raises
:class:`~flowforge.rollout.engine.weight_sync.WorkerLostError` naming its index, pid and exit status.

:func:`start_worker` is the one place that picks the backend; Ray is imported only when ``backend="ray"``
(``pip install 'flowforge[ray]'``).
"""

from __future__ import annotations

import signal

from flowforge.rollout.engine.weight_sync import WorkerLostError
from flowforge.rollout.engine.worker import RolloutWorker, WorkerRecipe, serve

BACKENDS = ("process", "ray")
"""Worker backends (``rollout.backend``)."""


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class _ProcessPending:
    def __init__(self, worker: "ProcessWorker", seq: int):
        self.worker, self.seq = worker, seq

    def result(self):
        return self.worker._reply(self.seq)


class ProcessWorker:
    """A worker in its own process (``torch.multiprocessing``, spawn: nothing is inherited but the recipe), talking
    over a pipe; tensors in replies travel through shared memory."""

    def __init__(self, index: int, recipe: WorkerRecipe):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.index = index
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, recipe), daemon=True,
                                   name=f"flowforge-rollout-worker-{index}")
        self.process.start()
        child.close()
        self.pid = self.process.pid
        self._seq = 0  # calls are numbered: a reply nobody waited for (a call abandoned by an error) is skipped

    def wait_ready(self) -> dict:
        """Wait until the model is built; returns the worker's ``info()``."""
        status, _, value = self._receive()
        if status == "error":
            raise value
        return value

    def _lost(self) -> WorkerLostError:
        self.process.join(timeout=1.0)
        return WorkerLostError(f"rollout worker {self.index} (pid {self.pid}) ended: "
                               f"{_exit_text(self.process.exitcode)}")

    def _receive(self):
        while not self.conn.poll(0.2):
            if not self.process.is_alive() and not self.conn.poll(0):
                raise self._lost()
        try:
            return self.conn.recv()
        except (EOFError, ConnectionError, OSError):
            raise self._lost() from None

    def _send(self, message) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionError, OSError):
            raise self._lost() from None

    def _reply(self, seq: int):
        while True:
            status, got, value = self._receive()
            if got == seq:
                break
        if status == "error":
            raise value
        return value

    def submit(self, method: str, *args) -> _ProcessPending:
        self._seq += 1
        self._send(("call", self._seq, method, args))
        return _ProcessPending(self, self._seq)

    def cast(self, method: str, *args) -> None:
        self._send(("cast", 0, method, args))

    def alive(self) -> bool:
        return self.process.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Ask the worker to stop; kill it if it does not within ``timeout`` seconds."""
        if self.process.is_alive():
            try:
                self.conn.send(("close",))
            except (BrokenPipeError, ConnectionError, OSError):
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self.conn.close()


class _RayPending:
    def __init__(self, worker: "RayWorker", ref):
        self.worker, self.ref = worker, ref

    def result(self):
        return self.worker._get(self.ref)


class RayWorker:
    """A worker as a Ray actor (one CPU each); Ray is started on this machine when no cluster is connected."""

    def __init__(self, index: int, recipe: WorkerRecipe):
        import ray

        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.ray = ray
        self.index = index
        actor_class = ray.remote(num_cpus=recipe.threads, max_restarts=0)(RolloutWorker)
        self.actor = actor_class.remote(recipe)
        self.pid: int | None = None
        self._casts: list = []

    def wait_ready(self) -> dict:
        info = self._get(self.actor.info.remote())
        self.pid = info["pid"]
        return info

    def _get(self, ref):
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise WorkerLostError(f"rollout worker {self.index} (Ray actor, pid {self.pid}) ended: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None

    def submit(self, method: str, *args) -> _RayPending:
        return _RayPending(self, getattr(self.actor, method).remote(*args))

    def cast(self, method: str, *args) -> None:
        self._casts.append(getattr(self.actor, method).remote(*args))  # actor calls run in order of submission

    def alive(self) -> bool:
        try:
            self._get(self.actor.info.remote())
            return True
        except WorkerLostError:
            return False

    def close(self, timeout: float = 10.0) -> None:
        self._casts.clear()
        self.ray.kill(self.actor)


def start_worker(backend: str, index: int, recipe: WorkerRecipe):
    """Start worker ``index`` on ``backend`` (``"process"`` | ``"ray"``) without waiting for its model.

    Raises:
        ValueError: unknown backend (the allowed names are listed).
    """
    if backend == "process":
        return ProcessWorker(index, recipe)
    if backend == "ray":
        return RayWorker(index, recipe)
    raise ValueError(f"rollout.backend={backend!r} is not one of {list(BACKENDS)}")
