"""Weight-sync transactions in one process: manifest, buckets, verification, refusal, commit."""

import hashlib

import pytest
import torch

from flowforge.rollout.engine import SyncReceiver, WeightSyncError, iter_buckets, make_manifest


def _weights():
    g = torch.Generator().manual_seed(0)
    return {"b.lora_B.weight": torch.randn(5, 3, generator=g),
            "a.lora_A.weight": torch.randn(3, 7, generator=g).to(torch.bfloat16),
            "c.scale": torch.tensor(2.5, dtype=torch.float64)}


def _targets(weights):
    return {k: torch.zeros_like(v) for k, v in weights.items()}


@pytest.mark.parametrize("bucket_bytes", [1, 7, 64, 10_000])
def test_roundtrip_in_buckets_of_any_size_commits_exact_bytes(bucket_bytes):
    weights = _weights()
    manifest = make_manifest(weights, version=3, mode="adapter", bucket_bytes=bucket_bytes)
    assert manifest.count == 3 and [e.name for e in manifest.entries] == sorted(weights)
    assert manifest.total_bytes == 5 * 3 * 4 + 3 * 7 * 2 + 8
    raw = b"".join(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for _, v in sorted(weights.items()))
    assert manifest.content_sha256 == hashlib.sha256(raw).hexdigest()
    buckets = list(iter_buckets(weights, manifest))
    assert len(buckets) == manifest.num_buckets and b"".join(buckets) == raw
    assert all(len(b) == manifest.bucket_length(i) for i, b in enumerate(buckets))
    targets = _targets(weights)
    receiver = SyncReceiver(manifest, targets, "adapter")
    for i, data in enumerate(buckets):
        receiver.add(i, data)
    assert receiver.commit() == 3
    for k, v in weights.items():
        assert targets[k].dtype == v.dtype and torch.equal(targets[k], v)


def _received(weights, manifest, buckets):
    targets = _targets(weights)
    receiver = SyncReceiver(manifest, targets, "adapter")
    for i, data in buckets:
        receiver.add(i, data)
    return receiver, targets


def test_truncated_missing_reordered_and_altered_buckets_are_refused_and_nothing_is_written():
    weights = _weights()
    manifest = make_manifest(weights, version=1, mode="adapter", bucket_bytes=16)
    buckets = list(enumerate(iter_buckets(weights, manifest)))
    cases = {
        "truncated": [*buckets[:2], (2, buckets[2][1][:-1]), *buckets[3:]],
        "6 of 7 buckets": buckets[:-1],
        "expected bucket 1": [buckets[0], buckets[2], buckets[1], *buckets[3:]],
        "sha256": [*buckets[:1], (1, bytes([buckets[1][1][0] ^ 1]) + buckets[1][1][1:]), *buckets[2:]],
    }
    assert manifest.num_buckets == 7
    for expected, stream in cases.items():
        receiver, targets = _received(weights, manifest, stream)
        with pytest.raises(WeightSyncError, match=expected):
            receiver.commit()
        assert all(not t.any() for t in targets.values()), expected  # verification comes before any copy


def test_manifest_layout_and_mode_mismatch_are_refused_at_the_manifest():
    weights = _weights()
    manifest = make_manifest(weights, version=1, mode="adapter", bucket_bytes=64)
    with pytest.raises(WeightSyncError, match="not in the worker \\['c.scale'\\]"):
        SyncReceiver(manifest, {k: v for k, v in _targets(weights).items() if k != "c.scale"}, "adapter")
    other = _targets(weights)
    other["b.lora_B.weight"] = torch.zeros(5, 4)  # same names, another shape
    with pytest.raises(WeightSyncError, match="shape / dtype differs"):
        SyncReceiver(manifest, other, "adapter")
    full = make_manifest(weights, version=1, mode="full", bucket_bytes=64)
    with pytest.raises(WeightSyncError, match="full weight sync of version 1 refused: the worker holds LoRA layers"):
        SyncReceiver(full, _targets(weights), "adapter")


def test_manifest_arguments_are_checked():
    with pytest.raises(ValueError, match="mode 'merged'"):
        make_manifest(_weights(), version=0, mode="merged", bucket_bytes=8)
    with pytest.raises(ValueError, match="at least one tensor"):
        make_manifest({}, version=0, mode="full", bucket_bytes=8)
