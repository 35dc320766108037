"""``edit_score`` against a real OpenAI-compatible server on loopback (flowforge's judge server, in a thread): the
official SC / PQ prompts and token layout, the source image taken from the edit's metadata, the official score
arithmetic, the strict JSON parse, and the ledger that never bills twice."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowforge.rewards.judge import protocol as P
from flowforge.rewards.judge.protocol import MalformedReply, read_request_log
from flowforge.rewards.registry import build_scorer
from flowforge.rewards.scorers.edit_score import parse_edit_reply
from tests.rewards.loopback import TOKEN, TOKEN_ENV
from tests.rewards.scorers.pointwise_server import Answers, pointwise_server

# editscore/vie_prompts.py at VectorSpaceLab/EditScore 6e0f1b9, typed from the file; EditScore.__init__ joins them
# with "\n" and replaces '10' by the score range
CONTEXT = ('You are a professional digital artist. You will have to evaluate the effectiveness of the AI-generated '
           'image(s) based on given rules.\nAll the input images are AI-generated. All human in the images are '
           'AI-generated too. so you need not worry about the privacy confidentials.\n\nIMPORTANT: You will have to '
           'give your output in this way (Keep your reasoning concise and short.):\n{\n"reasoning" : "...",\n'
           '"score" : [...]\n}\n')
PQ_TAIL = ("Put the score in a list such that output score = [naturalness, artifacts]\n")
SC_TAIL = "\nEditing instruction: make it red\n"
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def reply(images, text):
    """SC (two images): scores from the mean change between the images; PQ (one): from the brightness. On 0..25."""
    if len(images) == 2:
        change = float((images[1] - images[0]).abs().mean())
        return json.dumps({"reasoning": "edited", "score": [round(25 * min(1.0, 4 * change), 1), 20]})
    return json.dumps({"reasoning": "looks fine", "score": [round(25 * float(images[0].mean()), 1), 24]})


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    source = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(3))
    pixels = (source * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(pixels).save(tmp_path / "source.png")
    backend = Answers(lambda images, text: reply(images, text), model_id="EditScore-7B")
    log = tmp_path / "requests.jsonl"
    with pointwise_server(backend, log) as url:
        score = build_scorer("edit_score", model="EditScore-7B", base_url=url, api_key_env=TOKEN_ENV,
                             ledger=str(tmp_path / "ledger.sqlite"), reference_root=str(tmp_path))
        yield score, backend, log, torch.from_numpy(pixels).permute(2, 0, 1).float() / 255


def test_parse_edit_reply_is_strict():
    assert parse_edit_reply('{"reasoning": "ok", "score": [12, 25]}') == [12.0, 25.0]
    assert parse_edit_reply('```json\n{"reasoning": "ok", "score": [0, 3.5]}\n```') == [0.0, 3.5]
    for bad in ("", None, "score: [3, 4]", '{"reasoning": "x", "score": [3]}', '{"reasoning": "x", "score": [3, 30]}',
                '{"reasoning": "x", "score": [3, 4], "extra": 1}', '{"score": [3, 4]}', "[3, 4]",
                '{"reasoning": "x", "score": [true, 4]}', 'Sure! {"reasoning": "x", "score": [3, 4]}'):
        with pytest.raises(MalformedReply):
            parse_edit_reply(bad)


def test_official_prompts_layout_and_score(setup):
    score, backend, log, source = setup
    edited = source.clone()
    edited[0] = 1.0  # "make it red"
    out = score(edited[None], ["make it red"], [{"image": "source.png", "sample_id": "s0"}])
    sc_msg, pq_msg = sorted(backend.seen, key=lambda m: -len(m[0]["content"]))
    sc_parts, pq_parts = sc_msg[0]["content"], pq_msg[0]["content"]

    def rendered(parts):  # what Qwen2.5-VL's chat template makes of the user message's parts
        return "".join(p["text"] if p["type"] == "text" else QWEN_IMAGE for p in parts)

    sc_text, pq_text = sc_parts[-1]["text"], pq_parts[-1]["text"]
    assert rendered(sc_parts) == f"<img1>: {QWEN_IMAGE}<img2>: {QWEN_IMAGE}{sc_text}"  # the official layout
    assert rendered(pq_parts) == f"<img1>: {QWEN_IMAGE}{pq_text}"
    assert sc_text.startswith(CONTEXT + "\nRULES:\n\nTwo images will be provided") and sc_text.endswith(SC_TAIL)
    assert "From scale 0 to 25: " in sc_text and "10" not in sc_text  # every '10' became the score range
    assert pq_text.startswith(CONTEXT + "\nRULES:\n\nThe image is an AI-generated image.") and pq_text.endswith(PQ_TAIL)
    assert "    25 indicates the image has no artifacts.\n" in pq_text
    sent_source = P.decode_image_bytes(P.decode_data_url(sc_parts[1]["image_url"]["url"]))
    sent_edit = P.decode_image_bytes(P.decode_data_url(sc_parts[3]["image_url"]["url"]))
    diff = (sent_source - source).abs().max().item()
    print(f"edit_score: source image as sent (PNG) vs the file's pixels: max abs diff {diff:.3g}")
    assert diff == 0 and torch.equal(sent_edit, (edited * 255).round() / 255)
    sc = min(json.loads(reply([sent_source, sent_edit], ""))["score"])
    pq = min(json.loads(reply([sent_edit], ""))["score"])
    assert abs(float(out[0]) - math.sqrt(sc * 10 / 25 * pq * 10 / 25)) < 1e-5


def test_shared_requests_malformed_and_missing_source(setup):
    score, _, log, source = setup
    media = torch.stack([source.flip(-1), source.flip(-1)])
    meta = [{"image": "source.png"}, {"image": "source.png"}]
    out = score(media, ["flip it", "MALFORMED mirror it"], meta)
    # the PQ request (the edited image alone) is the same for both samples: asked once; the malformed SC is NaN
    assert len(read_request_log(log)) == 3
    assert not math.isnan(float(out[0])) and math.isnan(float(out[1]))
    assert score.pop_metrics()["malformed"] == 1.0
    score(media, ["flip it", "MALFORMED mirror it"], meta)
    assert len(read_request_log(log)) == 3  # a rerun is served from the ledger
    with pytest.raises(ValueError, match="metadata.image"):
        score(media[:1], ["flip it"], [{}])


def test_options(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    common = dict(model="m", base_url="http://127.0.0.1:9/v1", api_key_env=TOKEN_ENV)
    for bad in (dict(score_range=0), dict(top_p=0.0), dict(top_k=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            build_scorer("edit_score", **common, **bad)
    assert "top_k" not in build_scorer("edit_score", **common, top_k=None).extra_body()
