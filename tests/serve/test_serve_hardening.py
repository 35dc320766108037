"""Issue 42 (hardening, round three), on real ``flowforge serve judge`` subprocesses on loopback: the token before the
body, one pixel budget for all concurrent decodes, idle connections evicted, decompression-bomb headers refused in
JSON, the request log checked at start and its write failures answered in JSON; and the judge client's reference
images header-checked against the same budget.

Memory is read from the server process's ``/proc/PID/status`` (``VmHWM``, reset between phases by writing 5 to
``/proc/PID/clear_refs``); Linux only."""

from __future__ import annotations

import base64
import io
import os
import resource
import shutil
import socket
import struct
import subprocess
import sys
import threading
import urllib.parse
import zlib
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.serve import judge_support as S

TOKEN = "hardening-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BUDGET_MPIXELS = 4  # --max-request-mpixels of the shared server: a 2048^2 image is exactly one request's budget
JUDGE = ["-m", "flowforge.cli", "serve", "judge", "--scorer", "tests.serve.judge_support:Brightness", "--model-name",
         "brightness", "--port", "0", "--num-threads", "1"]


def _status(pid: int, field: str) -> int:
    """``VmHWM`` / ``VmRSS`` of ``pid`` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def _reset_peak(pid: int) -> int:
    """Reset ``pid``'s peak RSS to its current RSS (``clear_refs`` 5) and return that RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status(pid, "VmRSS")


def _png_url(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 200)).save(buffer, format="PNG")  # one colour: a few KiB
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(*urls: str) -> dict:
    parts = [{"type": "text", "text": "rate"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "brightness", "messages": [{"role": "user", "content": parts}]}


def _group(url: str) -> dict:
    """A one-candidate group request of the judge layout (docs/judge_server.md) with the image at ``url``."""
    from flowforge.rewards.judge import protocol as P

    return {"model": "brightness", "messages": [{"role": "user", "content": P.build_content(
        "score", "a photo", None, [[url]], ["A"])}]}


def bomb_jpeg(width: int = 60000, height: int = 60000) -> bytes:
    """A JPEG of a start marker and a frame header only, claiming ``width x height`` (17 bytes)."""
    return b"\xff\xd8\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00\xff\xd9"


def big_png(path: Path, side: int) -> Path:
    """A valid black greyscale PNG of ``side x side``, written row by row (never ``side^2`` bytes in memory)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer, row, parts = zlib.compressobj(9), b"\x00" * (side + 1), []
    for _ in range(side):
        parts.append(packer.compress(row))
    parts.append(packer.flush())
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b""))
    return path


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    """``(url, pid, request_log)`` of a judge server with a token, a request log and a 4 Mi pixel budget."""
    root = tmp_path_factory.mktemp("hardening")
    (root / "token").write_text(TOKEN + "\n")
    request_log = root / "requests.jsonl"
    proc, url = S.start([*JUDGE, "--token-file", str(root / "token"), "--request-log", str(request_log),
                         "--max-request-mpixels", str(BUDGET_MPIXELS)])
    yield url, proc.pid, request_log
    S.stop(proc)


def test_a_62_mib_body_without_a_token_is_401_and_never_read(judge):
    """The token is checked from the headers: the body is not read (was: read and scanned, +3.8 GB)."""
    url, pid, _ = judge
    parts = urllib.parse.urlsplit(url)
    body = b"[" + b"0," * (31 * 2**20) + b"0]"  # 62 MiB of JSON without a string: the old depth scan's worst case
    before = _reset_peak(pid)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        conn.sendall(body)  # the server discards what it does not read
        head = conn.recv(65536)
    grown = _status(pid, "VmHWM") - before
    assert head.startswith(b"HTTP/1.1 401 "), head[:200]
    assert b'"code": "invalid_api_key"' in head or b'"code":"invalid_api_key"' in head, head
    assert grown < 100 * 2**20, f"the server's peak RSS grew {grown / 2**20:.0f} MiB"


def test_eight_concurrent_budget_sized_requests_peak_like_one(judge):
    """Decode + score run under one pixel budget: 8 requests at the budget at once peak like one (was: 8 decodes
    side by side). In order on one warm server: the peak is reset before each phase, so each reads its own growth;
    memory the allocator kept from phase one can only lower phase two's growth, not raise it."""
    url, pid, _ = judge
    body = _group(_png_url(2048, 2048))  # exactly the 4 Mi pixel budget
    assert httpx.post(f"{url}/v1/chat/completions", json=_group(_png_url(8, 8)), headers=AUTH,
                      timeout=60).status_code == 200  # warm-up: lazy imports, the thread pool
    before = _reset_peak(pid)
    assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120).status_code == 200
    one = _status(pid, "VmHWM") - before
    before = _reset_peak(pid)
    start, codes = threading.Barrier(8), []

    def send() -> None:
        start.wait()
        codes.append(httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=300).status_code)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    eight = _status(pid, "VmHWM") - before
    assert codes == [200] * 8
    assert one > 20 * 2**20, f"one request grew the peak by only {one / 2**20:.0f} MiB: nothing to compare"
    assert eight <= 1.5 * one, f"8 concurrent: +{eight / 2**20:.0f} MiB, one: +{one / 2**20:.0f} MiB"


def test_decompression_bomb_header_is_a_413_in_openai_json(judge):
    """A 17-byte JPEG header claiming 60000^2 pixels: 413 from the header check (was: a plain-text 500, which the
    paid-judge client could retry; a 4xx other than 408 / 409 / 429 is never retried)."""
    url, _, _ = judge
    bomb = "data:image/jpeg;base64," + base64.b64encode(bomb_jpeg()).decode()
    response = httpx.post(f"{url}/v1/chat/completions", json=_chat(bomb), headers=AUTH, timeout=60)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "3600000000 pixels" in error["message"]
    from flowforge.rewards.judge.client import FATAL_WHAT, retry_kind

    assert retry_kind("http_error", 413, True) is None and 413 not in FATAL_WHAT  # recorded, never re-sent


def test_a_request_log_write_failure_is_a_json_500(judge):
    """The request log replaced by a directory while serving: the request is refused with a JSON 500 naming the
    log (was: an unhandled OSError, a plain-text 500 and a traceback)."""
    url, _, request_log = judge
    request_log.unlink(missing_ok=True)
    request_log.mkdir()
    try:
        response = httpx.post(f"{url}/v1/chat/completions", json=_group(_png_url(8, 8)), headers=AUTH, timeout=60)
    finally:
        request_log.rmdir()
    assert response.status_code == 500, response.text
    assert response.json()["error"]["code"] == "request_log_failed"


def test_1100_idle_connections_leave_health_answering(tmp_path):
    """A server limited to 1024 open files, 1,100 sockets that send nothing or half a header: the oldest idle ones
    are closed and /health answers (was: accept() failing with EMFILE, /health unreachable, a traceback per retry)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:  # this test's own sockets
        if hard != resource.RLIM_INFINITY and hard < 1400:
            pytest.skip(f"the open-file hard limit {hard} is too low for 1,100 client sockets")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1400, hard))
    launcher = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)); "
                "sys.argv = ['flowforge', *sys.argv[1:]]; runpy.run_module('flowforge.cli', run_name='__main__')")
    proc, url = S.start(["-c", launcher, *JUDGE[2:], "--no-auth"])
    parts = urllib.parse.urlsplit(url)
    sockets = []
    try:
        for i in range(1100):
            conn = socket.create_connection((parts.hostname, parts.port), timeout=10)
            if i % 2:
                conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # half a header
            sockets.append(conn)
        response = httpx.get(f"{url}/health", timeout=5)  # one generous check
        assert response.status_code == 200 and response.json()["status"] == "ok"
    finally:
        for conn in sockets:
            conn.close()
        S.stop(proc)
    errors = proc.stderr.read()
    assert "Traceback" not in errors and len(errors.splitlines()) <= 5, errors[-2000:]


@pytest.mark.parametrize("target", ["directory", "/dev/full"])
def test_request_log_that_cannot_be_a_log_is_refused_at_start(tmp_path, target):
    """``--request-log`` a directory or a character device: one line, exit 2, before anything serves (was: the server
    started and failed every request)."""
    if target == "/dev/full" and not Path("/dev/full").is_char_device():
        pytest.skip("/dev/full is not the character device here")
    path = tmp_path if target == "directory" else Path(target)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(S.ROOT)}
    try:
        done = subprocess.run([sys.executable, *JUDGE, "--no-auth", "--request-log", str(path)], cwd=S.ROOT,
                              env=env, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve judge --request-log {path} started serving")
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --request-log") and str(path) in lines[0], done.stderr
    assert "serving" not in done.stdout


def test_reference_image_over_the_budget_is_one_line_error(tmp_path):
    """A 12000^2 PNG (about 140 KB) as a judge reference: refused from its header with one line naming the file and
    the budget (was: decoded whole, 7.9 GB, then 'internal error')."""
    from flowforge.rewards.judge import protocol as P
    from flowforge.rewards.judge.client import load_reference

    png = big_png(tmp_path / "reference.png", 12000)
    assert png.stat().st_size < 1_000_000
    with pytest.raises(ValueError) as caught:
        load_reference(png)
    message = str(caught.value)
    assert "\n" not in message and str(png) in message and f"budget of {P.MAX_DECODE_PIXELS} pixels" in message
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_client_that_stalls_in_its_header_or_body_is_cut_off(tmp_path):
    """``--client-timeout 1``: a half-sent request head is closed, a body that stops mid-way gets a 408 (or is
    closed), each well within the socket's own 30 s bound (was: both held forever)."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    proc, url = S.start([*JUDGE, "--token-file", str(tmp_path / "token"), "--client-timeout", "1"])
    parts = urllib.parse.urlsplit(url)
    try:
        stalled = [b"GET /health HTTP/1.1\r\nHost: x\r\n",  # a head never finished
                   b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                   + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":"]  # a body
        for request in stalled:
            with socket.create_connection((parts.hostname, parts.port), timeout=30) as conn:
                conn.sendall(request)
                answer = b""
                while chunk := conn.recv(4096):  # until the server closes (the 30 s socket timeout raises instead)
                    answer += chunk
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # the server itself is fine
    finally:
        S.stop(proc)
