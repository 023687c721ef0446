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

A federation already split into clients (``npz_federation``, HtFLlib's layout) is read from the directory
``data_dir`` names itself: ``<dir>/{train,test}/<client>.npz`` (``npz_federation.py``).

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

Modules, one per format family: ``common`` (the md5 table and md5-checked reading, label and count
checks, channel statistics, ``_build``, missing-file errors and hints, official archives), ``idx`` (MNIST,
Fashion-MNIST, EMNIST: IDX files and EMNIST's zip), ``cifar`` (CIFAR-10/100 pickles and archives), ``svhn``
(.mat files), ``cinic`` (CINIC-10 PNG folders), ``digits`` (scikit-learn's digits), ``npz_federation`` (per-client
.npz files). This package holds the entry points below and imports every format module, so importing it
registers every dataset.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...registry import DATASETS
from ..dataset import Dataset
from ..synthetic import load_synthetic
from .cifar import (
    CIFAR10_ARCHIVE,
    CIFAR10_FILES,
    CIFAR10_FOLDER,
    CIFAR100_ARCHIVE,
    CIFAR100_FILES,
    CIFAR100_FOLDER,
    load_cifar10,
    load_cifar100,
)
from .cinic import CINIC10_CLASSES, CINIC10_FOLDER, load_cinic10
from .common import DATA_ENV, MD5
from .digits import DIGITS_SEED, DIGITS_TEST_FRACTION, load_digits
from .idx import (
    EMNIST_ARCHIVE,
    EMNIST_ARCHIVE_FOLDER,
    EMNIST_SPLITS,
    _MNIST_FILES,
    _check_emnist_split,
    _emnist_files,
    load_emnist,
    load_fashion_mnist,
    load_mnist,
)
from .npz_federation import load_npz_federation
from .svhn import SVHN_FILES, load_svhn

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
    "load_npz_federation",
    # the format modules' constants, still importable from here as before the split
    "CIFAR10_ARCHIVE",
    "CIFAR100_ARCHIVE",
    "DIGITS_SEED",
    "DIGITS_TEST_FRACTION",
    "EMNIST_ARCHIVE",
    "EMNIST_ARCHIVE_FOLDER",
]

DEFAULT_DATA_DIR = "data"
"""Data directory used when neither ``data_dir`` nor ``$FEDISTILL_DATA`` is set (relative to the cwd)."""

DATASETS.register("synthetic")(load_synthetic)  # FedProx's Synthetic(alpha, beta): no files (data/synthetic.py)


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
