"""Start ``flowforge serve reward`` as a real subprocess on loopback (a free port, a bearer token) for tests."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def reward_server(scorers: str, *extra: str, token_dir: Path, no_auth: bool = False, timeout: float = 120.0,
                  token_file: Path | None = None):
    """Yield ``(url, token)`` of a running server (token None with ``no_auth``); stop it afterwards.

    ``token_file``: pass this ``--token-file`` as it is (the server may create it) and yield the token read from it
    once the server listens; by default a fresh token is written into a new file under ``token_dir``.

    The server is started as ``python -m flowforge.cli serve reward --scorers SCORERS --port 0 ...`` and its URL read
    from the ``serving reward at URL`` line it prints when it listens.
    """
    token = None if no_auth or token_file is not None else secrets.token_urlsafe(16)
    auth = ["--no-auth"] if token_file is None else ["--token-file", str(token_file)]
    if token is not None:
        token_file = token_dir / f"token_{secrets.token_hex(4)}"
        token_file.write_text(token + "\n")
        auth = ["--token-file", str(token_file)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "flowforge.cli", "serve", "reward", "--scorers", scorers, "--port", "0",
           "--num-threads", "1", *auth, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not line or " at http://" not in line[0]:
            proc.kill()
            raise RuntimeError(f"reward server did not start: {line!r}\n{proc.stderr.read()[-3000:]}")
        assert line[0].startswith("serving reward at http://127.0.0.1:"), line[0]
        if token_file is not None:
            token = token_file.read_text().strip()
        yield line[0].split(" at ", 1)[1].strip(), token
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def post_declared_only(url: str, length: int, headers: dict[str, str]) -> tuple[int, dict]:
    """POST headers declaring a ``length``-byte JSON body to ``url``, send none of it, and read the answer: how a
    test sees a server refuse a body from its ``Content-Length`` (sending the body too races the early answer, and
    the client may see a broken pipe instead of the 413)."""
    import http.client
    import json
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.putrequest("POST", parts.path)
        for name, value in {"Content-Type": "application/json", **headers, "Content-Length": str(length)}.items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()
