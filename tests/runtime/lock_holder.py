"""Test support: another process holding a run directory's lock, for the tests of what a second command is told."""

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).parents[2]


@contextlib.contextmanager
def lock_holder(run_dir) -> Iterator[subprocess.Popen]:
    """A separate Python process that acquires ``run_dir``'s :class:`flowforge.runtime.lock.RunLock` and sleeps.

    Yields its ``Popen`` once the lock is held (``holder.pid`` is the PID the lock names); kills and reaps it when the
    block ends. The child imports this checkout's ``flowforge`` (``PYTHONPATH`` = the repository root), not an
    installed copy."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from flowforge.runtime.lock import RunLock
        lock = RunLock({str(run_dir)!r})
        lock.acquire()
        print("held", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
