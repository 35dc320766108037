"""Objectives on the real loop (tiny random SD3): a trainer factory shared by the per-algorithm tests."""

import pytest

from tests.train.test_trainer import tiny_cfg


@pytest.fixture
def make(tiny_model_dir, tmp_path, encode_cache_dir):
    from flowforge.train.trainer import Trainer

    def build(*extra, name="o"):
        return Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, f"run.name={name}", *extra),
                       progress=False)
    return build
