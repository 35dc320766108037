"""A tiny random-init CLAP (transformers ``ClapModel`` + ``ClapProcessor``) saved offline for the ``clap`` scorer
tests: a small ``ClapConfig`` (HTSAT audio tower with 2 stages, 2-layer RoBERTa text tower), a byte-level BPE
tokenizer written from scratch (byte alphabet, RoBERTa's special tokens, no merges), and the feature extractor at
CLAP's 48 kHz with a 1 s window (real checkpoints: 10 s)."""

from __future__ import annotations

import json

import torch

PROJECTION = 16
MAX_LENGTH_S = 1
MEL_BINS = 16  # with spec_size 64: freq_ratio 4, a 256-frame window (1 s at 48 kHz: 101 frames)


def build_clap_dir(root):
    """The directory of a tiny ``ClapModel`` and its ``ClapProcessor`` (``save_pretrained``) under ``root``."""
    from tokenizers import pre_tokenizers
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor, RobertaTokenizer

    path = root / "clap"
    path.mkdir()
    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>"])}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    vocab["<mask>"] = len(vocab)
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = RobertaTokenizer(str(root / "vocab.json"), str(root / "merges.txt"), model_max_length=30)
    assert len(tokenizer) == 261, len(tokenizer)
    features = ClapFeatureExtractor(feature_size=MEL_BINS, max_length_s=MAX_LENGTH_S, truncation="rand_trunc",
                                    padding="repeatpad")
    ClapProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(str(path))
    config = ClapConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=32, projection_dim=PROJECTION,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        audio_config=dict(spec_size=64, num_mel_bins=MEL_BINS, window_size=4, patch_size=4, patch_stride=(4, 4),
                          depths=[1, 1], num_attention_heads=[2, 2], patch_embeds_hidden_size=16, hidden_size=32,
                          projection_dim=PROJECTION, hidden_dropout_prob=0.0),
        projection_dim=PROJECTION,
    )
    torch.manual_seed(0)
    ClapModel(config).eval().save_pretrained(str(path))
    return path
