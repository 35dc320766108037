"""Test helpers for the judge server and client: a content-dependent scorer, a scripted backend served by a real
HTTP server built on :func:`flowforge.serve.judge_server.build_app`, a driver that scores groups through the ledger
(killed with SIGKILL mid-run by the resume test), a tiny random Qwen2-VL saved to disk, and subprocess handling.

Run as a module:

* ``python -m tests.serve.judge_support scripted --script FILE --token-file F --request-log L`` -- a judge server
  whose replies follow the behaviours queued in ``FILE`` (a JSON list, one popped per request; empty: correct);
* ``python -m tests.serve.judge_support drive --base-url URL --ledger DB --groups N [--kill-after K]
  [--kill-in-window K]`` -- score ``N`` fixed groups one by one with ``vlm_judge``; with ``--kill-after K`` the
  process SIGKILLs itself right after the ``K``-th request is recorded as finished; with ``--kill-in-window K`` right
  after the ``K``-th answer arrived, before the ledger records it (the window between send and record); at the end
  it prints the judge's metrics as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TOKEN_ENV = "FF_TEST_JUDGE_TOKEN"


class Brightness:
    """Mean pixel value per image (``[B]`` float32 in [0, 1]); with ``metadata["reference_media"]``, one minus the
    absolute difference to the reference's mean -- a score that depends on the image content only."""

    name = "brightness"
    needs_group = False

    def __init__(self, scale: float = 1.0) -> None:  # every score times ``scale``: shows an option arrived
        self.scale = float(scale)

    def __call__(self, media, prompts, metadata):
        mean = media.float().mean(dim=(1, 2, 3))
        refs = [m.get("reference_media") for m in metadata]
        if all(r is not None for r in refs) and refs:
            return self.scale * (1.0 - (mean - torch.stack([r.float().mean() for r in refs])).abs())
        return self.scale * mean


class FrameOrder:
    """A video scorer (``takes_video``) that checks what it was given: frame ``f`` of candidate ``c`` is expected to
    have red ``(f + 1) / 32`` (see :func:`ordered_video`) and green the candidate's level. Scores each candidate's
    mean green when its red rises from frame to frame (its frames came in temporal order), else 0."""

    name = "frame_order"
    needs_group = False
    takes_video = True

    def __call__(self, media, prompts, metadata):
        assert media.dim() == 5, f"a video scorer was given {tuple(media.shape)}"
        red = media[:, 0].float().mean(dim=(2, 3))  # [n, F]
        ordered = (red[:, 1:] - red[:, :-1] > 0.01).all(dim=1)
        return torch.where(ordered, media[:, 1].float().mean(dim=(1, 2, 3)), torch.zeros(len(media)))


def ordered_video(levels: list[float], frames: int, size: int = 16) -> torch.Tensor:
    """``[K, 3, F, H, W]``: candidate ``c``'s frame ``f`` is flat red ``(f + 1) / 32``, green ``levels[c]``."""
    video = torch.zeros(len(levels), 3, frames, size, size)
    for c, level in enumerate(levels):
        for f in range(frames):
            video[c, 0, f], video[c, 1, f], video[c, 2, f] = (f + 1) / 32, level, 0.5
    return video


# ------------------------------------------------------------------------------------------------ scripted backend

class ScriptedBackend:
    """Correct :class:`Brightness` group scores, changed by the next behaviour popped from a JSON file:
    ``ok``, ``malformed`` (prose), ``wrong_count`` (last label dropped), ``out_of_range`` (first score 150),
    ``extra_key`` (an extra key), ``nan`` (a NaN literal), ``fence`` (the JSON in a markdown code fence),
    ``sleep:S`` (answer correctly after S seconds), ``status:N`` (HTTP error N), ``not_json`` / ``no_choices`` (a 200
    whose body is an HTML page / a JSON object without choices, as a broken proxy sends: :class:`RawReplies`)."""

    model_id = "scripted"

    def __init__(self, script: Path) -> None:
        from flowforge.serve.judge_backends import ScorerBackend

        self.script = script
        self.inner = ScorerBackend(Brightness(), self.model_id)
        self._lock = threading.Lock()
        self.raw: bytes | None = None  # the body that replaces the reply being made (one request at a time)

    def take_raw(self) -> bytes | None:
        with self._lock:
            raw, self.raw = self.raw, None
        return raw

    def _next(self) -> str:
        with self._lock:
            queue = json.loads(self.script.read_text()) if self.script.exists() else []
            behaviour = queue.pop(0) if queue else "ok"
            self.script.write_text(json.dumps(queue))
        return behaviour

    def complete(self, messages, *, max_tokens=None, temperature=0.0, seed=None):
        from flowforge.rewards.judge.protocol import scores_reply
        from flowforge.serve.judge_backends import BackendError, Completion

        behaviour = self._next()
        scores = self.inner.scores(messages)
        labels = list(scores)
        if behaviour.startswith("sleep:"):
            time.sleep(float(behaviour.split(":")[1]))
        elif behaviour.startswith("status:"):
            raise BackendError(int(behaviour.split(":")[1]), f"scripted {behaviour}")
        elif behaviour in ("not_json", "no_choices"):  # the reply is replaced on its way out (RawReplies)
            with self._lock:
                self.raw = b"<html>upstream proxy page</html>" if behaviour == "not_json" else b'{"id": "x"}'
        text = {
            "malformed": lambda: f"I think candidate {labels[0]} is the best one.",
            "wrong_count": lambda: scores_reply({k: scores[k] for k in labels[:-1]}),
            "out_of_range": lambda: scores_reply({**scores, labels[0]: 150.0}),
            "extra_key": lambda: scores_reply({**scores, "best": 100.0}),
            "nan": lambda: "{" + ", ".join(f'"{k}": NaN' for k in labels) + "}",
            "fence": lambda: "```json\n" + scores_reply(scores) + "\n```",
        }.get(behaviour, lambda: scores_reply(scores))()
        return Completion(text=text, prompt_tokens=7, completion_tokens=len(labels))


class RawReplies:
    """ASGI middleware: a reply the backend marked raw (:meth:`ScriptedBackend.take_raw`) leaves as that body with
    status 200 instead of the chat completion the app made."""

    def __init__(self, app, backend: ScriptedBackend) -> None:
        self.app, self.backend = app, backend

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw: list[bytes | None] = [None]

        async def rewrite(message):
            if message["type"] == "http.response.start":
                raw[0] = self.backend.take_raw()
                if raw[0] is not None:
                    headers = [(k, v) for k, v in message["headers"] if k.lower() != b"content-length"]
                    message = {**message, "status": 200, "headers": [*headers, (b"content-length",
                                                                                str(len(raw[0])).encode())]}
            elif message["type"] == "http.response.body" and raw[0] is not None:
                message = {**message, "body": raw[0] if message.get("body") else b"", "more_body": False}
            await send(message)

        await self.app(scope, receive, rewrite)


def _scripted(args: argparse.Namespace) -> None:
    from flowforge.serve.common import resolve_token, serve_app
    from flowforge.serve.judge_server import build_app

    token = resolve_token(args.token_file, False, "127.0.0.1")
    backend = ScriptedBackend(Path(args.script))
    serve_app(RawReplies(build_app(backend, token, request_log=args.request_log), backend), "127.0.0.1", 0, "judge")


# ------------------------------------------------------------------------------------------------ groups + driver

def group(seed: int, k: int = 4, size: int = 16, frames: int | None = None):
    """One prompt's ``k`` candidates of distinct constant brightness (+ noise): ``(media, prompts, metadata)``."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randperm(k, generator=g).float() / k * 0.8 + 0.1
    shape = (k, 3, size, size) if frames is None else (k, 3, frames, size, size)
    noise = 0.02 * torch.randn(shape, generator=g)
    media = (levels.view(-1, *([1] * (len(shape) - 1))) + noise).clamp(0, 1)
    return media, [f"prompt {seed}"] * k, [{"sample_id": f"{seed}-{i}"} for i in range(k)]


def _drive(args: argparse.Namespace) -> None:
    from flowforge.rewards.judge.client import VLMJudge

    judge = VLMJudge(model=args.model, base_url=args.base_url, api_key_env=TOKEN_ENV, ledger=args.ledger,
                     max_concurrency=1, frames=1, max_side=64, timeout_s=30.0)
    ledger, count = judge.ledger, [0]
    if args.kill_after:
        finish = ledger.finish

        def finish_then_maybe_die(key, status, **kw):
            finish(key, status, **kw)
            count[0] += 1
            if count[0] == args.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

        ledger.finish = finish_then_maybe_die
    if args.kill_in_window:
        finish_answered = ledger.finish

        def die_before_recording(key, status, **kw):
            if kw.get("answered") is not None:
                count[0] += 1
                if count[0] == args.kill_in_window:  # the answer is here, the ledger does not know it yet
                    os.kill(os.getpid(), signal.SIGKILL)
            finish_answered(key, status, **kw)

        ledger.finish = die_before_recording
    for seed in range(args.groups):
        judge(*group(1000 + seed))
    print(json.dumps(judge.pop_metrics()), flush=True)


# ------------------------------------------------------------------------------------------------ tiny Qwen2-VL

def save_tiny_qwen2_vl(path: Path, extra_words: tuple[str, ...] = ()) -> Path:
    """A random-init Qwen2-VL (hidden size 16, one layer) and its processor, saved as a real checkpoint directory
    (``processor_class: Qwen2VLProcessor``, which transformers 5.x can load here only without its video part);
    ``extra_words``: words its word-level tokenizer knows besides the shared tiny vocabulary."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.models.tiny_families import QWEN_VISION_TOKENS, TinyQwen2VLProcessor, word_tokenizer

    torch.manual_seed(0)
    tok = word_tokenizer(4096, eos=False, pad="<|endoftext|>", extra_specials=QWEN_VISION_TOKENS,
                         extra_words=extra_words)
    ids = tok.convert_tokens_to_ids(list(QWEN_VISION_TOKENS))
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, rope_theta=10000.0,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=16, mlp_ratio=2, num_heads=2, in_channels=3,
                           patch_size=4, spatial_merge_size=1, temporal_patch_size=1),
        vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2], video_token_id=ids[3])
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(path)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
                "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 16, "longest_edge": 64 * 64}, patch_size=4,
                                               temporal_patch_size=1, merge_size=1)
    TinyQwen2VLProcessor(image_processor=image_processor, tokenizer=tok, chat_template=template).save_pretrained(path)
    config_file = path / "processor_config.json"
    config_file.write_text(config_file.read_text().replace('"TinyQwen2VLProcessor"', '"Qwen2VLProcessor"'))
    return path


# ------------------------------------------------------------------------------------------------ subprocesses

def start(args: list[str], *, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start ``python ARGS`` (cwd: the repo root, offline, one thread) and wait for its ``serving ... at URL`` line.

    Raises:
        RuntimeError: the process exited or printed no URL within ``timeout`` seconds (its stderr is included).
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = [line for line in lines if line.startswith("serving ") and " at http" in line]
        if ready:
            return proc, ready[0].rsplit(" at ", 1)[1].strip()
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop(proc)
    raise RuntimeError(f"server did not start: {''.join(lines)} {proc.stderr.read()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    """End a server this test started (SIGTERM, then SIGKILL after 10 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="judge_support")
    sub = parser.add_subparsers(dest="command", required=True)
    scripted = sub.add_parser("scripted")
    scripted.add_argument("--script", required=True)
    scripted.add_argument("--token-file", required=True)
    scripted.add_argument("--request-log", default=None)
    drive = sub.add_parser("drive")
    drive.add_argument("--base-url", required=True)
    drive.add_argument("--model", default="brightness")
    drive.add_argument("--ledger", required=True)
    drive.add_argument("--groups", type=int, required=True)
    drive.add_argument("--kill-after", type=int, default=0)
    drive.add_argument("--kill-in-window", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    (_scripted if args.command == "scripted" else _drive)(args)


if __name__ == "__main__":
    main()
