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


def test_concurrent_misses_keep_one_entry_and_delete_nothing(tmp_path):
    """Two runs that start together both miss: the first rename wins, the second drops its copy (it used to delete
    the first's entry while that run could be reading it)."""
    import threading

    barrier = threading.Barrier(2)

    def encoder(prompts):
        barrier.wait(timeout=30)  # both have missed before either writes
        return CountingEncoder()(prompts)

    prompts = ["a", "b", "c"]
    results, errors = [], []

    def run():
        try:
            results.append(encode_cached(encoder, "enc-v1", prompts, tmp_path))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 2
    _equal(results[0], results[1])
    entry = tmp_path / prompts_fingerprint("enc-v1", prompts)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [entry.name]
    meta = (entry / "meta.json").stat()
    from flowforge.data.preprocess import save_conditioning

    save_conditioning(CountingEncoder()(prompts), entry, encoder_id="enc-v1", prompts=prompts)
    assert (entry / "meta.json").stat().st_ino == meta.st_ino  # the existing entry is kept, not rewritten


def test_foreign_directory_is_left_alone(tmp_path):
    from flowforge.data.preprocess import save_conditioning

    entry = tmp_path / prompts_fingerprint("enc-v1", ["a"])
    entry.mkdir()
    (entry / "mine.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="meta.json"):
        save_conditioning(CountingEncoder()(["a"]), entry, encoder_id="enc-v1", prompts=["a"])
    assert [p.name for p in entry.iterdir()] == ["mine.txt"] and (entry / "mine.txt").read_text() == "user data"
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [entry.name]  # no tmp left


class PaddedEncoder(CountingEncoder):
    """Like a padded text encoder: each row's output moves in the last bits with the batch it is encoded in."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def __call__(self, prompts):
        self.batches.append(list(prompts))
        cond = super().__call__(prompts)
        longest = max(map(len, prompts))
        embeds = (cond.prompt_embeds.float() + 0.05 * longest).to(torch.bfloat16)
        return Conditioning(embeds, cond.pooled, cond.mask, negative=cond.negative)


def test_short_lists_are_encoded_up_front_as_before_and_long_ones_streamed(tmp_path):
    from flowforge.data.preprocess import STREAM_ABOVE, StreamedConditioning, encode_prompts

    short = [f"prompt {i}" for i in range(STREAM_ABOVE)]
    enc = PaddedEncoder()
    cond = encode_prompts(enc, "e", short, tmp_path)
    assert isinstance(cond, Conditioning) and [len(b) for b in enc.batches] == [64] * (STREAM_ABOVE // 64)
    _equal(cond, encode_cached(PaddedEncoder(), "e", short, tmp_path / "other", batch_size=64))  # the same entry
    enc = PaddedEncoder()
    streamed = encode_prompts(enc, "e", [*short, "one more"], tmp_path)
    assert isinstance(streamed, StreamedConditioning) and enc.batches == []  # nothing encoded up front


def test_streamed_rows_are_encoded_alone_once_and_the_same_bits_however_they_are_drawn(tmp_path):
    from flowforge.data.preprocess import StreamedConditioning

    prompts = [f"p{i}" + "x" * (i % 7) for i in range(1000)]
    enc = PaddedEncoder()
    cond = StreamedConditioning(enc, "e", prompts, tmp_path)
    rows = cond.index(torch.tensor([5, 2, 5, 900]))
    assert enc.batches == [[prompts[2]], [prompts[5]], [prompts[900]]]  # only the rows drawn, one prompt a call
    _equal(rows, Conditioning.cat([PaddedEncoder()([prompts[i]]) for i in (5, 2, 5, 900)]))
    cond.index([900, 2])
    assert len(enc.batches) == 3 and cond.encoded == 3  # from memory
    fresh = PaddedEncoder()  # a resumed run: rows come from the disk cache with the same bits, no encoder call
    _equal(StreamedConditioning(fresh, "e", prompts, tmp_path).index([900, 5]), rows.index([3, 0]))
    assert fresh.batches == []
    other = StreamedConditioning(PaddedEncoder(), "e", prompts, tmp_path / "empty")  # encoded again, drawn anew
    _equal(other.index([2, 999, 900]).index([0, 2]), rows.index([1, 3]))


def test_the_streamed_memory_cache_is_bounded(tmp_path):
    from flowforge.data.preprocess import StreamedConditioning

    prompts = [f"p{i}" for i in range(600)]
    enc = CountingEncoder()
    one_row = 4 * 8 * 2 + 6 * 2 + 4 * 8 + (4 * 8 * 2 + 6 * 2 + 4 * 8)  # embeds, pooled (bf16), mask; and negative's
    cond = StreamedConditioning(enc, "e", prompts, tmp_path, max_bytes=2 * one_row)
    cond.index([0, 1, 2])
    assert len(cond._recent) == 2 and list(cond._recent) == [1, 2]
    cond.index([0])  # evicted: read again (from disk)
    assert cond.encoded == 4 and enc.calls == 3
    with pytest.raises(IndexError):
        cond.index([600])
