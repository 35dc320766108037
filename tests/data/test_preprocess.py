"""Prompt-encoding cache: the second call loads from disk without calling the encoder."""
import pytest
import torch

from flowforge.data.preprocess import encode_cached, prompts_fingerprint
from flowforge.models.base import Conditioning


class CountingEncoder:
    def __init__(self):
        self.calls = 0
        self.prompts_seen = 0

    def __call__(self, prompts):
        self.calls += 1
        self.prompts_seen += len(prompts)
        rows = [torch.Generator().manual_seed(sum(map(ord, p))) for p in prompts]
        embeds = torch.stack([torch.randn(4, 8, generator=g) for g in rows]).to(torch.bfloat16)
        pooled = torch.stack([torch.randn(6, generator=g) for g in rows]).to(torch.bfloat16)
        mask = torch.tensor([[1] * min(4, len(p)) + [0] * (4 - min(4, len(p))) for p in prompts])
        n = len(prompts)
        negative = Conditioning(torch.full((n, 4, 8), 0.5, dtype=torch.bfloat16),
                                torch.full((n, 6), -1.0, dtype=torch.bfloat16), torch.zeros(n, 4, dtype=torch.long))
        return Conditioning(embeds, pooled, mask, negative=negative)


def _equal(a: Conditioning, b: Conditioning):
    for name in ("prompt_embeds", "pooled", "mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    if a.negative is not None or b.negative is not None:
        _equal(a.negative, b.negative)


def test_cache_hit_skips_encoder_and_round_trips(tmp_path):
    prompts = ["a handwritten seven", "two", "a scanned 3", "two", "draw a nine"]
    enc = CountingEncoder()
    first = encode_cached(enc, "enc-v1", prompts, tmp_path, batch_size=2)
    assert enc.calls == 3 and enc.prompts_seen == 5
    _equal(first, enc(prompts))
    enc.calls = 0
    second = encode_cached(enc, "enc-v1", prompts, tmp_path, batch_size=2)
    assert enc.calls == 0
    _equal(first, second)
    assert (tmp_path / prompts_fingerprint("enc-v1", prompts) / "meta.json").is_file()


def test_key_depends_on_encoder_and_order(tmp_path):
    enc = CountingEncoder()
    encode_cached(enc, "enc-v1", ["a", "b"], tmp_path)
    encode_cached(enc, "enc-v2", ["a", "b"], tmp_path)
    reordered = encode_cached(enc, "enc-v1", ["b", "a"], tmp_path)
    assert enc.calls == 3  # three distinct keys, three misses
    _equal(reordered, enc(["b", "a"]))
    assert prompts_fingerprint("e", ["a", "b"]) != prompts_fingerprint("e", ["b", "a"])


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        encode_cached(CountingEncoder(), "e", [], tmp_path)
    with pytest.raises(ValueError, match="rows"):
        encode_cached(lambda ps: CountingEncoder()(ps[:1]), "e", ["a", "b"], tmp_path)
