"""Fixtures for the command-line tests: a LoRA run written without training (shared by a module's cases)."""

import pytest

from tests.tools.test_export import crafted_lora_run


@pytest.fixture(scope="module")
def cli_run(tiny_model_dir, encode_cache_dir, tmp_path_factory):
    """A LoRA run directory (config.yaml + committed checkpoint step 1) that the tests must never change."""
    return crafted_lora_run(tmp_path_factory.mktemp("cli_runs"), tiny_model_dir, encode_cache_dir)
