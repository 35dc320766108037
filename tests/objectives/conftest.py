"""Objectives on the real loop (tiny random SD3): a trainer factory shared by the per-algorithm tests."""

import pytest

from tests.train.test_trainer import make_trainer  # noqa: F401  (the fixture `make` builds on)


@pytest.fixture
def make(make_trainer):  # noqa: F811
    """``make_trainer`` with the run named ``o`` by default."""
    def build(*extra, name="o"):
        return make_trainer(*extra, name=name)
    return build
