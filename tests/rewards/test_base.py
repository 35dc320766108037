"""Input checks shared by the scorers and the processor (:mod:`flowforge.rewards.base`)."""

import pytest
import torch

from flowforge.rewards.base import check_batch_size, check_inputs, check_media


def test_check_media_returns_batch_and_rejects_bad_tensors():
    assert check_media(torch.zeros(5, 3, 4, 6)) == 5
    assert check_media(torch.zeros(0, 3, 4, 6, dtype=torch.bfloat16)) == 0
    for bad in (torch.zeros(2, 4, 4, 4), torch.zeros(3, 4, 4), [[0.0]]):
        with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
            check_media(bad)
    with pytest.raises(ValueError, match="floating point"):
        check_media(torch.zeros(1, 3, 2, 2, dtype=torch.int64))


def test_check_inputs_needs_one_prompt_and_one_metadata_per_image():
    media = torch.zeros(2, 3, 4, 4)
    assert check_inputs(media, ["a", "b"], [{}, {}]) == 2
    with pytest.raises(ValueError, match=r"prompts must have one entry per image \(2\), got 3"):
        check_inputs(media, ["a", "b", "c"], [{}, {}])
    with pytest.raises(ValueError, match=r"metadata must have one entry per image \(2\), got 1"):
        check_inputs(media, ["a", "b"], [{}])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", None])
def test_check_batch_size_rejects_non_positive_ints(bad):
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        check_batch_size(bad)


def test_check_batch_size_returns_the_value():
    assert check_batch_size(1) == 1 and check_batch_size(64) == 64
