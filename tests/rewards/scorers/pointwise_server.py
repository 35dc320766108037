"""A real OpenAI-compatible server on loopback for the pointwise VLM scorers' tests: flowforge's judge server
(:func:`flowforge.serve.judge_server.build_app`, bearer token, request log) served by uvicorn in a thread
(:func:`tests.rewards.loopback.serve`), in front of :class:`Answers`, a backend whose reply depends on the images it
was sent and on markers in the prompt text.

Markers (in the text of a request): ``MALFORMED`` (prose without a score), ``TWICE`` (two scores), ``OUT`` (a score
of 7), ``FAIL500`` (HTTP 500 every time), ``BUSY429`` (HTTP 429 on a request's first arrival, then an answer).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.rewards.loopback import TOKEN, serve


def images_and_text(messages: list[dict]) -> tuple[list, str]:
    """The decoded images (``[3, H, W]`` float32 each, in order) and the joined text of the first user message."""
    from flowforge.rewards.judge import protocol as P
    from flowforge.serve.judge_backends import first_user_content

    parts = first_user_content(messages)
    images = [P.decode_image_bytes(P.decode_data_url(p["image_url"]["url"])) for p in parts
              if p["type"] == "image_url"]
    return images, " ".join(p["text"] for p in parts if p["type"] == "text")


class Answers:
    """A judge backend: ``reply(images, text) -> str`` answers, changed by the markers of the module docstring; it
    keeps every request's messages (``seen``) and the logprobs a ``logprobs(images, text)`` callable gives (returned
    as the completion's ``logprobs`` when set)."""

    def __init__(self, reply: Callable[[list, str], str], model_id: str = "UnifiedReward") -> None:
        self.reply, self.model_id = reply, model_id
        self.seen: list[list[dict]] = []
        self._arrived: dict[str, int] = {}
        self._lock = threading.Lock()

    def complete(self, messages, *, max_tokens=None, temperature=0.0, seed=None):
        from flowforge.serve.judge_backends import BackendError, Completion

        images, text = images_and_text(messages)
        with self._lock:
            self.seen.append(messages)
            self._arrived[text] = self._arrived.get(text, 0) + 1
            first = self._arrived[text] == 1
        if "FAIL500" in text:
            raise BackendError(500, "scripted failure")
        if "BUSY429" in text and first:
            raise BackendError(429, "scripted rate limit")
        answer = self.reply(images, text)
        if "MALFORMED" in text:
            answer = "The image shows the caption well."
        elif "TWICE" in text:
            answer = f"{answer}\n{answer}"
        elif "OUT" in text:
            answer = "element (object): 1\nFinal Score: 7"
        return Completion(text=answer, prompt_tokens=len(images), completion_tokens=1)


@contextlib.contextmanager
def pointwise_server(backend, request_log: Path) -> Iterator[str]:
    """flowforge's judge server over ``backend`` (bearer :data:`~tests.rewards.loopback.TOKEN`, ``request_log``);
    yields its API root ``http://127.0.0.1:PORT/v1``."""
    from flowforge.serve.judge_server import build_app

    with serve(build_app(backend, TOKEN, request_log=request_log)) as url:
        yield url + "/v1"
