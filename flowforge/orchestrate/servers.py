"""Judge servers the pipeline starts itself: ``flowforge serve judge`` in a child process on loopback, a random free
port (``--port 0``) and a bearer token, stopped when the stage ends.

The child is started with the parent-death signal set (Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``), so a pipeline
killed with ``kill -9`` does not leave its servers running; the next run starts fresh ones on new ports. The token
lives in ``<pipeline>/judge.token`` (created once, mode 0600) and reaches the pipeline's judge clients through the
environment variable :data:`TOKEN_ENV` of this process.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from flowforge.runtime.durable import write_bytes

TOKEN_ENV = "FLOWFORGE_STAGES_TOKEN"
TOKEN_FILE = "judge.token"  # in the pipeline directory (PipelineLayout.token)
READY_PREFIX = "serving judge at "


def pipeline_token(path: Path) -> Path:
    """The pipeline's token file ``path`` (:attr:`flowforge.orchestrate.directory.PipelineLayout.token`, made with a
    fresh ``secrets.token_urlsafe(32)`` when missing), exported as :data:`TOKEN_ENV` for this process's judge
    clients. Returns its path."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, secrets.token_urlsafe(32).encode())
        path.chmod(0o600)
    os.environ[TOKEN_ENV] = path.read_text().strip()
    return path


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _isolated_env() -> dict[str, str]:
    """The child's environment: with ``python -P`` the working directory is not put first on ``sys.path``, and
    ``PYTHONPATH`` lists the directory of the flowforge this process runs before it, so a ``flowforge/`` directory
    in the working directory (an export's, say) cannot shadow the package; the working directory follows, so
    ``pkg.module:Factory`` scorers found there still import."""
    import flowforge

    package_root = str(Path(flowforge.__file__).resolve().parents[1])
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.getcwd(), *rest])}


class JudgeServer:
    """A ``flowforge serve judge`` child process (module docstring).

    Args:
        backend_args: the backend flags, e.g. ``["--scorer", "digit"]`` or ``["--student", DIR]``.
        token_file: the bearer-token file. model_name: the model id served.
        request_log: ``--request-log`` file (every received request's key), or None.
        num_threads: ``--num-threads`` of the child (0: torch's default).
        log_file: where the child's stdout / stderr go (appended).
        timeout_s: seconds to wait for the server to listen.

    Raises:
        RuntimeError: the server exited or did not listen within ``timeout_s`` (its log's tail is included).
    """

    def __init__(self, backend_args: Sequence[str], *, token_file: Path, model_name: str,
                 request_log: Path | None = None, num_threads: int = 0, log_file: Path,
                 timeout_s: float = 300.0) -> None:
        args = [sys.executable, "-P", "-m", "flowforge.cli", "serve", "judge", *backend_args, "--host", "127.0.0.1",
                "--port", "0", "--token-file", str(token_file), "--model-name", model_name,
                "--num-threads", str(num_threads)]
        if request_log is not None:
            args += ["--request-log", str(request_log)]
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = log_file
        self._log = open(log_file, "a")  # noqa: SIM115 - kept open for the child's lifetime
        # its own session: a Ctrl-C at the terminal reaches the pipeline, which finishes its step with this judge
        # (the pipeline stops it after), not the judge itself; it still dies with the pipeline (_die_with_parent)
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._log, text=True, env=_isolated_env(),
                                     preexec_fn=_die_with_parent, start_new_session=True)
        self.url = self._wait(timeout_s)

    def _wait(self, timeout_s: float) -> str:
        found: list[str] = []

        def read() -> None:
            for line in self.proc.stdout:
                self._log.write(line)
                self._log.flush()
                if line.startswith(READY_PREFIX) and not found:
                    found.append(line[len(READY_PREFIX):].strip())

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not found and self.proc.poll() is None:
            time.sleep(0.05)
        if not found:
            self.stop()
            tail = self.log_file.read_text()[-2000:]
            raise RuntimeError(f"the judge server did not start (see {self.log_file}): {tail}")
        return found[0]

    @property
    def api_root(self) -> str:
        """The OpenAI-compatible API root (``<url>/v1``)."""
        return self.url + "/v1"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; waits for the exit."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> JudgeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
