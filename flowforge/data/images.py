"""Condition images of image-conditioned prompts (i2v / i2i): files -> a float batch for the adapter."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def load_condition_images(paths: Sequence[str], height: int, width: int) -> torch.Tensor:
    """Images ``[N, 3, height, width]`` float32 in [0, 1], RGB, EXIF orientation applied (as diffusers'
    ``load_image``), resized with diffusers' ``VaeImageProcessor`` (the resize the diffusers image / video pipelines
    apply to their ``image`` argument, Lanczos by default).

    Raises:
        FileNotFoundError / PIL.UnidentifiedImageError: a path that is not a readable image.
    """
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image, ImageOps

    processor = VaeImageProcessor(do_normalize=False, do_convert_rgb=True)
    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(ImageOps.exif_transpose(image).convert("RGB"))
    return processor.preprocess(images, height=height, width=width).float()
