"""Reference images of the multi-image edit families (FLUX.2, Qwen-Image-Edit-Plus) at their own sizes.

Such an adapter (``takes_original_images = True``) is given each row's condition images as opened (PIL RGB, any
size; :func:`flowforge.data.images.open_condition_images`) and resizes each as its pipeline does, so a row's image
tokens depend on the sizes and the number of its images. ``cond.image`` then holds each row's tokens from position 0,
zero-padded to the longest row, and ``cond.image_grids [B, K, 2]`` the token grid ``(rows, cols)`` of each image
(``(0, 0)`` pads a row with fewer images); :func:`by_image_layout` runs the rows of each layout together on exactly
their own tokens, so no padding ever reaches the transformer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from flowforge.models.base import Conditioning


def condition_pil_images(images: Tensor) -> list:
    """``[N, 3, H, W]`` float in [0, 1] -> ``N`` RGB PIL images, ``round(255 x)`` (diffusers ``VaeImageProcessor``
    ``pt_to_numpy`` + ``numpy_to_pil``): what the Edit pipeline's ``processor`` is given. Exact for images loaded
    from 8-bit files (:func:`flowforge.data.images.load_condition_images`)."""
    from diffusers.image_processor import VaeImageProcessor

    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be [N, 3, H, W], got shape {tuple(images.shape)}")
    pixels = images.detach().to(device="cpu", dtype=torch.float32).clamp(0.0, 1.0)
    return VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(pixels))


def image_sets(images: Tensor) -> Tensor:
    """Condition images as ``[N, K, 3, H, W]`` (K images per prompt): ``[N, 3, H, W]`` is one per prompt.

    Raises:
        ValueError: another shape.
    """
    if images.ndim == 4:
        images = images.unsqueeze(1)
    if images.ndim != 5 or images.shape[2] != 3 or images.shape[1] < 1:
        raise ValueError(f"condition images must be [N, 3, H, W] or [N, K, 3, H, W], got {tuple(images.shape)}")
    return images


def pil_rows(images: Tensor | Sequence[Sequence[Any]]) -> list[list[Any]]:
    """Each row's condition images as PIL RGB: a list of lists of PIL images is taken as is; a tensor
    ``[N, 3, H, W]`` / ``[N, K, 3, H, W]`` float in [0, 1] becomes 8-bit PIL images (``round(255 x)``, exact for
    images read from 8-bit files).

    Raises:
        ValueError: a tensor of another shape; a row without images.
    """
    if isinstance(images, Tensor):
        return [condition_pil_images(row) for row in image_sets(images)]
    rows = [list(row) for row in images]
    if any(not row for row in rows):
        raise ValueError("every row needs at least one condition image")
    return rows


def pad_rows(tokens: Sequence[Tensor], grids: Sequence[Sequence[tuple[int, int]]]) -> tuple[Tensor, Tensor]:
    """Rows of tokens ``[1, L_i, D]`` and their grids -> ``(image [N, max L, D], image_grids [N, max K, 2] int64)``,
    zero-padded (module docstring)."""
    longest, most = max(t.shape[1] for t in tokens), max(len(g) for g in grids)
    image = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[1])) for t in tokens])
    table = torch.zeros(len(grids), most, 2, dtype=torch.long)
    for i, row in enumerate(grids):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.long).view(-1, 2)
    return image, table


def row_grids(cond: Conditioning, row: int = 0) -> list[tuple[int, int]]:
    """The token grids of row ``row``'s condition images (padding dropped)."""
    return [(int(h), int(w)) for h, w in cond.image_grids[row].tolist() if h * w > 0]


def by_image_layout(x: Tensor, sigma: Tensor, cond: Conditioning,
                    run: Callable[[Tensor, Tensor, Conditioning], Tensor]) -> Tensor:
    """``run(x, sigma, cond)`` once per group of rows with the same condition-image grids (all rows at once when they
    agree), each group's ``cond.image`` cut to its own tokens; the outputs ``[B, ...]`` back in row order. Without
    ``cond.image_grids`` (images at the model size) ``run`` sees everything unchanged."""
    if cond.image_grids is None:
        return run(x, sigma, cond)
    keys = [tuple(map(tuple, g)) for g in cond.image_grids.tolist()]
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    out = None
    for rows in groups.values():
        part = cond if len(groups) == 1 else cond.index(rows)
        length = sum(h * w for h, w in row_grids(part))
        part = dataclasses.replace(part, image=part.image[:, :length])
        if len(groups) == 1:
            return run(x, sigma, part)
        index = torch.tensor(rows, device=x.device)
        value = run(x.index_select(0, index), sigma.index_select(0, index), part)
        out = value.new_zeros((x.shape[0], *value.shape[1:])) if out is None else out
        out = out.index_copy(0, index, value)
    return out
