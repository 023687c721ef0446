"""CIFAR-10 and CIFAR-100: the official Python pickles, extracted from the official ``.tar.gz`` when missing.

Unpickling is restricted to the globals numpy arrays need (:mod:`fedistill.data.safe_pickle`: a pickle can name
any callable, so even the official files are read that way); each batch's keys, shapes and labels are checked
before use.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...errors import DatasetError
from ...registry import DATASETS
from .. import download as _download
from ..dataset import Dataset
from ..safe_pickle import load_restricted
from .common import MD5, _build, _check_count, _check_labels, _ensure_archive, _read_checked

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch")
CIFAR100_FOLDER = "cifar-100-python"
CIFAR100_ARCHIVE = "cifar-100-python.tar.gz"
CIFAR100_FILES = ("train", "test")


def _unpickle(path: Path, raw: bytes) -> dict:
    try:
        # encoding="bytes": the official pickles were written by Python 2, their str keys become bytes.
        obj = load_restricted(io.BytesIO(raw), encoding="bytes")
    except Exception as exc:  # any failure of the decoder means a corrupt or foreign file
        raise DatasetError(
            f"{path}: cannot unpickle ({type(exc).__name__}: {exc}); the file is truncated, corrupt or not "
            f"an official CIFAR batch; delete it and download again"
        ) from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{path}: expected a pickled dict, found {type(obj).__name__}")
    return obj


def _get_key(obj: dict, key: str, path: Path) -> Any:
    for candidate in (key.encode(), key):
        if candidate in obj:
            return obj[candidate]
    raise DatasetError(
        f"{path}: missing key {key!r} (has {', '.join(sorted(repr(k) for k in obj))}); not an official CIFAR batch"
    )


def _read_cifar_batch(
    path: Path, label_key: str, num_classes: int, md5_table: dict[str, str], verify: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR pickle: ``data`` is (N, 3072) uint8 holding the R, G and B 32x32 planes row-major."""
    obj = _unpickle(path, _read_checked(path, md5_table.get(path.name), verify))
    data = _get_key(obj, "data", path)
    labels = _get_key(obj, label_key, path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise DatasetError(
            f"{path}: 'data' must be a uint8 array of shape (N, 3072), found "
            f"{type(data).__name__} {getattr(data, 'dtype', '')} {shape}"
        )
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"{path}: {label_key!r} is not a list of integers ({exc})") from None
    if labels.ndim != 1:
        raise DatasetError(f"{path}: {label_key!r} must be one-dimensional, found shape {labels.shape}")
    _check_count(path, path, data.shape[0], labels.shape[0])
    _check_labels(path, labels, 0, num_classes - 1)
    return data.reshape(-1, 3, 32, 32), labels


def _load_cifar(
    key: str,
    title: str,
    root: Path,
    folder: str,
    archive_name: str,
    train_files: Sequence[str],
    test_files: Sequence[str],
    label_key: str,
    num_classes: int,
    download: bool,
    verify: bool,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> Dataset:
    root = Path(root)
    directory = root / folder
    expected = [*train_files, *test_files]
    missing = [f for f in expected if not (directory / f).is_file()]
    if missing:
        archive = root / archive_name
        _ensure_archive(key, title, archive, directory, expected, missing, download, verify, root)
        _download.extract_members(archive, {f"{folder}/{f}": directory / f for f in missing})
    md5_table = MD5[key]
    splits = []
    for files in (train_files, test_files):
        parts = [_read_cifar_batch(directory / f, label_key, num_classes, md5_table, verify) for f in files]
        splits.append((np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])))
    return _build(key, splits[0], splits[1], num_classes, mean, std)


@DATASETS.register("cifar10")
def load_cifar10(root: Path, download: bool = False, verify: bool = True) -> Dataset:
    """CIFAR-10: 50k/10k 3x32x32, 10 classes (official python pickles in <data>/cifar-10-batches-py/).

    ``download=True`` fetches ``cifar-10-python.tar.gz`` (md5-checked, kept in <data>) and extracts only
    the six batch files. Each batch is also md5-checked against the published per-batch values.
    """
    return _load_cifar(
        "cifar10", "CIFAR-10", root, CIFAR10_FOLDER, CIFAR10_ARCHIVE, CIFAR10_FILES[:5], CIFAR10_FILES[5:],
        "labels", 10, download, verify,
        # The per-channel mean and population std of the 50,000 training images on the [0, 1] scale, in the
        # form commonly published with CIFAR-10 loaders (8 digits); not checked here: no CIFAR-10 files on our machines
        # (tests/test_normalisation_constants.py checks MNIST's and Fashion-MNIST's where their files are).
        (0.49139968, 0.48215827, 0.44653124), (0.24703233, 0.24348505, 0.26158768),
    )


@DATASETS.register("cifar100")
def load_cifar100(root: Path, download: bool = False, verify: bool = True) -> Dataset:
    """CIFAR-100: 50k/10k 3x32x32, 100 fine classes (official python pickles in <data>/cifar-100-python/).

    Uses ``fine_labels``. ``download=True`` fetches ``cifar-100-python.tar.gz`` (md5-checked, kept in
    <data>) and extracts only ``train`` and ``test``, which are md5-checked too.
    """
    return _load_cifar(
        "cifar100", "CIFAR-100", root, CIFAR100_FOLDER, CIFAR100_ARCHIVE, CIFAR100_FILES[:1], CIFAR100_FILES[1:],
        "fine_labels", 100, download, verify,
        # The training set's per-channel mean and std, 4 decimals, the constants commonly published with CIFAR-100
        # loaders; not checked here (no CIFAR-100 files on our machines).
        (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762),
    )
