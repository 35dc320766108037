"""Capture / restore of the process's RNG states (python, numpy, torch)."""

import random

import numpy as np
import pytest
import torch

from flowforge.runtime.rng import capture_rng, restore_rng


def _draws():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


def test_capture_restore_rng_in_memory():
    state = capture_rng()
    first = _draws()
    restore_rng(state)
    assert _draws() == first
    with pytest.raises(ValueError, match=r"missing \['numpy'\]"):
        restore_rng({"python": state["python"], "torch": state["torch"]})
