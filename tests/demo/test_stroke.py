"""The digits demo's independent stroke-width judge: 2 A / P on the binarised image, in pixels."""

from __future__ import annotations

import pytest
import torch

from flowforge.demo.stroke import StrokeWidth, stroke_width


def _bar(width: int, length: int = 20) -> torch.Tensor:
    image = torch.zeros(1, 1, 32, 32)
    image[..., 6:6 + length, 10:10 + width] = 1.0
    return image


def test_stroke_width_of_known_shapes():
    """A w x L bar has A = w L and P = 2 L + 2 (w - 2) boundary pixels (for w >= 2): 2 A / P -> w for long bars;
    a one-pixel line reads 2 (every pixel is boundary); an empty image 0."""
    widths = stroke_width(torch.cat([_bar(1), _bar(3), _bar(5), torch.zeros(1, 1, 32, 32)]))
    assert widths[0] == 2.0
    assert widths[1] == pytest.approx(2 * 60 / (2 * 20 + 2 * 1))
    assert widths[2] == pytest.approx(2 * 100 / (2 * 20 + 2 * 3))
    assert widths[3] == 0.0 and widths.dtype == torch.float32
    with pytest.raises(ValueError, match=r"\[B, 1, H, W\]"):
        stroke_width(torch.zeros(1, 3, 32, 32))


def test_a_thicker_pen_on_real_digits_reads_wider():
    from flowforge.demo import data

    images, _ = data.load_split("eval_clf")
    digits = images[:16].expand(-1, 3, -1, -1)
    bold = torch.nn.functional.max_pool2d(digits, 3, stride=1, padding=1)
    judge = StrokeWidth()
    thin, thick = judge(digits, [""] * 16, [{}] * 16), judge(bold, [""] * 16, [{}] * 16)
    assert bool((thick > thin).all()) and float(thin.min()) > 1.0
