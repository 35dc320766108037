"""Fixtures shared by the CLIP-tower scorer tests."""

import pytest

from tests.rewards.scorers.tiny_clip import build_clip_dirs


@pytest.fixture(scope="session")
def clip_dirs(tmp_path_factory):
    """``(model_dir, processor_dir)`` of a tiny CLIP (see :mod:`tests.rewards.scorers.tiny_clip`), built once."""
    return build_clip_dirs(tmp_path_factory.mktemp("tiny_clip"))
