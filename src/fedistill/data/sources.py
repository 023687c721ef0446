"""Dataset sources: decode the official dataset files into in-memory :class:`Dataset` tensors.

Each loader reads one dataset from its **official files, under their official names**, in a data directory,
checks them (md5 of the official files when ``verify=True``; structure always), and returns uint8
(N, C, H, W) images with int64 labels. Loaders are registered in :data:`fedistill.registry.DATASETS`;
:func:`load_dataset` is the entry point that resolves the data directory and dispatches by name.

Data directory layout (``<data>`` is ``data_dir``, else ``$FEDISTILL_DATA``, else ``./data``)::

    <data>/mnist/           train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz
                            t10k-images-idx3-ubyte.gz  t10k-labels-idx1-ubyte.gz   (or the same without .gz)
    <data>/fashion-mnist/   same four names
    <data>/emnist/          emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte.gz (+ gzip.zip)
    <data>/cifar-10-batches-py/  data_batch_1 .. data_batch_5, test_batch   (+ <data>/cifar-10-python.tar.gz)
    <data>/cifar-100-python/     train, test                              (+ <data>/cifar-100-python.tar.gz)
    <data>/svhn/            train_32x32.mat test_32x32.mat
    <data>/cinic-10/        {train,test}/<class>/*.png
    (digits needs no files: it ships with scikit-learn; synthetic is generated from the seed, data/synthetic.py)

Offline first: nothing is fetched unless ``download=True`` (CLI ``--download``), and then only the missing
files, through :mod:`fedistill.data.download` (atomic, md5-checked; ``FEDISTILL_MIRROR`` overrides the
host). If an official archive (CIFAR ``.tar.gz``, EMNIST ``gzip.zip``) is already in place, the missing
files are extracted from it without any network access.

Checksums: the md5 of every official file that has a published md5 is checked when ``verify=True``
(table :data:`MD5`). Files without one (uncompressed IDX copies, the members extracted from EMNIST's
zip, CINIC PNGs) are validated by structure only: IDX magic and sizes, pickle keys and shapes, label
ranges, label count equal to image count. ``verify=False`` (CLI ``--no-verify``) skips only the md5, for
deliberately modified copies; the structural checks always run.

Every problem a user can cause (missing directory, missing/truncated/corrupt file, wrong checksum) raises
:class:`DatasetError` naming the file and the fix; bad names or options raise :class:`ConfigError`.
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
import io
import logging
import os
import pickle
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import ConfigError, DatasetError
from ..registry import DATASETS
from . import download as _download
from .dataset import Dataset
from .synthetic import load_synthetic

log = logging.getLogger(__name__)

__all__ = [
    "DATA_ENV",
    "DEFAULT_DATA_DIR",
    "MD5",
    "EMNIST_SPLITS",
    "CINIC10_CLASSES",
    "resolve_data_dir",
    "load_dataset",
    "expected_files",
    "load_mnist",
    "load_fashion_mnist",
    "load_emnist",
    "load_cifar10",
    "load_cifar100",
    "load_svhn",
    "load_cinic10",
    "load_digits",
    "load_synthetic",
]

DATA_ENV = "FEDISTILL_DATA"
"""Environment variable naming the data directory when ``data_dir`` is not given."""

DEFAULT_DATA_DIR = "data"
"""Data directory used when neither ``data_dir`` nor ``$FEDISTILL_DATA`` is set (relative to the cwd)."""

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

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch")
CIFAR100_FOLDER = "cifar-100-python"
CIFAR100_ARCHIVE = "cifar-100-python.tar.gz"
CIFAR100_FILES = ("train", "test")
SVHN_FILES = ("train_32x32.mat", "test_32x32.mat")
CINIC10_FOLDER = "cinic-10"
CINIC10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)
"""CINIC-10 class folders; their sorted order is the label index (same classes and order as CIFAR-10)."""

# --- data directory and dispatch ----------------------------------------------------------------------


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    """The data directory: ``data_dir`` if given, else ``$FEDISTILL_DATA`` if set and non-empty, else ``./data``."""
    if data_dir is None or str(data_dir) == "":
        data_dir = os.environ.get(DATA_ENV, "").strip() or DEFAULT_DATA_DIR
    return Path(data_dir).expanduser()


def load_dataset(
    name: str,
    data_dir: str | Path | None = None,
    download: bool = False,
    verify: bool = True,
    **options: Any,
) -> Dataset:
    """Load dataset ``name`` (a :data:`DATASETS` registry name) from the data directory.

    ``data_dir`` falls back to ``$FEDISTILL_DATA``, then ``./data`` (see :func:`resolve_data_dir`).
    ``download=True`` fetches missing official files (md5-checked); ``verify=False`` skips the md5 check
    of present files (structure is always checked). ``options`` go to the loader, e.g.
    ``load_dataset("emnist", split="letters")``.

    Raises :class:`ConfigError` for an unknown name or option, :class:`DatasetError` for missing or
    corrupt files.
    """
    loader = DATASETS.get(name, key="dataset")
    root = resolve_data_dir(data_dir)
    accepted = [p for p in inspect.signature(loader).parameters if p not in ("root", "download", "verify")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        allowed = ", ".join(accepted) if accepted else "none"
        raise ConfigError(f"dataset {name!r}: unknown option(s) {', '.join(unknown)}; allowed: {allowed}")
    return loader(root, download=download, verify=verify, **options)


def expected_files(name: str, split: str = "balanced") -> list[str]:
    """The files dataset ``name`` reads, as paths relative to the data directory (for messages and docs).

    ``split`` only matters for EMNIST. CINIC-10 is listed as one ``*.png`` pattern per class folder;
    the embedded ``digits`` needs no file and returns an empty list.
    """
    if name not in DATASETS:
        DATASETS.get(name, key="dataset")  # raises the ConfigError listing the choices
    if name == "mnist":
        return [f"mnist/{f}" for f in _MNIST_FILES]
    if name == "fashion_mnist":
        return [f"fashion-mnist/{f}" for f in _MNIST_FILES]
    if name == "emnist":
        return [f"emnist/{f}" for f in _emnist_files(_check_emnist_split(split))]
    if name == "cifar10":
        return [f"{CIFAR10_FOLDER}/{f}" for f in CIFAR10_FILES]
    if name == "cifar100":
        return [f"{CIFAR100_FOLDER}/{f}" for f in CIFAR100_FILES]
    if name == "svhn":
        return [f"svhn/{f}" for f in SVHN_FILES]
    if name == "cinic10":
        return [f"{CINIC10_FOLDER}/{s}/{c}/*.png" for s in ("train", "test") for c in CINIC10_CLASSES]
    return []


# --- shared helpers -----------------------------------------------------------------------------------


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


# --- CIFAR --------------------------------------------------------------------------------------------

# Globals the official CIFAR pickles (numpy arrays inside Python 2 pickles) need, and nothing else: a
# pickle can name any callable, so even on the official files unpickling is restricted to these.
_PICKLE_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("_codecs", "encode"),  # how Python 3 writes bytes in protocol-2 pickles
}


_NUMPY_2 = int(np.__version__.split(".")[0]) >= 2


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that only resolves the numpy globals of :data:`_PICKLE_GLOBALS`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        if module.startswith("numpy.core") and _NUMPY_2:
            module = "numpy._core" + module[len("numpy.core"):]  # numpy 2 renamed it; avoids a warning
        return super().find_class(module, name)


def _unpickle(path: Path, raw: bytes) -> dict:
    try:
        # encoding="bytes": the official pickles were written by Python 2, their str keys become bytes.
        obj = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
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
        (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762),
    )


# --- SVHN ---------------------------------------------------------------------------------------------


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


# --- CINIC-10 -----------------------------------------------------------------------------------------


def _read_png_folder(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """All ``<class>/*.png`` images below ``directory`` in (class, file name) order, as uint8 (N, 3, 32, 32)."""
    from PIL import Image, UnidentifiedImageError  # Pillow comes with matplotlib; only needed here

    missing = [c for c in CINIC10_CLASSES if not (directory / c).is_dir()]
    if missing:
        raise DatasetError(
            f"CINIC-10: class folder(s) {', '.join(missing)} missing in {directory.resolve()}; it must hold "
            f"one folder per class ({', '.join(CINIC10_CLASSES)}) with the official PNG files"
        )
    files: list[Path] = []
    labels: list[int] = []
    for label, cls in enumerate(CINIC10_CLASSES):
        pngs = sorted((directory / cls).glob("*.png"))
        if not pngs:
            raise DatasetError(
                f"CINIC-10: no .png files in {(directory / cls).resolve()}; the extraction is incomplete"
            )
        files.extend(pngs)
        labels.extend([label] * len(pngs))
    images = np.empty((len(files), 32, 32, 3), dtype=np.uint8)
    for i, path in enumerate(files):
        try:
            with Image.open(path) as im:
                # A few CINIC images (from ImageNet) are greyscale; the dataset is used as RGB.
                array = np.asarray(im if im.mode == "RGB" else im.convert("RGB"))
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as exc:
            raise DatasetError(
                f"{path}: cannot decode PNG ({type(exc).__name__}: {exc}); the file is corrupt"
            ) from None
        if array.shape != (32, 32, 3):
            raise DatasetError(f"{path}: image is {array.shape[1]}x{array.shape[0]}, expected 32x32")
        images[i] = array
    return images.transpose(0, 3, 1, 2), np.asarray(labels, dtype=np.int64)


@DATASETS.register("cinic10")
def load_cinic10(root: Path, download: bool = False, verify: bool = True) -> Dataset:
    """CINIC-10: 90k/90k 3x32x32, 10 CIFAR-10 classes (official PNG folders in <data>/cinic-10/{train,test}/).

    Labels follow the sorted class-folder order (airplane=0 ... truck=9), the same as CIFAR-10. The
    ``valid`` split is not used. Images are decoded once (Pillow) into the uint8 tensor. There is no
    published checksum for the PNGs, so ``verify`` has no effect; each file is validated while decoding.
    There is no ``download``: the release is a single ~700 MB tar on the University of Edinburgh
    DataShare, not a stable file host with a checksum (see github.com/BayesWatch/cinic-10); download and
    extract it by hand so that ``<data>/cinic-10/train/airplane/*.png`` exists.
    """
    directory = Path(root) / CINIC10_FOLDER
    absent = [s for s in ("train", "test") if not (directory / s).is_dir()]
    if absent:
        expected = [f"{s}/<class>/*.png" for s in ("train", "test")]
        raise _missing_error(
            "CINIC-10", directory, expected, [f"{s}/<class>/*.png" for s in absent],
            "CINIC-10 is not downloaded automatically (download=True does not apply): get CINIC-10.tar.gz "
            "from the release linked at github.com/BayesWatch/cinic-10 and extract it into that directory.",
        )
    if download:
        log.info("CINIC-10 has no automatic download; using the files in %s", directory)
    train = _read_png_folder(directory / "train")
    test = _read_png_folder(directory / "test")
    return _build(
        "cinic10", train, test, 10,
        (0.47889522, 0.47227842, 0.43047404), (0.24205776, 0.23828046, 0.25874835),
    )


# --- digits (embedded) --------------------------------------------------------------------------------

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


DATASETS.register("synthetic")(load_synthetic)  # FedProx's Synthetic(alpha, beta): no files (data/synthetic.py)


@DATASETS.register("digits")
def load_digits(root: Path | None = None, download: bool = False, verify: bool = True) -> Dataset:
    """scikit-learn's handwritten digits: 1,797 1x8x8 images, 10 classes, embedded (no files, no download).

    The default dataset: it ships with scikit-learn, so a fresh machine can run without any download.
    Pixel values 0..16 are scaled to uint8 as round(v * 255 / 16). The split is deterministic and
    stratified: per class, a random 20 % (seed 0, numpy ``default_rng``) is the test set, giving 1,438
    train and 359 test images. mean/std are computed from the train split. ``root``, ``download`` and
    ``verify`` are ignored.
    """
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = np.rint(bunch.images.astype(np.float64) * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[:, None]
    labels = bunch.target.astype(np.int64)
    train_idx, test_idx = _stratified_split(labels, DIGITS_TEST_FRACTION, DIGITS_SEED)
    mean, std = _channel_stats(images[train_idx])
    return _build(
        "digits", (images[train_idx], labels[train_idx]), (images[test_idx], labels[test_idx]), 10, mean, std
    )

