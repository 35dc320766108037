"""``flowforge serve judge``'s per-request limits (issue 24 item 3), on a real server subprocess on loopback: a
pixel budget read from the image headers, a nesting limit before JSON parsing, no unauthenticated docs routes."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from tests.serve import judge_support as S

TOKEN = "judge-limits-token"


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    proc, url = S.start(["-m", "flowforge.cli", "serve", "judge", "--scorer", "tests.serve.judge_support:Brightness",
                         "--model-name", "brightness", "--port", "0", "--token-file", str(token_file),
                         "--max-body-mb", "1", "--num-threads", "1"])
    yield url, {"Authorization": f"Bearer {TOKEN}"}
    S.stop(proc)


def _data_url(width, height):
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")  # one colour: compresses to almost nothing
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(*urls):
    parts = [{"type": "text", "text": "rate"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "brightness", "messages": [{"role": "user", "content": parts}]}


def test_two_100_megapixel_pngs_in_a_small_body_are_refused_from_their_headers(judge):
    url, auth = judge
    huge = _data_url(10_000, 10_000)  # 100 megapixels; decoding both would take ~6 GB as float32
    body = _chat(huge, huge)
    assert len(httpx.Request("POST", url, json=body).read()) < 2**20
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=60)
    assert response.status_code == 413, response.text
    assert "decode to 200000000 pixels, over the limit of 33554432" in response.json()["error"]["message"]


def test_deep_nesting_is_a_400_and_docs_are_not_served(judge):
    url, auth = judge
    deep = b'{"model": "brightness", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    response = httpx.post(f"{url}/v1/chat/completions", content=deep, headers=auth)
    assert response.status_code == 400 and "levels deep, over the limit of 64" in response.json()["error"]["message"]
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(f"{url}{path}").status_code == 401  # no route is served before the token
        assert httpx.get(f"{url}{path}", headers=auth).status_code == 404
