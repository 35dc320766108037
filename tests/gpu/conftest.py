"""The GPU tests (marker ``gpu``): skipped where CUDA is not available.

The default run deselects them (``-m 'not slow and not gpu'`` in pyproject); on a GPU machine run
``python -m pytest -q -n 0 -m gpu tests/gpu``. ``FLOWFORGE_GPU_TESTS_ON_CPU=1`` runs the same tests on the CPU
instead (gloo for NCCL), to check their logic where no GPU exists; it proves nothing about CUDA.
"""

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ON_CPU = os.environ.get("FLOWFORGE_GPU_TESTS_ON_CPU") == "1"


def pytest_collection_modifyitems(config, items):
    # a skip marker before any fixture runs: without CUDA no model is built and nothing is written
    if torch.cuda.is_available() or ON_CPU:
        return
    skip = pytest.mark.skip(reason="needs CUDA (FLOWFORGE_GPU_TESTS_ON_CPU=1 runs the logic on the CPU)")
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    """``"cuda"``, or ``"cpu"`` under ``FLOWFORGE_GPU_TESTS_ON_CPU=1`` (where CUDA is missing)."""
    return "cuda" if torch.cuda.is_available() else "cpu"
