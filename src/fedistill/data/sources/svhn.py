"""SVHN cropped digits: the official MATLAB ``.mat`` files (``train_32x32.mat``, ``test_32x32.mat``)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ...errors import DatasetError
from ...registry import DATASETS
from .. import download as _download
from ..dataset import Dataset
from .common import MD5, _build, _check_count, _check_labels, _download_hint, _missing_error, _read_checked

SVHN_FILES = ("train_32x32.mat", "test_32x32.mat")


def _read_svhn(path: Path, verify: bool) -> tuple[np.ndarray, np.ndarray]:
    """One SVHN cropped-digits .mat: ``X`` (32, 32, 3, N) uint8, ``y`` (N, 1) with 10 meaning digit 0."""
    from scipy.io import loadmat  # scipy comes with scikit-learn; only needed here

    raw = _read_checked(path, MD5["svhn"].get(path.name), verify)
    try:
        mat = loadmat(io.BytesIO(raw), variable_names=["X", "y"])
    except Exception as exc:  # scipy raises many types (MatReadError, ValueError, NotImplementedError ...)
        raise DatasetError(
            f"{path}: cannot read as a MATLAB v5 file ({type(exc).__name__}: {exc}); it is truncated or "
            f"corrupt, delete it and download it again"
        ) from None
    for key in ("X", "y"):
        if key not in mat:
            raise DatasetError(f"{path}: missing variable {key!r}; not an official SVHN file")
    x, y = mat["X"], mat["y"]
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise DatasetError(f"{path}: 'X' must be uint8 of shape (32, 32, 3, N), found {x.dtype} {x.shape}")
    y = np.asarray(y).reshape(-1)
    _check_count(path, path, x.shape[3], y.shape[0])
    if y.size and not np.all(np.equal(np.mod(y, 1), 0)):
        raise DatasetError(f"{path}: 'y' holds non-integer labels")
    y = y.astype(np.int64)
    _check_labels(path, y, 1, 10)
    y[y == 10] = 0  # SVHN writes digit 0 as label 10
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1)), y


@DATASETS.register("svhn")
def load_svhn(root: Path, download: bool = False, verify: bool = True) -> Dataset:
    """SVHN cropped digits: 73,257/26,032 3x32x32, 10 classes (official .mat files in <data>/svhn/).

    Label 10 (digit 0) becomes 0. The ``extra`` split is not used. Normalisation: mean = std = 0.5 per
    channel, as in the papers' pipelines.
    """
    directory = Path(root) / "svhn"
    missing = [f for f in SVHN_FILES if not (directory / f).is_file()]
    if missing:
        if not download:
            raise _missing_error("SVHN", directory, SVHN_FILES, missing, _download_hint())
        for name in missing:
            _download.download_official("svhn", name, directory / name, MD5["svhn"].get(name))
    train = _read_svhn(directory / SVHN_FILES[0], verify)
    test = _read_svhn(directory / SVHN_FILES[1], verify)
    return _build("svhn", train, test, 10, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
