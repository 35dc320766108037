"""The digits demo's independent stroke-width judge: 2 A / P on the image binarised at its Otsu threshold."""

from __future__ import annotations

import math

import pytest
import torch

from flowforge.demo.stroke import StrokeWidth, otsu_threshold, stroke_width


def _bar(width: int, length: int = 20, value: float = 1.0) -> torch.Tensor:
    image = torch.zeros(1, 1, 32, 32)
    image[..., 6:6 + length, 10:10 + width] = value
    return image


def test_stroke_width_of_known_shapes():
    """A w x L bar has A = w L and P = 2 L + 2 (w - 2) boundary pixels (for w >= 2): 2 A / P -> w for long bars;
    a one-pixel line reads 2 (every pixel is boundary); an image without contrast has no strokes (NaN)."""
    widths = stroke_width(torch.cat([_bar(1), _bar(3), _bar(5), torch.zeros(1, 1, 32, 32),
                                     torch.full((1, 1, 32, 32), 0.7)]))
    assert widths[0] == 2.0
    assert widths[1] == pytest.approx(2 * 60 / (2 * 20 + 2 * 1))
    assert widths[2] == pytest.approx(2 * 100 / (2 * 20 + 2 * 3))
    assert math.isnan(widths[3]) and math.isnan(widths[4]) and widths.dtype == torch.float32
    with pytest.raises(ValueError, match=r"\[B, 1, H, W\]"):
        stroke_width(torch.zeros(1, 3, 32, 32))


def test_dimming_does_not_change_the_width_and_otsu_splits_the_two_levels():
    """Otsu's threshold falls between the background and the ink, wherever the ink's grey level is: a digit dimmed
    to 40 % has the same width (the teacher's thinness uses another rule: half the peak)."""
    assert 0.0 < float(otsu_threshold(_bar(3, value=0.4))) <= 0.4
    assert 0.0 < float(otsu_threshold(_bar(3))) <= 1.0
    assert torch.equal(stroke_width(_bar(3, value=0.4)), stroke_width(_bar(3)))


def test_a_thicker_pen_on_real_digits_reads_wider():
    from flowforge.demo import data

    images, _ = data.load_split("eval_clf")
    digits = images[:16].expand(-1, 3, -1, -1)
    bold = torch.nn.functional.max_pool2d(digits, 3, stride=1, padding=1)
    judge = StrokeWidth()
    thin, thick = judge(digits, [""] * 16, [{}] * 16), judge(bold, [""] * 16, [{}] * 16)
    assert bool((thick > thin).all()) and float(thin.min()) > 1.0
    with pytest.raises(ValueError, match="one of each per image"):
        judge(digits, [""] * 15, [{}] * 16)
