"""``flowforge serve reward`` as a real subprocess on loopback: auth, limits, clear 4xx answers, exact scores."""

import base64
import io
import json
import stat

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from flowforge.cli import main as cli_main
from flowforge.rewards.wire import encode_image, encode_images
from flowforge.rewards.registry import build_scorer
from flowforge.serve.common import is_loopback, resolve_token, server_url
from tests.serve.server import post_declared_only, reward_server

SCORERS = "digit,jpeg_compressibility,tests.serve.scorers:NotApplicable"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # one torch thread in the server and in the in-process comparison: a conv's float sums depend on the thread
    # count, and the test worker's count depends on which test files ran before it in that process
    with reward_server(SCORERS, "--max-batch", "8", "--max-body-mb", "0.25", "--num-threads", "1",
                       token_dir=tmp_path_factory.mktemp("token")) as (url, token):
        yield url, {"Authorization": f"Bearer {token}"}


def _media(n, seed=0, size=32):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _body(media, digits=None, **extra):
    digits = digits if digits is not None else [i % 10 for i in range(media.shape[0])]
    return {"prompts": [f"the number {d}" for d in digits], "metadata": [{"digit": d} for d in digits],
            "media": encode_images(media), **extra}


def _jpeg_item(image):
    buffer = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buffer, format="JPEG", quality=90)
    return {"format": "jpeg", "data": base64.b64encode(buffer.getvalue()).decode()}


def test_health_lists_scorers_versions_and_limits_without_the_token(server):
    """Issue 43 item 8: /health answers without the token, like the judge's, and holds nothing secret."""
    url, auth = server
    response = httpx.get(f"{url}/health")
    assert response.status_code == 200
    health = response.json()
    assert auth["Authorization"].split()[1] not in response.text
    assert set(health) == {"status", "scorers", "versions", "limits"}
    assert health["status"] == "ok"
    assert sorted(health["scorers"]) == sorted(SCORERS.split(","))
    assert health["scorers"]["digit"] == {"needs_group": False,
                                          "class": "flowforge.rewards.scorers.digit:DigitScorer"}
    assert {"flowforge", "torch", "python"} <= set(health["versions"])
    assert health["limits"]["max_batch"] == 8 and health["limits"]["max_bytes"] == int(0.25 * 2**20)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"},
                                     {"Authorization": "Bearer"}])
def test_requests_without_the_token_get_401(server, headers):
    url, _ = server
    response = httpx.post(f"{url}/score", json=_body(_media(2)), headers=headers)
    assert response.status_code == 401
    assert "bearer token" in response.json()["detail"]
    assert response.headers["www-authenticate"] == "Bearer"


_IN_PROCESS = """
import sys, torch
from flowforge.rewards.registry import build_scorer
torch.set_num_threads(1)
data = torch.load(sys.argv[1])
out = {name: build_scorer(name)(data["media"], data["prompts"], data["metadata"])
       for name in ("digit", "jpeg_compressibility")}
torch.save(out, sys.argv[2])
"""


def _in_process_scores(media, body, tmp_path):
    """The scorers called in-process, in a fresh interpreter: the test worker's own floating-point state depends on
    which test files ran in it before (a library loaded earlier may set the CPU's denormal flags), the server's and a
    fresh process's do not."""
    import subprocess
    import sys

    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"media": media, "prompts": body["prompts"], "metadata": body["metadata"]}, src)
    subprocess.run([sys.executable, "-c", _IN_PROCESS, str(src), str(dst)], check=True, timeout=300)
    return torch.load(dst)


def test_scores_equal_in_process_scores_bit_for_bit(server, tmp_path):
    url, auth = server
    floats = _media(6, seed=1)  # off the byte grid: sent as float32
    on_grid = (floats * 255).round() / 255  # exactly representable: sent as PNG
    assert [i["format"] for i in encode_images(floats)] == ["float32"] * 6
    assert [i["format"] for i in encode_images(on_grid)] == ["png"] * 6
    for media in (floats, on_grid):
        body = _body(media, components=["digit", "jpeg_compressibility"])
        scores = httpx.post(f"{url}/score", json=body, headers=auth).json()["scores"]
        expected = _in_process_scores(media, body, tmp_path)
        for name in ("digit", "jpeg_compressibility"):
            assert torch.equal(torch.tensor(scores[name], dtype=torch.float32), expected[name]), name


def test_jpeg_media_and_videos_as_frame_lists(server):
    url, auth = server
    pixels = (np.random.default_rng(0).random((2, 32, 32, 3)) * 255).astype(np.uint8)
    body = {"prompts": ["a", "b"], "metadata": [{"digit": 1}, {"digit": 2}],
            "media": [_jpeg_item(p) for p in pixels], "components": ["digit"]}
    scores = httpx.post(f"{url}/score", json=body, headers=auth).json()["scores"]["digit"]
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)
    # a video is scored frame by frame and each component averaged over its frames, as the trainer does
    frames = _media(6, seed=2).view(2, 3, 3, 32, 32)  # 2 videos x 3 frames
    videos = [{"frames": encode_images(clip)} for clip in frames]
    body = {"prompts": ["a", "b"], "metadata": [{"digit": 3}, {"digit": 4}], "media": videos,
            "components": ["digit"]}
    scores = torch.tensor(httpx.post(f"{url}/score", json=body, headers=auth).json()["scores"]["digit"])
    per_frame = build_scorer("digit")(frames.flatten(0, 1), ["a"] * 3 + ["b"] * 3,
                                      [{"digit": 3}] * 3 + [{"digit": 4}] * 3)
    assert torch.equal(scores, per_frame.view(2, 3).mean(1))


def test_not_applicable_scores_come_back_as_null(server):
    url, auth = server
    body = {"prompts": ["a", "b"], "metadata": [{"score": 0.25}, {}], "media": encode_images(_media(2)),
            "components": ["tests.serve.scorers:NotApplicable"]}
    response = httpx.post(f"{url}/score", json=body, headers=auth)
    assert response.json()["scores"] == {"tests.serve.scorers:NotApplicable": [0.25, None]}


def test_oversized_requests_get_413_with_a_message(server):
    url, auth = server
    big = json.dumps(_body(_media(8, size=64))).encode()  # 8 x float32 64x64x3 ~ 520 kB of base64 > 0.25 MiB
    status, detail = post_declared_only(f"{url}/score", len(big), auth)  # refused from its Content-Length
    assert status == 413 and "exceeds the limit of 262144 bytes" in detail["detail"]
    response = httpx.post(f"{url}/score", json=_body((_media(9, size=4) * 255).round() / 255), headers=auth)
    assert response.status_code == 413 and "9 media items exceed the batch limit of 8" in response.json()["detail"]
    chunks = iter([b"[" + b" " * 200_000] * 2)  # no Content-Length: refused once the streamed body passes the limit
    response = httpx.post(f"{url}/score", content=chunks, headers={**auth, "content-type": "application/json"})
    assert response.status_code == 413 and "streamed" in response.json()["detail"]


def _malformed_cases():
    good = _body(_media(2))
    png = encode_image(_media(1)[0], "png")
    float_item = encode_image(_media(1)[0], "float32")
    return [
        ("not json", b"{not json", "JSON decode error"),
        ("missing media", {"prompts": ["a"]}, "body/media: Field required"),
        ("extra key", {**good, "temperature": 1}, "body/temperature: Extra inputs are not permitted"),
        ("unknown format", {**good, "media": [{"format": "gif", "data": "AAAA"}] * 2}, "format"),
        ("bad base64", {**good, "media": [{"format": "png", "data": "@@@"}] * 2}, "media[0]: data is not valid base64"),
        ("mislabelled", {**good, "media": [{**png, "format": "jpeg"}] * 2},
         "media[0]: declared jpeg but the bytes are PNG"),
        ("not an image", {**good, "media": [{"format": "png", "data": "AAAA"}] * 2}, "media[0]: not a decodable png"),
        ("float32 length", {**good, "media": [{**float_item, "shape": [3, 32, 31]}] * 2},
         "do not hold float32 values of shape [3, 32, 31]"),
        ("float32 shape", {**good, "media": [{**float_item, "shape": [1, 32, 32]}] * 2}, "needs shape [3, H, W]"),
        ("lengths", {**good, "prompts": ["a"]}, "prompts (1), metadata (2) and media (2) must have one entry"),
        ("unknown component", {**good, "components": ["pickscore"]}, "unknown components ['pickscore']"),
        ("sizes differ", {**good, "media": [png, encode_image(_media(1, size=16)[0], "png")]},
         "every item must have one shape"),
        ("images and videos", {**good, "media": [png, {"frames": [png]}]}, "mixes images and videos"),
        ("empty video", {**good, "media": [{"frames": []}] * 2}, "frames"),
        ("scorer rejects", {**good, "metadata": [{}, {}], "prompts": ["a cat", "a dog"], "components": ["digit"]},
         "component 'digit' rejected the request: sample 0: metadata has no 'digit' key and prompt 'a cat' names "
         "no digit"),
    ]


@pytest.mark.parametrize("case", _malformed_cases(), ids=lambda c: c[0])
def test_malformed_payloads_get_422_with_a_clear_message(server, case):
    url, auth = server
    _, body, message = case
    if isinstance(body, bytes):
        response = httpx.post(f"{url}/score", content=body, headers={**auth, "content-type": "application/json"})
    else:
        response = httpx.post(f"{url}/score", json=body, headers=auth)
    assert response.status_code == 422, response.text
    assert message in response.json()["detail"], response.json()["detail"]


def test_no_auth_is_refused_on_a_non_loopback_host(capsys, tmp_path):
    assert cli_main(["serve", "reward", "--scorers", "digit", "--host", "0.0.0.0", "--no-auth"]) == 2
    assert "--no-auth is refused on the non-loopback host '0.0.0.0'" in capsys.readouterr().err
    token_file = tmp_path / "token"
    token_file.write_text("  \n")
    assert cli_main(["serve", "reward", "--scorers", "digit", "--token-file", str(token_file)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_no_auth_server_on_loopback_answers_without_a_token(tmp_path):
    with reward_server("jpeg_compressibility", token_dir=tmp_path, no_auth=True) as (url, token):
        assert token is None
        media = (_media(2) * 255).round() / 255
        response = httpx.post(f"{url}/score", json={"prompts": ["a", "b"], "media": encode_images(media)})
        assert response.status_code == 200
        expected = build_scorer("jpeg_compressibility")(media, ["a", "b"], [{}, {}])
        assert torch.equal(torch.tensor(response.json()["scores"]["jpeg_compressibility"]), expected)


def test_common_loopback_url_and_token_rules(tmp_path, capsys):
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.4", "example.org"))
    assert server_url("127.0.0.1", 80) == "http://127.0.0.1:80" and server_url("::1", 8) == "http://[::1]:8"
    assert resolve_token(None, True, "127.0.0.1") is None
    generated = resolve_token(None, False, "0.0.0.0")
    assert len(generated) >= 32 and generated in capsys.readouterr().err
    (tmp_path / "t").write_text("s3cret\n")
    assert resolve_token(tmp_path / "t", False, "0.0.0.0") == "s3cret"
    with pytest.raises(ValueError, match="contradict"):
        resolve_token(tmp_path / "t", True, "127.0.0.1")
    with pytest.raises(ValueError, match="non-loopback"):
        resolve_token(None, True, "10.0.0.1")


def test_a_missing_token_file_is_created_and_an_existing_one_read(tmp_path):
    """Issue 43 item 8: ``--token-file F`` with no F creates it (a fresh token, mode 0600) and says where; the judge
    server started on the now existing F reads the same token and leaves the file as it was."""
    from tests.serve import judge_support as S

    token_file = tmp_path / "token"
    with reward_server("jpeg_compressibility", token_dir=tmp_path, token_file=token_file) as (url, token):
        assert len(token) >= 32 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        media = (_media(2) * 255).round() / 255
        body = {"prompts": ["a", "b"], "media": encode_images(media)}
        assert httpx.post(f"{url}/score", json=body).status_code == 401
        assert httpx.post(f"{url}/score", json=body, headers={"Authorization": f"Bearer {token}"}).status_code == 200
    before = token_file.read_bytes()
    proc, url = S.start(["-m", "flowforge.cli", "serve", "judge", "--scorer", "jpeg_compressibility", "--port", "0",
                         "--token-file", str(token_file), "--num-threads", "1"])
    try:
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer other"}).status_code == 401
    finally:
        S.stop(proc)
    assert token_file.read_bytes() == before


def test_token_file_creation_rules(tmp_path, capsys):
    created = resolve_token(tmp_path / "new", False, "127.0.0.1")
    err = capsys.readouterr().err
    assert f"bearer token written to {tmp_path / 'new'}" in err and created not in err  # the path, not the token
    assert (tmp_path / "new").read_text() == created + "\n"
    # a dangling symlink is never written through: its missing target is an error naming the path (exit 2)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError):
        resolve_token(tmp_path / "link", False, "127.0.0.1")
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(FileNotFoundError):  # its directory is not made either
        resolve_token(tmp_path / "no_dir" / "token", False, "127.0.0.1")
    # the judge's request log may not be the token file it is about to create
    same = str(tmp_path / "same")
    assert cli_main(["serve", "judge", "--scorer", "digit", "--token-file", same, "--request-log", same]) == 2
    assert "--request-log" in capsys.readouterr().err and not (tmp_path / "same").exists()


def _big_png_b64(side):
    buffer = io.BytesIO()
    Image.new("RGB", (side, side)).save(buffer, format="PNG")  # one colour: a few kB for millions of pixels
    return base64.b64encode(buffer.getvalue()).decode()


def test_pixel_budget_nesting_and_docs(server):
    """Issue 24 item 3: 4 x 4096^2 PNGs in a small body are refused from their headers (413, nothing decoded); a
    deeply nested body is a 400, not a 500 RecursionError; /docs and /openapi.json are not served."""
    url, auth = server
    png = {"format": "png", "data": _big_png_b64(4096)}
    body = {"prompts": ["a"] * 4, "metadata": [{"digit": 0}] * 4, "media": [png] * 4}
    response = httpx.post(f"{url}/score", json=body, headers=auth)
    assert response.status_code == 413 and "over the limit of 33554432 per request" in response.json()["detail"]
    video = {"prompts": ["a"], "metadata": [{"digit": 0}], "media": [{"frames": [png] * 3}]}
    assert httpx.post(f"{url}/score", json=video, headers=auth).status_code == 413
    deep = b'{"prompts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = httpx.post(f"{url}/score", content=deep, headers={**auth, "content-type": "application/json"})
    assert response.status_code == 400 and "levels deep, over the limit of 64" in response.json()["detail"]
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(f"{url}{path}", headers=auth).status_code == 404
        assert httpx.get(f"{url}{path}").status_code in (401, 404)
    ok = {"prompts": ["a"], "metadata": [{"digit": 0}], "media": [{"format": "png", "data": _big_png_b64(64)}]}
    assert httpx.post(f"{url}/score", json=ok, headers=auth).status_code == 200
