"""Test helpers for the student reward models: a tiny random Qwen2-VL whose tokenizer can write JSON scores, a real
judge request ledger filled by the ``vlm_judge`` client with a brightness teacher, and synthetic judged groups.

The tiny Qwen2-VL is :func:`tests.serve.judge_support.save_tiny_qwen2_vl`'s model (same config: hidden size 16,
one layer, patch 4, merge 1; the same processor and chat template) with a tokenizer that also has the characters of
a strict judge reply -- digits, capital labels, ``{ } " : , .`` -- and decodes by concatenation, so a generated
answer can parse. (The serve test's word tokenizer lower-cases and has no digits or braces.)
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

from flowforge.reward_model.data import JudgedGroup
from flowforge.rewards.judge import protocol as P
from tests.serve.judge_support import Brightness, group

JSON_WORDS = ["\n", "user", "assistant", "system", "Prompt", "Candidate", "Reference", "prompt", *string.digits,
              *string.ascii_uppercase, *"{}\":,."]
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")
INIT_RANGE = 0.5
"""Weight init std of the language model: at the default 0.02 the frozen LM head of a 16-wide model gives logits
within ~0.1 of each other, which no LoRA on the layers below can separate; 0.5 lets a LoRA overfit an answer."""


def json_tokenizer():
    """A word-level tokenizer: words, single digits and punctuation marks are tokens; decoding concatenates."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from tests.models.tiny_families import QWEN_VISION_TOKENS

    vocab = {tok: i for i, tok in enumerate(SPECIALS + JSON_WORDS + list(QWEN_VISION_TOKENS))}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.Punctuation(),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=4096, pad_token="<|endoftext|>",
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *QWEN_VISION_TOKENS]})
    return fast


THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>{{ m['role'] }}\n", "<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "<think>\n\n</think>\n\n{% endif %}").replace(
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n{% if enable_thinking is defined and "
    "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
"""A Qwen3-style template: a past answer is written after an empty think block; the generation prompt holds that
block only with ``enable_thinking=False`` (non-thinking mode); thinking mode leaves the model to open it."""


def save_tiny_json_qwen2_vl(path: Path, chat_template: str = CHAT_TEMPLATE) -> Path:
    """The tiny random Qwen2-VL of the judge-server tests with :func:`json_tokenizer` and ``chat_template``, saved as
    a checkpoint directory (``processor_class: Qwen2VLProcessor``)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.models.tiny_families import QWEN_VISION_TOKENS, TinyQwen2VLProcessor

    torch.manual_seed(0)
    tok = json_tokenizer()
    ids = tok.convert_tokens_to_ids(list(QWEN_VISION_TOKENS))
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, rope_theta=10000.0,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         initializer_range=INIT_RANGE),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=16, mlp_ratio=2, num_heads=2, in_channels=3,
                           patch_size=4, spatial_merge_size=1, temporal_patch_size=1),
        vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2], video_token_id=ids[3])
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 16, "longest_edge": 64 * 64}, patch_size=4,
                                               temporal_patch_size=1, merge_size=1)
    processor = TinyQwen2VLProcessor(image_processor=image_processor, tokenizer=tok, chat_template=chat_template)
    processor.save_pretrained(path)
    config_file = path / "processor_config.json"
    config_file.write_text(config_file.read_text().replace('"TinyQwen2VLProcessor"', '"Qwen2VLProcessor"'))
    return path


def overfit(student, groups, steps: int = 60, lr: float = 0.02) -> list[float]:
    """Fit a student (``vlm_json`` / ``scalar_head``: ``backward``, ``trainable_parameters``) on ``groups`` for
    ``steps`` AdamW steps (grad norm clipped at 1, seed 0), left in eval mode; the loss of each step."""
    optimizer = torch.optim.AdamW(student.trainable_parameters(), lr=lr, weight_decay=0.0)
    torch.manual_seed(0)
    losses = []
    for _ in range(steps):
        student.train()
        optimizer.zero_grad()
        losses.append(student.backward(groups)["loss"])
        torch.nn.utils.clip_grad_norm_(student.trainable_parameters(), 1.0)
        optimizer.step()
    student.eval()
    return losses


def judge_with_teacher(run_dir: Path, *, frames: int = 1, max_side: int = 16, seed: int = 0):
    """A real ``vlm_judge`` keeping its ledger and frames in ``run_dir``, whose HTTP call is answered in-process by
    the brightness teacher behind the judge server's scorer backend (the reply the server would send)."""
    from flowforge.rewards.judge.client import VLMJudge
    from flowforge.serve.judge_backends import ScorerBackend

    judge = VLMJudge(model="teacher", base_url="http://127.0.0.1:9/v1", api_key_env=None, run_dir=run_dir,
                     frames=frames, max_side=max_side, max_concurrency=1, seed=seed)
    backend = ScorerBackend(Brightness(), "teacher")

    def answer(messages):
        done = backend.complete(messages)
        return done.text, '{"stub": true}', (done.prompt_tokens, done.completion_tokens), 0.0

    judge._send = answer
    return judge


def judged_ledger(run_dir: Path, n_groups: int, *, k: int = 4, size: int = 16, prompts: int | None = None) -> Path:
    """Judge ``n_groups`` brightness groups (:func:`tests.serve.judge_support.group`) with the teacher; every
    candidate of group ``g`` has ``sample_id`` ``cond-<g mod prompts>`` and the prompt ``prompt <g mod prompts>``.
    Returns the ledger path."""
    judge = judge_with_teacher(run_dir)
    for g in range(n_groups):
        media, _, _ = group(2000 + g, k=k, size=size)
        cond = g % (prompts or n_groups)
        judge(media, [f"prompt {cond}"] * k, [{"sample_id": f"cond-{cond}"} for _ in range(k)])
    judge.close()
    return run_dir / "judge" / "ledger.sqlite"


def synthetic_groups(root: Path, n: int, *, k: int = 4, size: int = 16, seed: int = 0,
                     clusters: int | None = None) -> list[JudgedGroup]:
    """``n`` judged groups written straight to disk (no judge): candidate ``j`` is a noisy image of brightness
    ``b_j`` and the teacher score is ``b_j`` (a set a brightness-sensitive student can separate)."""
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(n):
        levels = torch.rand(k, generator=gen) * 0.8 + 0.1
        media = (levels.view(k, 1, 1, 1) + 0.05 * torch.randn(k, 3, size, size, generator=gen)).clamp(0, 1)
        paths, hashes = [], []
        for j in range(k):
            data = P.jpeg_bytes(media[j], size)
            digest = P.sha256_hex(data)
            path = root / f"{digest}.jpg"
            path.write_bytes(data)
            paths.append((str(path),))
            hashes.append((digest,))
        labels = tuple(P.candidate_labels(k))
        cluster = f"cl-{g % clusters}" if clusters else f"cl-{g}"
        groups.append(JudgedGroup(
            key=f"g{seed}-{g}", condition_id=f"cond-{g}", cluster=cluster, prompt=f"prompt {g}",
            instructions="Score the candidates.", labels=labels, permutation=tuple(range(k)),
            candidates=tuple(paths), scores=tuple(float(v) for v in levels), hashes=tuple(hashes)))
    return groups
