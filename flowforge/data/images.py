"""Condition images of image-conditioned prompts (i2v / i2i): files -> what the adapter is given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def open_condition_images(paths: Sequence[str]) -> list[Any]:
    """The images at ``paths`` as RGB ``PIL.Image`` at their own sizes, EXIF orientation applied (as diffusers'
    ``load_image``): what a pipeline's ``image=`` argument is given.

    Raises:
        FileNotFoundError / PIL.UnidentifiedImageError: a path that is not a readable image.
    """
    from PIL import Image, ImageOps

    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(ImageOps.exif_transpose(image).convert("RGB"))
    return images


def load_condition_images(paths: Sequence[str], height: int, width: int) -> torch.Tensor:
    """Images ``[N, 3, height, width]`` float32 in [0, 1], RGB, EXIF orientation applied (as diffusers'
    ``load_image``), resized with diffusers' ``VaeImageProcessor`` (the resize the diffusers image / video pipelines
    apply to their ``image`` argument, Lanczos by default).

    Raises:
        FileNotFoundError / PIL.UnidentifiedImageError: a path that is not a readable image.
    """
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(do_normalize=False, do_convert_rgb=True)
    return processor.preprocess(open_condition_images(paths), height=height, width=width).float()


def condition_inputs(paths: Sequence[Sequence[str]], height: int, width: int, *, originals: bool):
    """What an ``ImageConditioned`` adapter's ``condition_on_images`` is given for rows whose condition images are
    ``paths`` (one list per row): with ``originals`` (the adapter's ``takes_original_images``: it resizes as its
    pipeline does) each row's images as opened (:func:`open_condition_images`), else ``[N, 3, height, width]``
    (:func:`load_condition_images`; one image per row).

    Raises:
        ValueError: a row with several images for an adapter that takes resized tensors.
    """
    if originals:
        return [open_condition_images(row) for row in paths]
    if any(len(row) != 1 for row in paths):
        counts = sorted({len(row) for row in paths})
        raise ValueError(f"this model takes one condition image per prompt, got rows of {counts} images")
    return load_condition_images([row[0] for row in paths], height, width)
