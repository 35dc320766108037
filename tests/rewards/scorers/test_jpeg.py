"""JPEG (in)compressibility rewards (:mod:`flowforge.rewards.scorers.jpeg`) against Pillow directly."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from flowforge.rewards.scorers.jpeg import JpegCompressibility, JpegIncompressibility, jpeg_size_kb


def test_jpeg_size_matches_pillow_directly():
    gen = torch.Generator().manual_seed(0)
    media = torch.rand(2, 3, 16, 24, generator=gen)
    expected = []
    for image in media:
        array = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="JPEG", quality=95)
        expected.append(len(buffer.getvalue()) / 1000)
    sizes = jpeg_size_kb(media)
    assert sizes.dtype == torch.float32 and sizes.shape == (2,)
    torch.testing.assert_close(sizes, torch.tensor(expected))


def test_jpeg_rewards_order_flat_and_noisy_images():
    flat = torch.full((1, 3, 32, 32), 0.5)
    noisy = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    media = torch.cat([flat, noisy])
    prompts, metadata = ["a", "b"], [{}, {}]
    compress = JpegCompressibility()(media, prompts, metadata)
    incompress = JpegIncompressibility()(media, prompts, metadata)
    assert compress[0] > compress[1] and incompress[1] > incompress[0]
    torch.testing.assert_close(compress, -incompress)
    assert bool((compress < 0).all())


def test_jpeg_input_errors():
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        JpegCompressibility()(torch.zeros(1, 1, 8, 8), ["a"], [{}])
    with pytest.raises(ValueError, match="prompts"):
        JpegCompressibility()(torch.zeros(2, 3, 8, 8), ["a"], [{}, {}])
    with pytest.raises(ValueError, match="floating"):
        JpegCompressibility()(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), ["a"], [{}])
    with pytest.raises(ValueError, match="quality"):
        JpegCompressibility(quality=100)
