"""``flowforge serve judge --scorer digit`` answered through the ``openai`` SDK, as any OpenAI-compatible client
would call it (issue 27 item 3): a real server subprocess on loopback (a free port, a bearer token), the group layout
of ``docs/judge_server.md`` built by hand from real held-out digits, and errors in OpenAI's shape, so the SDK's
exception carries the server's message, ``code`` and ``param``."""

from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest
import torch

from flowforge.demo.data import load_split
from flowforge.rewards.judge import protocol as P
from flowforge.rewards.scorers.digit import DigitScorer
from tests.serve import judge_support as S

TOKEN = "judge-openai-token"


@pytest.fixture(scope="module")
def digit_judge(tmp_path_factory):
    """``(client, base URL)`` of ``serve judge --scorer digit``."""
    token = tmp_path_factory.mktemp("auth") / "token"
    token.write_text(TOKEN + "\n")
    proc, url = S.start(["-m", "flowforge.cli", "serve", "judge", "--scorer", "digit", "--port", "0",
                         "--token-file", str(token), "--num-threads", "1"])
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=60), url
    finally:
        S.stop(proc)


def _digits(wanted: list[int]) -> torch.Tensor:
    """``[n, 3, 32, 32]``: the first held-out ``eval_clf`` image of each wanted digit, grey replicated to RGB."""
    images, labels = load_split("eval_clf")
    return torch.stack([images[int((labels == d).nonzero()[0])].expand(3, -1, -1) for d in wanted])


def _group_content(prompt: str, media: torch.Tensor) -> tuple[list[dict], list[str], list[bytes]]:
    """The user message of one group (docs/judge_server.md): instructions, ``Prompt: ...``, then ``Candidate X:``
    and its image per candidate. Returns ``(content, labels, each candidate's JPEG bytes)``."""
    labels = P.candidate_labels(len(media))
    jpegs = [P.encode_media(m, 1, max_side=64)[0] for m in media]
    instructions = P.JudgeTemplate.load().render(prompt, labels, 1, False)
    content = P.build_content(instructions, prompt, None, [[P.data_url(j)] for j in jpegs], labels)
    return content, labels, jpegs


def test_the_digit_judge_scores_the_prompted_digit_through_the_openai_client(digit_judge):
    client, _ = digit_judge
    prompt = "a handwritten seven"  # no metadata travels: the digit comes from the prompt, as the reward reads it
    content, labels, jpegs = _group_content(prompt, _digits([7, 7, 1, 3]))
    completion = client.chat.completions.create(model="digit", messages=[{"role": "user", "content": content}])
    scores = P.parse_scores(completion.choices[0].message.content, labels)  # in [0, 1]
    # exactly the digit reward of the frames the server received (the JPEGs), given the digit in metadata
    received = torch.stack([P.decode_image_bytes(j) for j in jpegs])
    expected = DigitScorer()(received, [prompt] * 4, [{"digit": 7}] * 4)
    torch.testing.assert_close(torch.tensor(scores), expected, atol=1e-6, rtol=0)
    assert min(scores[:2]) > 0.5 > max(scores[2:]), scores  # the two sevens beat the 1 and the 3
    assert completion.usage.prompt_tokens == 4 and completion.usage.completion_tokens == 4
    assert [m.id for m in client.models.list().data] == ["digit"]


def test_errors_reach_the_openai_exception_with_their_message(digit_judge):
    client, url = digit_judge
    content, _, _ = _group_content("a picture of a cat", _digits([7, 1]))
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.chat.completions.create(model="digit", messages=[{"role": "user", "content": content}])
    exc = caught.value
    assert exc.status_code == 422 and exc.code == "invalid_request" and exc.param == "messages"
    assert "prompt 'a picture of a cat' names no digit" in exc.body["message"], exc.body
    assert "names no digit" in str(exc)
    assert exc.body["type"] == "invalid_request_error"

    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": content}])
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    assert "unknown model 'gpt-9'; this server serves 'digit'" in caught.value.body["message"]

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="digit", n=2, messages=[{"role": "user", "content": content}])
    assert caught.value.code == "unsupported_parameter" and caught.value.param == "n"

    wrong = openai.OpenAI(base_url=url + "/v1", api_key="not-the-token", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.code == "invalid_api_key" and "bearer token" in caught.value.body["message"]


def test_a_scorer_that_needs_metadata_a_judge_request_lacks_is_refused_at_start_up():
    """world_psnr reads the real clip from a file named in the prompt row's metadata: no judge request has it."""
    proc = subprocess.run([sys.executable, "-m", "flowforge.cli", "serve", "judge", "--scorer", "world_psnr",
                           "--port", "0", "--no-auth"], cwd=S.ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(S.ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "scorer 'world_psnr'" in lines[0] and "['real_clip', 'image']" in lines[0], proc.stderr
    assert "docs/judge_server.md" in lines[0] and "serving" not in proc.stdout
