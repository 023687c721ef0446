"""Issue 62: the normalisation constants typed into the dataset loaders are the statistics of the training files.

MNIST and Fashion-MNIST: the typed mean and std equal the per-pixel mean and (population) standard deviation of
the official training images on the [0, 1] scale, computed here from the files by the same exact histogram as
EMNIST's and digits' computed constants (data/sources/common._channel_stats), to the digits printed. The files
are looked for in $FEDISTILL_DATA_DIR, then in the shared/data folder beside a checkout (where this project's
sessions and CI keep the verified official files); the test is skipped where neither has them. CIFAR-10,
CIFAR-100 and CINIC-10 cannot be checked here (their files are not on this machine): their loaders cite where
the constants come from.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fedistill.data.sources.common import _channel_stats
from fedistill.data.sources.idx import load_fashion_mnist, load_mnist

ROOT = Path(__file__).resolve().parents[1]


def _data_dir(folder: str) -> Path | None:
    candidates = [Path(p) for p in [os.environ.get("FEDISTILL_DATA_DIR")] if p] + [ROOT.parent / "shared" / "data"]
    for candidate in candidates:
        if (candidate / folder / "train-images-idx3-ubyte.gz").is_file():
            return candidate
    return None


@pytest.mark.parametrize(
    ("loader", "folder", "printed"),
    [(load_mnist, "mnist", ("0.1307", "0.3081")), (load_fashion_mnist, "fashion-mnist", ("0.2860", "0.3530"))],
)
def test_typed_constants_are_the_training_files_statistics(loader, folder, printed):
    root = _data_dir(folder)
    if root is None:
        pytest.skip(f"no official {folder} training files (set FEDISTILL_DATA_DIR to a folder holding {folder}/)")
    dataset = loader(root)
    assert dataset.train_x.shape == (60_000, 1, 28, 28)
    (mean,), (std,) = _channel_stats(dataset.train_x.numpy())
    typed_mean, typed_std = dataset.mean[0], dataset.std[0]
    # the constants as the source prints them (4 decimals), and the computed statistic rounded to that precision
    assert (f"{typed_mean:.4f}", f"{typed_std:.4f}") == printed
    assert (round(mean, 4), round(std, 4)) == (typed_mean, typed_std), (mean, std)
    # the statistic itself, by a second route: the mean and population std of every pixel as floats
    pixels = dataset.train_x.numpy().astype(np.float64) / 255.0
    assert abs(pixels.mean() - mean) < 1e-12 and abs(pixels.std() - std) < 1e-12
