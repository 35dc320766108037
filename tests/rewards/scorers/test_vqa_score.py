"""``vqa_score``: P("Yes") from a tiny random Qwen2-VL against t2v_metrics' own procedure (a one-token greedy
``generate`` with ``output_scores``, written here), and the server path through a real loopback server --
flowforge's judge server over the same model (``top_logprobs``) and over a scripted backend (malformed answers)."""

from __future__ import annotations

import math

import pytest
import torch

from flowforge.rewards.judge.ledger import RequestLedger
from flowforge.rewards.judge.protocol import read_request_log
from flowforge.rewards.registry import build_scorer
from flowforge.rewards.scorers.vqa_score import QUESTION
from tests.rewards.loopback import TOKEN, TOKEN_ENV
from tests.rewards.scorers.pointwise_server import images_and_text, pointwise_server
from tests.serve.judge_support import save_tiny_qwen2_vl

PROMPTS = ["a red circle", "two cats", "a blue square"]


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    """A tiny random Qwen2-VL whose tokenizer knows "yes" and "no"."""
    torch.set_num_threads(1)
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_vqa"), extra_words=("yes", "no"))


@pytest.fixture(scope="module")
def local(tiny_vl):
    return build_scorer("vqa_score", path=str(tiny_vl))


def images(seed=0, n=3, size=16):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_local_equals_t2v_metrics_procedure(local):
    media = images()
    got = local(media, PROMPTS, [{}] * 3)
    processor, model = local.processor, local.model
    ref = []
    for image, prompt in zip(media, PROMPTS, strict=True):
        from PIL import Image

        pil = Image.fromarray((image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())
        messages = [{"role": "user", "content": [{"type": "image", "image": pil},
                                                 {"type": "text", "text": QUESTION.format(prompt)}]}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[text], images=[pil], padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=1, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        yes = processor.tokenizer.encode("Yes", add_special_tokens=False)[0]
        ref.append(float(torch.softmax(out.scores[0], dim=-1)[0, yes]))
    diff = (got - torch.tensor(ref)).abs().max().item()
    print(f"vqa_score local vs t2v_metrics procedure: max abs diff {diff:.3g}")
    assert diff < 1e-6
    assert got.dtype == torch.float32 and ((got > 0) & (got < 1)).all()
    assert len(set(got.tolist())) == 3  # the probability follows the image and the prompt


def test_server_top_logprobs_equal_the_local_probability(tiny_vl, local, tmp_path, monkeypatch):
    from flowforge.serve.judge_backends import HFVisionLanguageBackend

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    backend = HFVisionLanguageBackend(tiny_vl, model_id="tiny-vl")
    with pointwise_server(backend, tmp_path / "requests.jsonl") as url:
        remote = build_scorer("vqa_score", base_url=url, model="tiny-vl", api_key_env=TOKEN_ENV, answer="yes",
                              ledger=str(tmp_path / "ledger.sqlite"), paid=False)
        media = images(1)
        got = remote(media, PROMPTS, [{}] * 3)
        want = local(media, PROMPTS, [{}] * 3)  # PNG: the server's model sees the pixels the local one does
        diff = (got - want).abs().max().item()
        print(f"vqa_score server (top_logprobs) vs local: max abs diff {diff:.3g}")
        assert diff < 1e-5
        remote(media, PROMPTS, [{}] * 3)
        assert len(read_request_log(tmp_path / "requests.jsonl")) == 3  # scored again from the ledger


class Listed:
    """A backend answering one token with ``top_logprobs``: " Yes" at the image's mean brightness and "No", or only
    "No" when the question contains NOYES; as text only (no logprobs) when it contains TEXTONLY. BOTH lists the exact
    "Yes" at the brightness and then " Yes" at a quarter of it; VARIANTS lists " Yes" at the brightness and then
    "Yes " at a quarter (no exact token)."""

    model_id = "listed"

    def complete(self, messages, *, max_tokens=None, temperature=0.0, seed=None, top_logprobs=None):
        from flowforge.serve.judge_backends import Completion

        pictures, text = images_and_text(messages)
        p = float(pictures[0].mean())
        top = [{"token": "No", "logprob": math.log(1 - p), "bytes": None}]
        spellings = {"BOTH": ("Yes", " Yes"), "VARIANTS": (" Yes", "Yes ")}
        likely, unlikely = next((v for k, v in spellings.items() if k in text), (" Yes", None))
        if "NOYES" not in text:
            top.append({"token": likely, "logprob": math.log(p), "bytes": None})
        if unlikely is not None:
            top.append({"token": unlikely, "logprob": math.log(p / 4), "bytes": None})
        logprobs = None if "TEXTONLY" in text else {"content": [{"token": "No", "logprob": top[0]["logprob"],
                                                                 "bytes": None, "top_logprobs": top}]}
        return Completion(text="No", prompt_tokens=1, completion_tokens=1, logprobs=logprobs)


def test_server_answers_without_the_answer_token_are_malformed(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    log = tmp_path / "requests.jsonl"
    with pointwise_server(Listed(), log) as url:
        score = build_scorer("vqa_score", base_url=url, model="listed", api_key_env=TOKEN_ENV,
                             ledger=str(tmp_path / "ledger.sqlite"))
        media = torch.stack([torch.full((3, 8, 8), 0.25), torch.full((3, 8, 8), 0.25), torch.full((3, 8, 8), 0.5)])
        out = score(media, ["fine", "NOYES", "TEXTONLY"], [{}] * 3)
        assert abs(float(out[0]) - 0.25) < 0.01 and math.isnan(float(out[1])) and math.isnan(float(out[2]))
        assert score.pop_metrics()["malformed"] == 2.0
        ledger = RequestLedger(tmp_path / "ledger.sqlite")
        assert sorted(e.status for e in ledger.entries()) == ["malformed", "malformed", "ok"]
        sent = read_request_log(log)
        score(media, ["fine", "NOYES", "TEXTONLY"], [{}] * 3)
        assert len(read_request_log(log)) == len(sent) == 3


def test_server_scores_the_exact_answer_token_before_a_spaced_variant(tmp_path, monkeypatch):
    """ "Yes" and " Yes" both listed: the exact token (t2v_metrics' ``tokenizer.encode("Yes")[0]``) is scored; only
    spaced variants listed: the likeliest of them. Found in review: the variants were merged and the last listed
    (the least likely) kept."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pointwise_server(Listed(), tmp_path / "requests.jsonl") as url:
        score = build_scorer("vqa_score", base_url=url, model="listed", api_key_env=TOKEN_ENV,
                             ledger=str(tmp_path / "ledger.sqlite"))
        out = score(torch.full((2, 3, 8, 8), 0.5), ["BOTH", "VARIANTS"], [{}] * 2)
        assert torch.allclose(out, torch.tensor([0.5, 0.5]), atol=0.01), out


def test_options(tiny_vl, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(ValueError, match="exactly one of"):
        build_scorer("vqa_score")
    with pytest.raises(ValueError, match="question_template"):
        build_scorer("vqa_score", path=str(tiny_vl), question_template="no placeholder")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        build_scorer("vqa_score", path=str(tiny_vl), answer="Maybe")
    with pytest.raises(ValueError, match="top_logprobs"):
        build_scorer("vqa_score", base_url="http://127.0.0.1:9/v1", model="m", api_key_env=TOKEN_ENV, top_logprobs=0)
