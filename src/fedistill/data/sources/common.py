"""Checks and helpers every dataset format shares.

The md5 table of the official files (:data:`MD5`) and how a file is read with it (:func:`_read_checked`),
the label-range and label-count checks, the exact per-channel statistics, :func:`_build` (numpy arrays ->
:class:`Dataset`), the missing-files error and its download hint, and :func:`_ensure_archive` (the official
archive that CIFAR and EMNIST extract their files from). The format modules import from here; this module
imports none of them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ...errors import DatasetError
from .. import download as _download
from ..dataset import Dataset

DATA_ENV = "FEDISTILL_DATA"
"""Environment variable naming the data directory when ``data_dir`` is not given."""


# Official md5 values, keyed by dataset then by official file name. Sources: the dataset pages and the
# values torchvision's dataset definitions use for the same files (MNIST/Fashion-MNIST values also checked
# against byte-identical copies of the releases). Tests replace entries to exercise the checksum path.
MD5: dict[str, dict[str, str]] = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion_mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
    "emnist": {
        "gzip.zip": "58c8d27c78d21e728a6bc7b3cc06412e",
    },
    "cifar10": {
        "cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a",
        "data_batch_1": "c99cafc152244af753f735de768cd75f",
        "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
        "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
        "data_batch_4": "634d18415352ddfa80567beed471001a",
        "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
        "test_batch": "40351d587109b95175f43aff81a1287e",
    },
    "cifar100": {
        "cifar-100-python.tar.gz": "eb9058c3a382ffc7106e4002c42a8d85",
        "train": "16019d7e3df5f24257cddd939b257f8d",
        "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
    },
    "svhn": {
        "train_32x32.mat": "e26dedcc434d2e4c54c9b2d4a06d8373",
        "test_32x32.mat": "eb5a983be6a315427106f1b164d9cef3",
    },
}


def _missing_error(
    dataset: str,
    directory: Path,
    expected: Sequence[str],
    missing: Sequence[str],
    how_to_get: str,
    root: Path | None = None,
) -> DatasetError:
    """The error for absent files: what is missing, the exact directory, how to get them, which data dir."""
    where = directory.resolve()
    if len(missing) == len(expected):
        what = f"{dataset}: no dataset files in {where}; put the official files {', '.join(expected)} there."
    else:
        what = (
            f"{dataset}: missing {len(missing)} of {len(expected)} files in {where}: {', '.join(missing)} "
            f"(expected there: {', '.join(expected)})."
        )
    data_dir = (root if root is not None else directory.parent).resolve()
    return DatasetError(
        f"{what} {how_to_get} The data directory is {data_dir} (set it with --data-dir or the "
        f"{DATA_ENV} environment variable)."
    )


def _download_hint(archive: str | None = None, archive_dir: Path | None = None) -> str:
    if archive is None:
        return (
            f"Pass download=True (CLI: --download) to fetch the missing files from the official source "
            f"(md5-checked; {_download.MIRROR_ENV} overrides the host)."
        )
    return (
        f"Pass download=True (CLI: --download) to fetch the official {archive} (md5-checked; "
        f"{_download.MIRROR_ENV} overrides the host) and extract them, or place {archive} in "
        f"{(archive_dir or Path('.')).resolve()} yourself (the files are then extracted without network)."
    )


def _read_checked(path: Path, expected_md5: str | None, verify: bool) -> bytes:
    """Read a whole file; when ``verify`` and an official md5 is known, compare it first."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from None
    if verify and expected_md5 is not None:
        _check_md5(path, hashlib.md5(raw).hexdigest(), expected_md5)
    return raw


def _check_md5(path: Path, actual: str, expected: str) -> None:
    if actual != expected.lower():
        raise DatasetError(
            f"checksum mismatch for {path}: expected md5 {expected.lower()}, got {actual}. The file is "
            f"corrupt or not the official release: delete it and download it again (--download), or pass "
            f"verify=False (CLI: --no-verify) if it is a deliberately modified copy"
        )


def _to_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:  # np.frombuffer over bytes; torch wants writable memory
        array = array.copy()
    return torch.from_numpy(array).to(dtype)


def _check_labels(path: Path | str, labels: np.ndarray, low: int, high: int) -> None:
    """All labels must lie in [low, high]; a value outside means a wrong or corrupt file."""
    if labels.size and (int(labels.min()) < low or int(labels.max()) > high):
        raise DatasetError(
            f"{path}: labels range over {int(labels.min())}..{int(labels.max())}, expected {low}..{high}; "
            f"the file is corrupt or belongs to another dataset"
        )


def _check_count(images_path: Path | str, labels_path: Path | str, n_images: int, n_labels: int) -> None:
    if n_images != n_labels:
        raise DatasetError(
            f"{labels_path} holds {n_labels} labels but {images_path} holds {n_images} images; "
            f"the files do not belong together or one of them is truncated"
        )


def _channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and (population) std on the [0, 1] scale of uint8 (N, C, H, W) images.

    Uses a 256-bin histogram per channel, so no float copy of the whole dataset is made.
    """
    values = np.arange(256, dtype=np.float64) / 255.0
    means, stds = [], []
    for c in range(images.shape[1]):
        counts = np.bincount(images[:, c].ravel(), minlength=256).astype(np.float64)
        total = counts.sum()
        mean = float((counts * values).sum() / total)
        var = float((counts * (values - mean) ** 2).sum() / total)
        means.append(mean)
        stds.append(var ** 0.5)
    return tuple(means), tuple(stds)


def _build(
    name: str,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    num_classes: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> Dataset:
    return Dataset(
        name=name,
        train_x=_to_tensor(train[0], torch.uint8),
        train_y=_to_tensor(train[1], torch.int64),
        test_x=_to_tensor(test[0], torch.uint8),
        test_y=_to_tensor(test[1], torch.int64),
        num_classes=num_classes,
        mean=tuple(float(m) for m in mean),
        std=tuple(float(s) for s in std),
    )


def _ensure_archive(
    key: str,
    title: str,
    archive: Path,
    directory: Path,
    expected: list[str],
    missing: list[str],
    download: bool,
    verify: bool,
    root: Path,
) -> None:
    """Make sure the official archive holding the missing files is present and intact.

    Present: its md5 is checked (when ``verify``) before anything is extracted from it. Absent: it is
    downloaded when ``download`` is set, else the usual missing-files error is raised.
    """
    expected_md5 = MD5[key].get(archive.name)
    if archive.is_file():
        if verify and expected_md5 is not None:
            _check_md5(archive, _download.md5_file(archive), expected_md5)
        return
    if not download:
        raise _missing_error(
            title, directory, expected, missing, _download_hint(archive.name, archive.parent), Path(root)
        )
    _download.download_official(key, archive.name, archive, expected_md5)
