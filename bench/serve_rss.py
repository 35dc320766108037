"""Peak RSS of the reward and judge servers under issue 24's hostile requests, with the per-request pixel budget
(default) and without it (``--max-request-mpixels`` set far above the request, which is how the servers behaved
before the budget existed: every image decoded).

Each case starts a fresh server subprocess on loopback, reads its ``VmHWM`` (peak resident set) from
``/proc/PID/status`` once it is idle, sends one request, and reads ``VmHWM`` again. Linux only.

    python bench/serve_rss.py            # prints one line per case: status, peak RSS before / after, the increase
"""

from __future__ import annotations

import base64
import io
import secrets
import sys
import tempfile
from pathlib import Path

import httpx
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.serve import judge_support as S  # noqa: E402  (server start-up helper: python ARGS, wait for its URL)


def _png_b64(side: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def _case(name: str, args: list[str], path: str, body: dict, token_file: Path) -> None:
    proc, url = S.start(["-m", "flowforge.cli", "serve", *args, "--port", "0", "--token-file", str(token_file),
                         "--num-threads", "1"])
    try:
        before = _hwm_mib(proc.pid)
        response = httpx.post(f"{url}{path}", json=body, timeout=600,
                              headers={"Authorization": f"Bearer {token_file.read_text().strip()}"})
        after = _hwm_mib(proc.pid)
    finally:
        S.stop(proc)
    size = len(httpx.Request("POST", url, json=body).read()) / 2**20
    print(f"{name:58s} body {size:5.2f} MiB -> HTTP {response.status_code}; peak RSS {before:7.0f} -> {after:7.0f} "
          f"MiB (+{after - before:.0f} MiB)", flush=True)


def main() -> None:
    token_file = Path(tempfile.mkdtemp()) / "token"
    token_file.write_text(secrets.token_urlsafe(16))
    four = _png_b64(4096)
    reward_body = {"prompts": ["a"] * 4, "metadata": [{"digit": 0}] * 4, "media": [{"format": "png", "data": four}] * 4}
    from flowforge.rewards.judge import protocol as P

    huge = "data:image/png;base64," + _png_b64(10_000)  # a group request of two 100-megapixel candidates
    content = P.build_content("rate each candidate", "a prompt", None, [[huge], [huge]], P.candidate_labels(2))
    judge_body = {"model": "brightness", "messages": [{"role": "user", "content": content}]}
    reward = ["reward", "--scorers", "digit"]
    judge = ["judge", "--scorer", "tests.serve.judge_support:Brightness", "--model-name", "brightness"]
    for budget, label in (([], "budget 32 Mi pixels (default)"), (["--max-request-mpixels", "100000"], "no budget")):
        _case(f"reward: 4 x 4096^2 PNG, {label}", reward + budget, "/score", reward_body, token_file)
        _case(f"judge: 2 x 100-megapixel PNG, {label}", judge + budget, "/v1/chat/completions", judge_body,
              token_file)


if __name__ == "__main__":
    main()
