"""One process per run directory: an exclusive lock held for the whole run, with its holder named.

:class:`RunLock` takes ``<run_dir>/.flowforge.lock`` with ``filelock`` (``flock`` on POSIX: released by the kernel
when the process dies, so a killed run never leaves a stale lock) and writes ``<run_dir>/.flowforge.lock.owner``
(``{"pid": int, "host": str, "since": "YYYY-MM-DD HH:MM:SS"}``, local time) beside it. A second process that finds
the lock held is refused at once: ``<run_dir>: is locked by PID 4242 on host h (running since 2026-12-06
10:52:46)``, read from that file. :func:`held_by_parent` lets a child process (a judge server the pipeline starts)
prove that the directory is its parent's.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from filelock import FileLock, Timeout

from flowforge.runtime.errors import UserError

LOCK_FILE = ".flowforge.lock"
OWNER_FILE = ".flowforge.lock.owner"


class RunLock:
    """The exclusive lock of one run directory.

    Args:
        run_dir: the run directory (must exist before :meth:`acquire`).
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._created = self._recorded = False
        self._lock = FileLock(str(self.run_dir / LOCK_FILE), timeout=0, thread_local=False)

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._lock.is_locked

    def acquire(self, *, record: bool = True) -> None:
        """Take the lock (a no-op when already held) and, with ``record``, write this process as its holder.

        Raises:
            UserError: another process holds it, naming its pid and host.
        """
        if self.held:
            return
        self._created = not os.path.lexists(self.run_dir / LOCK_FILE)
        try:
            self._lock.acquire()
        except Timeout:
            raise UserError(self.run_dir, f"is locked by {self._holder()}: another flowforge process runs in it",
                            "wait for it to finish or stop it; one run directory takes one run at a time") from None
        self._recorded = record
        if record:
            owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            (self.run_dir / OWNER_FILE).write_text(json.dumps(owner) + "\n")

    def check_free(self) -> None:
        """Refuse like :meth:`acquire` when another process holds the lock; otherwise leave the directory as it was.

        Raises:
            UserError: another process holds it, naming its pid and host.
        """
        self.acquire(record=False)
        self.release(undo=True)

    def release(self, *, undo: bool = False) -> None:
        """Release the lock and remove the owner file; ``undo`` also removes the lock file when :meth:`acquire`
        created it, so a refused command leaves the run directory as it found it."""
        if not self.held:
            return
        if self._recorded:
            (self.run_dir / OWNER_FILE).unlink(missing_ok=True)  # still held: no other holder's file to remove
        if undo and self._created:
            (self.run_dir / LOCK_FILE).unlink(missing_ok=True)
        self._lock.release(force=True)

    def _holder(self) -> str:
        """``PID 4242 on host h (running since 2026-12-06 10:52:46)`` from the owner file (an older holder's file
        has no ``since``); ``a process that left no owner file`` when it cannot be read."""
        try:
            info = json.loads((self.run_dir / OWNER_FILE).read_text())
            since = f" (running since {info['since']})" if info.get("since") else ""
            return f"PID {info['pid']} on host {info['host']}{since}"
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return "a process that left no owner file"


def held_by_parent(directory: str | Path) -> bool:
    """Whether ``directory``'s lock is held by this process's parent on this host (its owner file names
    ``os.getppid()``): the pipeline's judge servers write their request logs into the pipeline directory, no other
    process does. Never raises."""
    try:
        info = json.loads((Path(directory) / OWNER_FILE).read_text())
        return info["pid"] == os.getppid() and info["host"] == socket.gethostname()
    except (OSError, ValueError, KeyError, TypeError):
        return False
