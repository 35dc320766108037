"""Rollout workers under torchrun: each rank drives its own worker; the run equals the same run rolling out locally."""

import pytest
import torch

from tests.test_distributed import _overrides, _run

pytestmark = pytest.mark.distributed


@pytest.mark.slow  # a multi-process end-to-end run (tens of seconds): CI runs it after the default set
def test_two_fsdp_ranks_with_a_worker_each_match_local_rollouts_bitwise(tiny_model_dir, tmp_path, encode_cache_dir):
    """FSDP2 on 2 gloo ranks (LoRA, DiffusionNFT sampling with the old policy): every rank gathers the sharded
    weights for its worker's sync; the samples and the weights after 2 steps are bit-identical to the same torchrun
    job with local rollouts."""
    extra = ("train.algorithm=nft", "distributed.strategy=fsdp")
    local = _run(tmp_path / "local", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "local", *extra), 2)
    workers = _run(tmp_path / "workers", 0, _overrides(tiny_model_dir, tmp_path, encode_cache_dir, "workers", *extra,
                                                       "rollout.engine=workers"), 2)
    for rank in range(2):
        assert torch.equal(local[rank]["candidate_ids"], workers[rank]["candidate_ids"])
        assert torch.equal(local[rank]["finals"], workers[rank]["finals"])
        for k, v in local[rank]["live"].items():
            assert torch.equal(workers[rank]["live"][k], v), k
    rows = (tmp_path / "workers" / "metrics.jsonl").read_text().splitlines()
    assert '"train/policy_version": 1.0' in rows[1]
