"""IDX files: MNIST, Fashion-MNIST and EMNIST (the official ``*-ubyte.gz`` files, and EMNIST's ``gzip.zip``).

The IDX decoder (gzip, magic number, header sizes), the lookup of each official name as ``.gz`` or as its
uncompressed copy, and the loaders ``mnist``, ``fashion_mnist`` and ``emnist`` (one of
:data:`EMNIST_SPLITS`, its files extracted from ``gzip.zip`` when missing).
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

from ...errors import ConfigError, DatasetError
from ...registry import DATASETS
from .. import download as _download
from ..dataset import Dataset
from .common import (
    MD5,
    _build,
    _channel_stats,
    _check_count,
    _check_labels,
    _download_hint,
    _ensure_archive,
    _missing_error,
    _read_checked,
)

_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)

EMNIST_SPLITS: dict[str, int] = {
    "balanced": 47,
    "byclass": 62,
    "bymerge": 47,
    "digits": 10,
    "letters": 26,  # stored as 1..26, shifted to 0..25
    "mnist": 10,
}
"""EMNIST split name -> number of classes."""


# --- IDX (MNIST family) -------------------------------------------------------------------------------


def _find_idx(directory: Path, gz_name: str) -> Path | None:
    """The file for official name ``gz_name``: the ``.gz`` if present (it can be md5-checked), else the
    uncompressed copy of the same name without ``.gz``, else None."""
    for candidate in (directory / gz_name, directory / gz_name[: -len(".gz")]):
        if candidate.is_file():
            return candidate
    return None


def _gunzip(path: Path, raw: bytes) -> bytes:
    """Decompress a gzip file held in memory, checking its CRC and length trailer.

    zlib does this in C about twice as fast as :func:`gzip.decompress`; files made of several gzip
    members (legal, but not how the official files are written) go through :mod:`gzip`.
    """
    try:
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        data = inflater.decompress(raw)
        if not inflater.eof:
            raise EOFError("compressed data ends before the end-of-stream marker")
        if inflater.unused_data:
            data = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DatasetError(
            f"{path}: not a valid gzip file ({type(exc).__name__}: {exc}); it is truncated or corrupt, "
            f"delete it and download it again"
        ) from None
    return data


def _read_idx(path: Path, ndim: int, md5_table: dict[str, str], verify: bool) -> np.ndarray:
    """Decode one IDX file (optionally gzipped) holding uint8 data of ``ndim`` dimensions.

    IDX layout: two zero bytes, a type byte (0x08 = unsigned byte), a byte with the number of
    dimensions, that many big-endian uint32 sizes, then the data in row-major order.
    """
    raw = _read_checked(path, md5_table.get(path.name), verify)
    if path.name.endswith(".gz"):
        raw = _gunzip(path, raw)
    expected_magic = 0x0800 | ndim
    if len(raw) < 4 + 4 * ndim:
        raise DatasetError(f"{path}: {len(raw)} bytes is too short for an IDX header; the file is truncated")
    magic = int.from_bytes(raw[:4], "big")
    if magic != expected_magic:
        raise DatasetError(
            f"{path}: bad IDX magic number 0x{magic:08x}, expected 0x{expected_magic:08x} "
            f"({'images' if ndim == 3 else 'labels'}, unsigned bytes); not an official IDX file"
        )
    header = 4 + 4 * ndim
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    size = int(np.prod(dims, dtype=np.int64))
    if len(raw) - header != size:
        raise DatasetError(
            f"{path}: size does not match the header dimensions {'x'.join(map(str, dims))} "
            f"({size} data bytes expected, {len(raw) - header} present); the file is truncated or corrupt"
        )
    return np.frombuffer(raw, dtype=np.uint8, count=size, offset=header).reshape(dims)


def _read_idx_split(
    images_name: str,
    labels_name: str,
    paths: dict[str, Path],
    md5_table: dict[str, str],
    verify: bool,
    image_hw: tuple[int, int] = (28, 28),
) -> tuple[np.ndarray, np.ndarray]:
    images_path, labels_path = paths[images_name], paths[labels_name]
    images = _read_idx(images_path, 3, md5_table, verify)
    labels = _read_idx(labels_path, 1, md5_table, verify)
    if images.shape[1:] != image_hw:
        raise DatasetError(
            f"{images_path}: images are {images.shape[1]}x{images.shape[2]}, expected "
            f"{image_hw[0]}x{image_hw[1]}; not the expected dataset"
        )
    _check_count(images_path, labels_path, images.shape[0], labels.shape[0])
    return images, labels


def _resolve_idx_files(directory: Path, names: Sequence[str]) -> tuple[dict[str, Path], list[str]]:
    """Map each official name to its file (see :func:`_find_idx`); also return the names not found."""
    found: dict[str, Path] = {}
    missing: list[str] = []
    for name in names:
        path = _find_idx(directory, name)
        if path is None:
            missing.append(name)
        else:
            found[name] = path
    return found, missing


def _load_mnist_like(
    key: str,
    folder: str,
    title: str,
    root: Path,
    download: bool,
    verify: bool,
    mean: float,
    std: float,
) -> Dataset:
    directory = Path(root) / folder
    md5_table = MD5[key]
    paths, missing = _resolve_idx_files(directory, _MNIST_FILES)
    if missing:
        if not download:
            raise _missing_error(
                title, directory, [*_MNIST_FILES], missing,
                "The same names without .gz are accepted too. " + _download_hint(),
            )
        for name in missing:
            paths[name] = _download.download_official(key, name, directory / name, md5_table.get(name))
    train_x, train_y = _read_idx_split(
        "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", paths, md5_table, verify
    )
    test_x, test_y = _read_idx_split(
        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", paths, md5_table, verify
    )
    for labels_name, labels in (("train-labels-idx1-ubyte.gz", train_y), ("t10k-labels-idx1-ubyte.gz", test_y)):
        _check_labels(paths[labels_name], labels, 0, 9)
    return _build(
        key,
        (train_x[:, None], train_y),
        (test_x[:, None], test_y),
        10,
        (mean,),
        (std,),
    )


@DATASETS.register("mnist")
def load_mnist(root: Path, download: bool = False, verify: bool = True) -> Dataset:
    """MNIST handwritten digits: 60k/10k 1x28x28, 10 classes (official IDX files in <data>/mnist/).

    Normalisation: mean 0.1307, std 0.3081 (the standard constants, computed on the training set).
    """
    return _load_mnist_like("mnist", "mnist", "MNIST", root, download, verify, 0.1307, 0.3081)


@DATASETS.register("fashion_mnist")
def load_fashion_mnist(root: Path, download: bool = False, verify: bool = True) -> Dataset:
    """Fashion-MNIST clothing images: 60k/10k 1x28x28, 10 classes (official IDX files in <data>/fashion-mnist/).

    Normalisation: mean 0.2860, std 0.3530, the commonly used constants (the training-set pixel mean
    and std, rounded to 4 digits).
    """
    return _load_mnist_like(
        "fashion_mnist", "fashion-mnist", "Fashion-MNIST", root, download, verify, 0.2860, 0.3530
    )


# --- EMNIST -------------------------------------------------------------------------------------------


def _check_emnist_split(split: str) -> str:
    if split not in EMNIST_SPLITS:
        raise ConfigError(f"emnist: unknown split {split!r}; choose one of: {', '.join(sorted(EMNIST_SPLITS))}")
    return split


def _emnist_files(split: str) -> tuple[str, str, str, str]:
    prefix = f"emnist-{split}"
    return (
        f"{prefix}-train-images-idx3-ubyte.gz",
        f"{prefix}-train-labels-idx1-ubyte.gz",
        f"{prefix}-test-images-idx3-ubyte.gz",
        f"{prefix}-test-labels-idx1-ubyte.gz",
    )


EMNIST_ARCHIVE = "gzip.zip"
EMNIST_ARCHIVE_FOLDER = "gzip"  # members of gzip.zip are gzip/emnist-<split>-...-ubyte.gz


@DATASETS.register("emnist")
def load_emnist(root: Path, download: bool = False, verify: bool = True, split: str = "balanced") -> Dataset:
    """EMNIST handwritten characters, 1x28x28, split=balanced (47 classes, default) or another split.

    Splits: ``balanced`` (47 classes), ``byclass`` (62), ``bymerge`` (47), ``letters`` (26), ``digits``
    (10), ``mnist`` (10).

    Files: the official ``emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte.gz`` as extracted
    from NIST's ``gzip.zip``, in ``<data>/emnist/``. If they are missing but ``<data>/emnist/gzip.zip``
    is present, only the needed members are extracted from it (no network); with ``download=True`` the
    archive (about 562 MB, md5-checked) is fetched first and kept for other splits.

    EMNIST stores each image transposed relative to MNIST; it is transposed back so characters are
    upright. ``letters`` labels 1..26 are shifted to 0..25. The extracted files have no published md5,
    so they are validated by structure; ``verify`` applies to the archive. Normalisation constants are
    the exact per-pixel mean/std of the chosen split's training images (they differ between splits).
    The dataset is named ``emnist-<split>``.
    """
    _check_emnist_split(split)
    num_classes = EMNIST_SPLITS[split]
    directory = Path(root) / "emnist"
    names = _emnist_files(split)
    paths, missing = _resolve_idx_files(directory, names)
    if missing:
        archive = directory / EMNIST_ARCHIVE
        _ensure_archive(
            "emnist", f"EMNIST ({split})", archive, directory, list(names), missing, download, verify, root
        )
        _download.extract_members(archive, {f"{EMNIST_ARCHIVE_FOLDER}/{n}": directory / n for n in missing})
        for name in missing:
            paths[name] = directory / name
    no_md5: dict[str, str] = {}  # the extracted files have no published checksum
    train_x, train_y = _read_idx_split(names[0], names[1], paths, no_md5, verify)
    test_x, test_y = _read_idx_split(names[2], names[3], paths, no_md5, verify)
    offset = 1 if split == "letters" else 0
    for labels_name, labels in ((names[1], train_y), (names[3], test_y)):
        _check_labels(paths[labels_name], labels, offset, num_classes - 1 + offset)
    train_x = np.ascontiguousarray(train_x.transpose(0, 2, 1))[:, None]
    test_x = np.ascontiguousarray(test_x.transpose(0, 2, 1))[:, None]
    train_y = train_y.astype(np.int64) - offset
    test_y = test_y.astype(np.int64) - offset
    mean, std = _channel_stats(train_x)
    return _build(f"emnist-{split}", (train_x, train_y), (test_x, test_y), num_classes, mean, std)
