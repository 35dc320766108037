"""Shared test setup: offline, CPU, deterministic thread count."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pathlib

import pytest

GOLDEN_DIR = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "golden"


@pytest.fixture(scope="session")
def golden_dir() -> pathlib.Path:
    if not GOLDEN_DIR.is_dir():
        pytest.fail(f"golden vectors not found at {GOLDEN_DIR} (expected ../shared/golden beside the checkout)")
    return GOLDEN_DIR


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)
