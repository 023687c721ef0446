"""scikit-learn's handwritten digits: embedded, no files, split deterministically into train and test."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import DatasetError
from ...registry import DATASETS
from ..dataset import Dataset
from .common import _build, _channel_stats

DIGITS_TEST_FRACTION = 0.2
DIGITS_SEED = 0


def _stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per class, a seeded random ``round(test_fraction * n_class)`` samples go to test; indices sorted."""
    rng = np.random.default_rng(seed)
    test: list[np.ndarray] = []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        test.append(rng.permutation(members)[: int(round(test_fraction * members.size))])
    test_idx = np.sort(np.concatenate(test))
    train_idx = np.setdiff1d(np.arange(labels.size), test_idx)
    return train_idx, test_idx


def _digits_file() -> Path:
    """scikit-learn's ``datasets/data/digits.csv.gz`` (64 pixel columns and the label), found without importing
    scikit-learn: its import costs about 2 s, more than the whole of a small run, in every process that loads the
    default dataset (each CLI run, worker process and Flower ClientApp)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise DatasetError(
            "digits: scikit-learn's digits.csv.gz was not found (the default dataset ships with scikit-learn); "
            "reinstall it with `pip install --force-reinstall scikit-learn`, or choose another dataset.name"
        )
    return path


@DATASETS.register("digits")
def load_digits(root: Path | None = None, download: bool = False, verify: bool = True) -> Dataset:
    """scikit-learn's handwritten digits: 1,797 1x8x8 images, 10 classes, embedded (no files, no download).

    The default dataset: it ships with scikit-learn, so a fresh machine can run without any download.
    Pixel values 0..16 are scaled to uint8 as round(v * 255 / 16). The split is deterministic and
    stratified: per class, a random 20 % (seed 0, numpy ``default_rng``) is the test set, giving 1,438
    train and 359 test images. mean/std are computed from the train split. ``root``, ``download`` and
    ``verify`` are ignored.
    """
    table = np.loadtxt(_digits_file(), delimiter=",")  # what sklearn.datasets.load_digits reads, row for row
    images = np.rint(table[:, :-1].reshape(-1, 8, 8) * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[:, None]
    labels = table[:, -1].astype(np.int64)
    train_idx, test_idx = _stratified_split(labels, DIGITS_TEST_FRACTION, DIGITS_SEED)
    mean, std = _channel_stats(images[train_idx])
    return _build(
        "digits", (images[train_idx], labels[train_idx]), (images[test_idx], labels[test_idx]), 10, mean, std
    )
