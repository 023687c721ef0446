"""A federation read from files: one ``.npz`` per client and split, as HtFLlib ships its datasets.

Layout of the directory ``dataset.data_dir`` points at (``partition.num_clients`` = K)::

    <dir>/train/0.npz ... <dir>/train/<K-1>.npz     client k's training data
    <dir>/test/0.npz  ... <dir>/test/<K-1>.npz      client k's own test split

Each file holds ``data``, a pickled dict ``{"x": (n, C, H, W) float, "y": (n,) int}`` (HtFLlib's form,
written by ``np.savez_compressed(path, data={"x": x, "y": y})``), or, without any pickle, the two plain
arrays ``x`` and ``y`` (``np.savez(path, x=x, y=y)``). The values are taken as they are: no normalisation
(HtFLlib's images are already on [-1, 1]), no re-partition, no global test set; the run's test split is the
clients' test files one after another, client k's own share being its file (``partition.per_client_test``).

Safety: ``np.load`` reads the archive with ``allow_pickle=False``; the pickled ``data`` member (a ``.npy`` of
dtype object) has its header parsed with ``numpy.lib.format`` and its payload rebuilt by
:class:`~fedistill.data.safe_pickle.ArrayUnpickler`, which refuses every global but numpy's array helpers and
the builtin containers, so a file cannot run code when it is loaded.

Every problem with the files (a missing directory or file, a gap in the client ids, a file that is not an
npz or lacks ``data``, shapes, labels, an empty client, non-finite values) stops with one
:class:`DatasetError` line naming the file and the fix; a client count other than the files' is a
:class:`ConfigError` on ``partition.num_clients``.
"""

from __future__ import annotations

import re
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib import format as npy_format

from ...errors import ConfigError, DatasetError
from ...registry import DATASETS
from ..dataset import Dataset
from ..safe_pickle import RefusedGlobal, load_restricted
from ..synthetic import ClientRanges

__all__ = ["FederationDataset", "load_npz_federation", "read_client_file", "client_files"]

SPLITS = ("train", "test")
_CLIENT_NAME = re.compile(r"(0|[1-9][0-9]*)\.npz")
_FORMAT = "a client's file is an .npz holding data = {'x': (n, C, H, W) floats, 'y': (n,) integer labels}"
_LAYOUT = "the directory holding train/<client>.npz and test/<client>.npz"


@dataclass
class FederationDataset(Dataset):
    """A :class:`Dataset` whose clients are its files: client k's training rows are
    ``train_offsets[k]:train_offsets[k+1]`` and its test rows ``test_offsets[k]:test_offsets[k+1]``.
    Images are float32 on the files' own scale (mean 0, std 1: the pipeline leaves them unchanged)."""

    train_offsets: np.ndarray | None = None
    test_offsets: np.ndarray | None = None
    directory: str = ""

    def __post_init__(self) -> None:
        for split, x, y, offsets in (
            ("train", self.train_x, self.train_y, self.train_offsets),
            ("test", self.test_x, self.test_y, self.test_offsets),
        ):
            if x.dtype != torch.float32 or x.dim() != 4:
                raise ValueError(f"{self.name} {split} images must be float32 (N, C, H, W), got {x.dtype} {tuple(x.shape)}")
            if y.dtype != torch.int64 or y.shape != (x.shape[0],):
                raise ValueError(f"{self.name} {split} labels must be int64 of length {x.shape[0]}")
            if offsets is None or offsets[0] != 0 or offsets[-1] != x.shape[0] or (np.diff(offsets) < 0).any():
                raise ValueError(f"{self.name} {split}: the client offsets must run from 0 to {x.shape[0]}")
        if len(self.train_offsets) != len(self.test_offsets):
            raise ValueError(f"{self.name}: train and test must have the same clients")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"{self.name}: mean/std need one value per channel ({self.channels})")

    @property
    def num_clients(self) -> int:
        return len(self.train_offsets) - 1

    def client_ranges(self) -> ClientRanges:
        """Every client's training indices: the rows of its train file."""
        return ClientRanges(self.train_offsets)

    def client_test_ranges(self) -> ClientRanges:
        """Every client's test indices: the rows of its test file."""
        return ClientRanges(self.test_offsets)


# --- the files ------------------------------------------------------------------------------------------


def client_files(root: Path, split: str) -> dict[int, Path]:
    """Client id -> ``<root>/<split>/<id>.npz``; other files (no ``.npz`` ending) are ignored."""
    folder = root / split
    if not folder.is_dir():
        raise DatasetError(
            f"npz_federation: no directory {folder.resolve()}; point dataset.data_dir (--data-dir) at {_LAYOUT}"
        )
    files: dict[int, Path] = {}
    for path in sorted(folder.iterdir()):
        if not path.name.endswith(".npz"):
            continue
        match = _CLIENT_NAME.fullmatch(path.name)
        if match is None:
            raise DatasetError(
                f"{path}: client files are named <id>.npz with the ids 0, 1, ..., K-1 (no leading zeros); "
                "rename or remove this one"
            )
        files[int(match.group(1))] = path
    return files


def _check_ids(root: Path, train: dict[int, Path], test: dict[int, Path]) -> int:
    """K, after checking that both splits hold the same clients, numbered 0..K-1 without a gap."""
    if not train and not test:
        raise DatasetError(f"npz_federation: no client files (<id>.npz) in {(root / 'train').resolve()} or {(root / 'test').resolve()}")
    for have, lack in (("train", "test"), ("test", "train")):
        held, other = (train, test) if have == "train" else (test, train)
        missing = sorted(set(held) - set(other))
        if missing:
            k = missing[0]
            more = f" (and {len(missing) - 1} more clients)" if len(missing) > 1 else ""
            raise DatasetError(
                f"npz_federation: client {k} has {have}/{k}.npz but no {lack}/{k}.npz in {root.resolve()}{more}; "
                "every client needs both files"
            )
    ids = sorted(train)
    gaps = sorted(set(range(ids[-1] + 1)) - set(ids))
    if gaps:
        shown = ", ".join(str(g) for g in gaps[:5]) + (", ..." if len(gaps) > 5 else "")
        raise DatasetError(
            f"npz_federation: the client ids in {(root / 'train').resolve()} must be 0..K-1 without gaps, but "
            f"{shown} {'is' if len(gaps) == 1 else 'are'} missing among 0..{ids[-1]}; renumber the files"
        )
    return len(ids)


def _read_pickled_member(archive: Any, path: Path) -> Any:
    """The object pickled in the archive's ``data.npy``: header by numpy.lib.format, payload by the restricted
    unpickler (never numpy's own pickle path)."""
    member = "data.npy" if "data.npy" in archive.zip.namelist() else "data"  # np.savez names it data.npy
    with archive.zip.open(member) as fp:
        version = npy_format.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = npy_format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, _, dtype = npy_format.read_array_header_2_0(fp)
        else:
            raise DatasetError(f"{path}: data is in .npy format version {version[0]}.{version[1]}; fedistill reads 1.0 and 2.0")
        if not dtype.hasobject:
            raise DatasetError(f"{path}: data is a plain {dtype} array of shape {shape}, not the pickled dict {{'x': ..., 'y': ...}}; {_FORMAT}")
        try:
            payload = load_restricted(fp)
        except RefusedGlobal as refused:
            raise DatasetError(
                f"{path}: refusing to unpickle data: it names the global {refused.name}, which could run code; "
                "only numpy arrays and plain containers are loaded (delete the file unless you know why it holds that)"
            ) from None
    if isinstance(payload, np.ndarray) and payload.dtype == object and payload.size == 1:
        payload = payload.reshape(()).item()
    return payload


def _plain_array(archive: Any, key: str, path: Path) -> np.ndarray:
    """Member ``key`` read by ``np.load``'s own reader, which refuses pickles (``allow_pickle=False``)."""
    try:
        return archive[key]
    except ValueError as exc:
        if "allow_pickle" not in str(exc):
            raise
        raise DatasetError(f"{path}: {key} is an array of Python objects; {key} must be a plain numeric array") from None


def read_client_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` of one client file as stored (checked: two numpy arrays; their contents are checked later)."""
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{path}: not an .npz archive ({type(exc).__name__}); {_FORMAT}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DatasetError(f"{path}: a single .npy array, not an .npz archive; {_FORMAT}")
    with archive:
        names = set(archive.files)
        try:
            if "data" in names:
                obj = _read_pickled_member(archive, path)
                if not isinstance(obj, dict) or "x" not in obj or "y" not in obj:
                    what = f"a dict with keys {sorted(map(str, obj))}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
                    raise DatasetError(f"{path}: data holds {what}, not a dict with x and y; {_FORMAT}")
                x, y = obj["x"], obj["y"]
            elif {"x", "y"} <= names:
                x, y = _plain_array(archive, "x", path), _plain_array(archive, "y", path)
            else:
                held = ", ".join(sorted(names)) or "nothing"
                raise DatasetError(f"{path}: holds {held} but no data entry (nor plain x and y arrays); {_FORMAT}")
        except DatasetError:
            raise
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            reason = " ".join(str(exc).split())
            raise DatasetError(f"{path}: cannot be read ({type(exc).__name__}: {reason}); the file is truncated or corrupt") from None
        except Exception as exc:  # the unpickler's other failures: a damaged pickle (its globals were checked)
            raise DatasetError(f"{path}: data cannot be unpickled ({type(exc).__name__}); the file is truncated or corrupt") from None
    for key, value in (("x", x), ("y", y)):
        if not isinstance(value, np.ndarray):
            raise DatasetError(f"{path}: {key} is a {type(value).__name__}, not a numpy array; {_FORMAT}")
    return x, y


def _checked(path: Path, x: np.ndarray, y: np.ndarray, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` as float32 and ``y`` as int64 after the per-file checks."""
    if x.dtype.kind != "f":
        raise DatasetError(
            f"{path}: x is {x.dtype}, but the images must be floats on the scale the model sees (HtFLlib: [-1, 1]); "
            "fedistill does not normalise these files, so store them normalised as float32"
        )
    if x.ndim != 4:
        hint = " (add the channel axis: x[:, None])" if x.ndim == 3 else ""
        raise DatasetError(f"{path}: x has shape {x.shape}; it must be (n, C, H, W) images, e.g. (n, 1, 28, 28){hint}")
    if y.ndim != 1:
        raise DatasetError(f"{path}: y has shape {y.shape}; the labels must be one integer per image, shape (n,)")
    if x.shape[0] != y.shape[0]:
        raise DatasetError(f"{path}: x holds {x.shape[0]} images but y {y.shape[0]} labels; they must match one to one")
    if y.dtype.kind not in "iu":
        raise DatasetError(f"{path}: y is {y.dtype}; the labels must be integers (class ids 0..C-1)")
    if split == "train" and x.shape[0] == 0:
        raise DatasetError(f"{path}: the client has no training samples; every client needs at least one (remove it and renumber, or give it data)")
    if y.size and int(y.min()) < 0:
        raise DatasetError(f"{path}: label {int(y.min())} is negative; the labels must be class ids 0..C-1")
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf, reported next
        x32 = x.astype(np.float32, copy=False)
    bad = x32.size - int(np.count_nonzero(np.isfinite(x32)))
    if bad:
        raise DatasetError(f"{path}: x holds {bad} non-finite values (NaN or inf{' as float32' if x.dtype != np.float32 else ''}); fix or drop those images")
    return x32, y.astype(np.int64, copy=False)


@DATASETS.register("npz_federation")
def load_npz_federation(
    root: Path,
    download: bool = False,
    verify: bool = True,
    *,
    num_clients: int | None = None,
    num_classes: int | None = None,
) -> FederationDataset:
    """The federation in ``root`` (``dataset.data_dir``): ``train/<k>.npz`` and ``test/<k>.npz`` per client.

    ``num_clients`` (``partition.num_clients``) must equal the number of clients the files hold;
    ``num_classes`` (``dataset.num_classes``) defaults to the largest label + 1. ``download`` and ``verify``
    are ignored (the files are the user's own). See the module docstring for the format and the checks.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"npz_federation: the directory {root.resolve()} does not exist; point dataset.data_dir (--data-dir) at {_LAYOUT}")
    train_files, test_files = client_files(root, "train"), client_files(root, "test")
    k = _check_ids(root, train_files, test_files)
    if num_clients is not None and num_clients != k:
        raise ConfigError(
            f"partition.num_clients: {num_clients}, but {root} holds {k} clients (train/0.npz .. train/{k - 1}.npz); "
            f"set partition.num_clients: {k} (--clients {k})"
        )
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {split: [] for split in SPLITS}
    shape: tuple[tuple[int, ...], Path] | None = None  # the first file's image shape, and that file
    largest: tuple[int, Path | None] = (-1, None)  # the largest label, and a file holding it
    for split, files in (("train", train_files), ("test", test_files)):
        for cid in range(k):
            path = files[cid]
            x, y = _checked(path, *read_client_file(path), split)
            if shape is None:
                shape = (x.shape[1:], path)
            elif x.shape[1:] != shape[0]:
                size, first = "x".join(map(str, x.shape[1:])), "x".join(map(str, shape[0]))
                raise DatasetError(
                    f"{path}: its images are {size} (C x H x W), but {shape[1]}'s are {first}; "
                    "every client's images must have one shape"
                )
            if y.size and int(y.max()) > largest[0]:
                largest = (int(y.max()), path)
            parts[split].append((x, y))
    if not any(len(y) for _, y in parts["test"]):
        raise DatasetError(
            f"npz_federation: every test file in {(root / 'test').resolve()} is empty; the clients need test samples to be evaluated"
        )
    if num_classes is None:
        if largest[0] < 1:
            raise DatasetError(
                f"npz_federation: every label in {root.resolve()} is 0; a classifier needs two classes or more "
                "(set dataset.num_classes if some are absent from the files)"
            )
        num_classes = largest[0] + 1
    elif largest[0] >= num_classes:
        raise DatasetError(
            f"{largest[1]}: label {largest[0]} is out of range for dataset.num_classes {num_classes} (labels "
            f"0..{num_classes - 1}); raise dataset.num_classes or fix the labels"
        )

    def joined(split: str) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        xs = [x for x, _ in parts[split]]
        ys = [y for _, y in parts[split]]
        offsets = np.concatenate(([0], np.cumsum([len(y) for y in ys]))).astype(np.int64)
        x = torch.from_numpy(np.ascontiguousarray(np.concatenate(xs)))
        y = torch.from_numpy(np.ascontiguousarray(np.concatenate(ys)))
        parts[split] = []  # the per-client copies go as soon as the split is joined
        return x, y, offsets

    train_x, train_y, train_offsets = joined("train")
    test_x, test_y, test_offsets = joined("test")
    channels = int(train_x.shape[1])
    return FederationDataset(
        name="npz_federation",
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=int(num_classes),
        mean=(0.0,) * channels,  # the files are normalised already: the pipeline's x * 1 + 0 leaves them as stored
        std=(1.0,) * channels,
        train_offsets=train_offsets,
        test_offsets=test_offsets,
        directory=str(root.resolve()),
    )
