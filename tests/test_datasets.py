"""Dataset loaders: tiny files written in each official format round-trip into the expected tensors, and
every missing, truncated, corrupt or mismatching file raises a DatasetError that names it.

No test reads real datasets or touches the network; the md5 path is exercised by replacing entries of
the checksum table with the md5s of the tiny files.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fedistill.data import sources
from fedistill.data.sources import expected_files, load_dataset
from fedistill.errors import ConfigError, DatasetError
from fedistill.registry import DATASETS

MNIST_NAMES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


# --- writers for the official formats -----------------------------------------------------------------


def idx_bytes(array: np.ndarray) -> bytes:
    """IDX encoding of a uint8 array: 0x00 0x00 0x08 ndim, big-endian uint32 dims, data."""
    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    return header + array.tobytes()


def write_idx(path: Path, array: np.ndarray, compress: bool = True) -> Path:
    data = idx_bytes(array)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def make_mnist_dir(directory: Path, n_train: int = 5, n_test: int = 3, seed: int = 0, compress: bool = True,
                   prefix: str = "", num_classes: int = 10, label_offset: int = 0, names=MNIST_NAMES):
    """Write the four IDX files; return the arrays written (images as stored on disk)."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train_x": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_y": rng.integers(0, num_classes, n_train).astype(np.uint8) + label_offset,
        "test_x": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_y": rng.integers(0, num_classes, n_test).astype(np.uint8) + label_offset,
    }
    for name, key in zip(names, ("train_x", "train_y", "test_x", "test_y")):
        filename = prefix + name if compress else prefix + name[: -len(".gz")]
        write_idx(directory / filename, arrays[key], compress=compress)
    return arrays


def md5_of(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def cifar_batch(n: int, num_classes: int, label_key: bytes, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": b"testing batch",
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        label_key: [int(v) for v in rng.integers(0, num_classes, n)],
        b"filenames": [f"img_{i}.png".encode() for i in range(n)],
    }


def write_pickle(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj, protocol=2))  # the official batches are protocol-2 pickles
    return path


def make_cifar10_dir(directory: Path, n: int = 4) -> dict[str, dict]:
    batches = {}
    for i, name in enumerate(sources.CIFAR10_FILES):
        batches[name] = cifar_batch(n, 10, b"labels", seed=i)
        write_pickle(directory / name, batches[name])
    return batches


def assert_valid_dataset(ds, n_train, n_test, shape, num_classes):
    assert ds.train_x.dtype == torch.uint8 and ds.test_x.dtype == torch.uint8
    assert ds.train_y.dtype == torch.int64 and ds.test_y.dtype == torch.int64
    assert tuple(ds.train_x.shape) == (n_train, *shape)
    assert tuple(ds.test_x.shape) == (n_test, *shape)
    assert ds.num_classes == num_classes
    assert len(ds.mean) == len(ds.std) == shape[0]


# --- MNIST / Fashion-MNIST ----------------------------------------------------------------------------


def test_mnist_round_trip(tmp_path):
    arrays = make_mnist_dir(tmp_path / "mnist")
    ds = load_dataset("mnist", tmp_path, verify=False)
    assert_valid_dataset(ds, 5, 3, (1, 28, 28), 10)
    assert ds.name == "mnist"
    assert torch.equal(ds.train_x[:, 0], torch.from_numpy(arrays["train_x"]))
    assert torch.equal(ds.test_x[:, 0], torch.from_numpy(arrays["test_x"]))
    assert ds.train_y.tolist() == arrays["train_y"].tolist()
    assert ds.test_y.tolist() == arrays["test_y"].tolist()
    assert ds.mean == (0.1307,) and ds.std == (0.3081,)


def test_mnist_accepts_uncompressed_files(tmp_path):
    arrays = make_mnist_dir(tmp_path / "mnist", compress=False)
    ds = load_dataset("mnist", tmp_path)  # no official md5 for raw files: structure is checked instead
    assert torch.equal(ds.train_x[:, 0], torch.from_numpy(arrays["train_x"]))


def test_fashion_mnist_uses_its_folder_and_constants(tmp_path):
    arrays = make_mnist_dir(tmp_path / "fashion-mnist", seed=3)
    ds = load_dataset("fashion_mnist", tmp_path, verify=False)
    assert_valid_dataset(ds, 5, 3, (1, 28, 28), 10)
    assert ds.test_y.tolist() == arrays["test_y"].tolist()
    assert ds.mean == (0.2860,) and ds.std == (0.3530,)
    with pytest.raises(DatasetError, match="mnist"):
        load_dataset("mnist", tmp_path, verify=False)  # mnist/ does not exist here


def test_md5_checked_against_table(tmp_path, monkeypatch):
    directory = tmp_path / "mnist"
    make_mnist_dir(directory)
    for name in MNIST_NAMES:
        monkeypatch.setitem(sources.MD5["mnist"], name, md5_of(directory / name))
    load_dataset("mnist", tmp_path, verify=True)  # every md5 matches

    monkeypatch.setitem(sources.MD5["mnist"], "t10k-labels-idx1-ubyte.gz", "0" * 32)
    with pytest.raises(DatasetError) as info:
        load_dataset("mnist", tmp_path, verify=True)
    message = str(info.value)
    assert "t10k-labels-idx1-ubyte.gz" in message
    assert "0" * 32 in message and md5_of(directory / "t10k-labels-idx1-ubyte.gz") in message
    assert "verify=False" in message and "--no-verify" in message and "--download" in message
    load_dataset("mnist", tmp_path, verify=False)  # custom copies load without the md5 check


def test_official_md5_rejects_tiny_copy_by_default(tmp_path):
    make_mnist_dir(tmp_path / "mnist")
    with pytest.raises(DatasetError, match="checksum mismatch"):
        load_dataset("mnist", tmp_path)


def test_missing_files_message(tmp_path):
    directory = tmp_path / "mnist"
    make_mnist_dir(directory)
    (directory / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(DatasetError) as info:
        load_dataset("mnist", tmp_path, verify=False)
    message = str(info.value)
    assert str(directory.resolve()) in message
    assert "missing 1 of 4 files" in message and "t10k-images-idx3-ubyte.gz (expected there" in message
    for name in MNIST_NAMES:
        assert name in message
    assert "--download" in message and "FEDISTILL_DATA" in message and "--data-dir" in message


def test_missing_directory_lists_everything(tmp_path):
    with pytest.raises(DatasetError) as info:
        load_dataset("svhn", tmp_path)
    message = str(info.value)
    assert str((tmp_path / "svhn").resolve()) in message
    assert "train_32x32.mat" in message and "test_32x32.mat" in message and "--download" in message


def test_truncated_gzip(tmp_path):
    directory = tmp_path / "mnist"
    make_mnist_dir(directory)
    path = directory / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(DatasetError, match="train-images-idx3-ubyte.gz.*(truncated|gzip)"):
        load_dataset("mnist", tmp_path, verify=False)


def test_corrupt_gzip_crc(tmp_path):
    directory = tmp_path / "mnist"
    make_mnist_dir(directory)
    path = directory / "train-labels-idx1-ubyte.gz"
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF  # first byte of the CRC32 trailer
    path.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="train-labels-idx1-ubyte.gz.*not a valid gzip"):
        load_dataset("mnist", tmp_path, verify=False)


def test_bad_idx_magic(tmp_path):
    directory = tmp_path / "mnist"
    make_mnist_dir(directory)
    # an images file where a labels file belongs
    write_idx(directory / "t10k-labels-idx1-ubyte.gz", np.zeros((3, 28, 28), np.uint8))
    with pytest.raises(DatasetError, match=r"t10k-labels-idx1-ubyte.gz: bad IDX magic number 0x00000803"):
        load_dataset("mnist", tmp_path, verify=False)


def test_idx_size_does_not_match_header(tmp_path):
    directory = tmp_path / "mnist"
    make_mnist_dir(directory)
    data = idx_bytes(np.zeros((5, 28, 28), np.uint8))[:-100]  # header says 5 images, fewer bytes follow
    (directory / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(data))
    with pytest.raises(DatasetError, match="train-images-idx3-ubyte.gz: size does not match the header"):
        load_dataset("mnist", tmp_path, verify=False)


def test_idx_header_truncated(tmp_path):
    directory = tmp_path / "mnist"
    make_mnist_dir(directory, compress=False)
    (directory / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08")
    with pytest.raises(DatasetError, match="train-images-idx3-ubyte: .*too short"):
        load_dataset("mnist", tmp_path)


def test_label_count_must_match_images(tmp_path):
    directory = tmp_path / "mnist"
    make_mnist_dir(directory)
    write_idx(directory / "train-labels-idx1-ubyte.gz", np.zeros(4, np.uint8))  # 5 images, 4 labels
    with pytest.raises(DatasetError, match="train-labels-idx1-ubyte.gz holds 4 labels but .* holds 5 images"):
        load_dataset("mnist", tmp_path, verify=False)


def test_label_out_of_range(tmp_path):
    directory = tmp_path / "mnist"
    make_mnist_dir(directory)
    write_idx(directory / "t10k-labels-idx1-ubyte.gz", np.array([0, 10, 1], np.uint8))
    with pytest.raises(DatasetError, match="t10k-labels-idx1-ubyte.gz: labels range over 0..10, expected 0..9"):
        load_dataset("mnist", tmp_path, verify=False)


def test_wrong_image_size(tmp_path):
    directory = tmp_path / "mnist"
    make_mnist_dir(directory)
    write_idx(directory / "t10k-images-idx3-ubyte.gz", np.zeros((3, 32, 32), np.uint8))
    with pytest.raises(DatasetError, match="t10k-images-idx3-ubyte.gz: images are 32x32, expected 28x28"):
        load_dataset("mnist", tmp_path, verify=False)


# --- EMNIST -------------------------------------------------------------------------------------------


def emnist_names(split):
    return tuple(f"emnist-{split}-{n.replace('t10k', 'test')}" for n in MNIST_NAMES)


def test_emnist_transposes_images(tmp_path):
    arrays = make_mnist_dir(tmp_path / "emnist", names=emnist_names("balanced"), num_classes=47)
    ds = load_dataset("emnist", tmp_path)
    assert_valid_dataset(ds, 5, 3, (1, 28, 28), 47)
    assert ds.name == "emnist-balanced"
    # files store each image transposed; the loader returns it upright
    assert torch.equal(ds.train_x[:, 0], torch.from_numpy(arrays["train_x"]).transpose(1, 2))
    assert torch.equal(ds.test_x[:, 0], torch.from_numpy(arrays["test_x"]).transpose(1, 2))
    assert ds.train_x.is_contiguous()
    assert ds.train_y.tolist() == arrays["train_y"].tolist()
    mean = ds.train_x.double().mean().item() / 255
    assert ds.mean[0] == pytest.approx(mean)
    assert ds.std[0] == pytest.approx(ds.train_x.double().div(255).std(unbiased=False).item())


def test_emnist_letters_shift_labels(tmp_path):
    arrays = make_mnist_dir(tmp_path / "emnist", names=emnist_names("letters"), num_classes=26, label_offset=1)
    arrays["train_y"][0] = 26  # the last letter
    write_idx(tmp_path / "emnist" / emnist_names("letters")[1], arrays["train_y"])
    ds = load_dataset("emnist", tmp_path, split="letters")
    assert ds.num_classes == 26
    assert ds.train_y.tolist() == (arrays["train_y"].astype(int) - 1).tolist()
    assert ds.train_y[0].item() == 25 and ds.train_y.min() >= 0


def test_emnist_letters_reject_label_zero(tmp_path):
    arrays = make_mnist_dir(tmp_path / "emnist", names=emnist_names("letters"), num_classes=26, label_offset=1)
    arrays["test_y"][0] = 0
    write_idx(tmp_path / "emnist" / emnist_names("letters")[3], arrays["test_y"])
    with pytest.raises(DatasetError, match="emnist-letters-test-labels-idx1-ubyte.gz: labels range"):
        load_dataset("emnist", tmp_path, split="letters")


def test_emnist_unknown_split(tmp_path):
    with pytest.raises(ConfigError, match="unknown split 'kanji'.*balanced"):
        load_dataset("emnist", tmp_path, split="kanji")


def test_emnist_extracts_from_local_archive(tmp_path, monkeypatch):
    """gzip.zip already in place: only the needed members are extracted, without network."""
    staging = tmp_path / "staging"
    arrays = make_mnist_dir(staging, names=emnist_names("digits"))
    make_mnist_dir(staging, names=emnist_names("mnist"), seed=9)
    archive = tmp_path / "data" / "emnist" / "gzip.zip"
    archive.parent.mkdir(parents=True)
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(staging.iterdir()):
            zf.write(path, f"gzip/{path.name}")
    monkeypatch.setitem(sources.MD5["emnist"], "gzip.zip", md5_of(archive))
    monkeypatch.setenv("FEDISTILL_MIRROR", "http://127.0.0.1:9/unreachable")  # any network use would fail
    ds = load_dataset("emnist", tmp_path / "data", split="digits")
    assert ds.train_y.tolist() == arrays["train_y"].tolist()
    extracted = sorted(p.name for p in archive.parent.iterdir())
    assert extracted == sorted(["gzip.zip", *emnist_names("digits")])  # not the mnist split


def test_emnist_archive_md5_checked(tmp_path):
    archive = tmp_path / "emnist" / "gzip.zip"
    archive.parent.mkdir(parents=True)
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("gzip/readme.txt", "not the official archive")
    with pytest.raises(DatasetError, match="gzip.zip: expected md5 58c8d27c78d21e728a6bc7b3cc06412e"):
        load_dataset("emnist", tmp_path)


# --- CIFAR --------------------------------------------------------------------------------------------


def test_cifar10_round_trip(tmp_path):
    batches = make_cifar10_dir(tmp_path / "cifar-10-batches-py")
    ds = load_dataset("cifar10", tmp_path, verify=False)
    assert_valid_dataset(ds, 20, 4, (3, 32, 32), 10)
    first = batches["data_batch_1"]
    # data rows are the R, G, B planes, each 32x32 row-major
    c, h, w = 2, 5, 7
    assert ds.train_x[0, c, h, w].item() == first[b"data"][0, c * 1024 + h * 32 + w]
    assert torch.equal(ds.train_x[:4].reshape(4, -1), torch.from_numpy(first[b"data"]))
    expected_train = sum((batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])
    assert ds.train_y.tolist() == expected_train
    assert ds.test_y.tolist() == batches["test_batch"][b"labels"]
    assert ds.mean == (0.49139968, 0.48215827, 0.44653124)


def test_cifar10_md5_of_batches(tmp_path, monkeypatch):
    directory = tmp_path / "cifar-10-batches-py"
    make_cifar10_dir(directory)
    for name in sources.CIFAR10_FILES:
        monkeypatch.setitem(sources.MD5["cifar10"], name, md5_of(directory / name))
    load_dataset("cifar10", tmp_path)
    (directory / "data_batch_3").write_bytes(pickle.dumps(cifar_batch(4, 10, b"labels", seed=77), protocol=2))
    with pytest.raises(DatasetError, match="checksum mismatch for .*data_batch_3"):
        load_dataset("cifar10", tmp_path)


def test_cifar100_fine_labels(tmp_path):
    directory = tmp_path / "cifar-100-python"
    train = cifar_batch(6, 100, b"fine_labels", seed=1)
    train[b"coarse_labels"] = [0] * 6
    test = cifar_batch(2, 100, b"fine_labels", seed=2)
    write_pickle(directory / "train", train)
    write_pickle(directory / "test", test)
    ds = load_dataset("cifar100", tmp_path, verify=False)
    assert_valid_dataset(ds, 6, 2, (3, 32, 32), 100)
    assert ds.train_y.tolist() == train[b"fine_labels"]
    assert torch.equal(ds.test_x.reshape(2, -1), torch.from_numpy(test[b"data"]))


def test_cifar_truncated_pickle(tmp_path):
    directory = tmp_path / "cifar-10-batches-py"
    make_cifar10_dir(directory)
    path = directory / "test_batch"
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(DatasetError, match="test_batch: cannot unpickle"):
        load_dataset("cifar10", tmp_path, verify=False)


def test_cifar_missing_key(tmp_path):
    directory = tmp_path / "cifar-10-batches-py"
    make_cifar10_dir(directory)
    batch = cifar_batch(4, 10, b"labels", seed=0)
    del batch[b"labels"]
    write_pickle(directory / "data_batch_2", batch)
    with pytest.raises(DatasetError, match="data_batch_2: missing key 'labels'"):
        load_dataset("cifar10", tmp_path, verify=False)


def test_cifar_wrong_shape_and_count(tmp_path):
    directory = tmp_path / "cifar-10-batches-py"
    make_cifar10_dir(directory)
    batch = cifar_batch(4, 10, b"labels", seed=0)
    batch[b"data"] = batch[b"data"][:, :3000]
    write_pickle(directory / "data_batch_4", batch)
    with pytest.raises(DatasetError, match=r"data_batch_4: 'data' must be a uint8 array of shape \(N, 3072\)"):
        load_dataset("cifar10", tmp_path, verify=False)
    batch = cifar_batch(4, 10, b"labels", seed=0)
    batch[b"labels"] = batch[b"labels"][:3]
    write_pickle(directory / "data_batch_4", batch)
    with pytest.raises(DatasetError, match="data_batch_4 holds 3 labels but .* holds 4 images"):
        load_dataset("cifar10", tmp_path, verify=False)


def test_cifar_pickle_from_numpy_1_module_names(tmp_path):
    """The official batches name numpy.core.multiarray (numpy < 2); they must load without warnings."""
    import warnings

    directory = tmp_path / "cifar-10-batches-py"
    batches = make_cifar10_dir(directory)
    legacy = pickle.dumps(batches["test_batch"], protocol=2).replace(b"numpy._core.", b"numpy.core.")
    assert b"cnumpy.core.multiarray\n_reconstruct" in legacy
    (directory / "test_batch").write_bytes(legacy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = load_dataset("cifar10", tmp_path, verify=False)
    assert ds.test_y.tolist() == batches["test_batch"][b"labels"]


class _Boom:
    def __reduce__(self):
        return (os.remove, ("never-created-file",))


def test_cifar_pickle_globals_are_restricted(tmp_path):
    directory = tmp_path / "cifar-10-batches-py"
    make_cifar10_dir(directory)
    write_pickle(directory / "data_batch_1", {b"data": _Boom(), b"labels": []})
    with pytest.raises(DatasetError, match="data_batch_1: cannot unpickle.*refusing to load global"):
        load_dataset("cifar10", tmp_path, verify=False)


def make_cifar_archive(path: Path, batches: dict[str, dict], extra: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        members = {f"cifar-10-batches-py/{n}": pickle.dumps(b, protocol=2) for n, b in batches.items()}
        members.update(extra)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_cifar10_extracts_only_expected_members(tmp_path, monkeypatch):
    batches = {n: cifar_batch(3, 10, b"labels", seed=i) for i, n in enumerate(sources.CIFAR10_FILES)}
    root = tmp_path / "data"
    root.mkdir()
    archive = root / "cifar-10-python.tar.gz"
    hostile = {
        "../escaped": b"x",
        "/tmp/absolute-escape": b"x",
        "cifar-10-batches-py/readme.html": b"<html></html>",
    }
    make_cifar_archive(archive, batches, hostile)
    monkeypatch.setitem(sources.MD5["cifar10"], "cifar-10-python.tar.gz", md5_of(archive))
    monkeypatch.setenv("FEDISTILL_MIRROR", "http://127.0.0.1:9/unreachable")
    # one batch already present: it is kept, the others are extracted from the local archive
    write_pickle(root / "cifar-10-batches-py" / "data_batch_1", batches["data_batch_1"])
    ds = load_dataset("cifar10", root, verify=False)
    assert ds.train_x.shape[0] == 15
    assert sorted(p.name for p in (root / "cifar-10-batches-py").iterdir()) == sorted(sources.CIFAR10_FILES)
    assert not (tmp_path / "escaped").exists()
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-batches-py", "cifar-10-python.tar.gz"]


def test_cifar10_corrupt_archive(tmp_path, monkeypatch):
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(gzip.compress(b"not a tar file at all" * 100)[:50])
    monkeypatch.setitem(sources.MD5["cifar10"], "cifar-10-python.tar.gz", md5_of(archive))
    with pytest.raises(DatasetError, match="cannot read archive .*cifar-10-python.tar.gz"):
        load_dataset("cifar10", tmp_path)


def test_cifar10_missing_mentions_archive(tmp_path):
    with pytest.raises(DatasetError) as info:
        load_dataset("cifar10", tmp_path)
    message = str(info.value)
    assert "data_batch_1" in message and "test_batch" in message
    assert str((tmp_path / "cifar-10-batches-py").resolve()) in message
    assert "cifar-10-python.tar.gz" in message and "--download" in message


# --- SVHN ---------------------------------------------------------------------------------------------


def write_svhn(path: Path, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
    y = rng.integers(1, 11, (n, 1)).astype(np.uint8)
    y[0, 0] = 10  # digit 0
    path.parent.mkdir(parents=True, exist_ok=True)
    savemat(path, {"X": x, "y": y})
    return x, y


def test_svhn_round_trip(tmp_path):
    x, y = write_svhn(tmp_path / "svhn" / "train_32x32.mat", 6, seed=0)
    write_svhn(tmp_path / "svhn" / "test_32x32.mat", 2, seed=1)
    ds = load_dataset("svhn", tmp_path, verify=False)
    assert_valid_dataset(ds, 6, 2, (3, 32, 32), 10)
    n, c, h, w = 3, 1, 4, 9
    assert ds.train_x[n, c, h, w].item() == x[h, w, c, n]  # X is (H, W, C, N)
    assert torch.equal(ds.train_x, torch.from_numpy(x).permute(3, 2, 0, 1))
    expected = y[:, 0].astype(int) % 10
    assert ds.train_y.tolist() == expected.tolist()
    assert ds.train_y[0].item() == 0 and ds.train_y.max().item() <= 9
    assert ds.mean == ds.std == (0.5, 0.5, 0.5)


def test_svhn_corrupt_and_wrong_content(tmp_path):
    write_svhn(tmp_path / "svhn" / "train_32x32.mat", 3, seed=0)
    test = tmp_path / "svhn" / "test_32x32.mat"
    test.write_bytes(b"MATLAB 5.0 MAT-file, this is not really one" + bytes(50))
    with pytest.raises(DatasetError, match="test_32x32.mat: cannot read as a MATLAB v5 file"):
        load_dataset("svhn", tmp_path, verify=False)

    from scipy.io import savemat

    savemat(test, {"X": np.zeros((32, 32, 3, 2), np.uint8)})
    with pytest.raises(DatasetError, match="test_32x32.mat: missing variable 'y'"):
        load_dataset("svhn", tmp_path, verify=False)
    savemat(test, {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.array([[1], [2], [3]], np.uint8)})
    with pytest.raises(DatasetError, match="test_32x32.mat holds 3 labels but .* holds 2 images"):
        load_dataset("svhn", tmp_path, verify=False)


def test_svhn_md5(tmp_path, monkeypatch):
    write_svhn(tmp_path / "svhn" / "train_32x32.mat", 3, seed=0)
    write_svhn(tmp_path / "svhn" / "test_32x32.mat", 2, seed=1)
    with pytest.raises(DatasetError, match="train_32x32.mat: expected md5 e26dedcc434d2e4c54c9b2d4a06d8373"):
        load_dataset("svhn", tmp_path)
    for name in ("train_32x32.mat", "test_32x32.mat"):
        monkeypatch.setitem(sources.MD5["svhn"], name, md5_of(tmp_path / "svhn" / name))
    assert load_dataset("svhn", tmp_path).train_x.shape[0] == 3


# --- CINIC-10 -----------------------------------------------------------------------------------------


def make_cinic(root: Path, per_class: dict[str, int]) -> dict[str, list[np.ndarray]]:
    from PIL import Image

    rng = np.random.default_rng(0)
    written: dict[str, list[np.ndarray]] = {}
    for split, count in per_class.items():
        images = []
        for cls in sources.CINIC10_CLASSES:
            folder = root / "cinic-10" / split / cls
            folder.mkdir(parents=True)
            for i in range(count):
                array = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(array).save(folder / f"{cls}-{i}.png")
                images.append(array)
        written[split] = images
    return written


def test_cinic10_round_trip(tmp_path):
    written = make_cinic(tmp_path, {"train": 2, "test": 1})
    ds = load_dataset("cinic10", tmp_path)
    assert_valid_dataset(ds, 20, 10, (3, 32, 32), 10)
    assert ds.train_y.tolist() == [c for c in range(10) for _ in range(2)]
    assert ds.test_y.tolist() == list(range(10))
    expected = torch.from_numpy(np.stack(written["train"])).permute(0, 3, 1, 2)
    assert torch.equal(ds.train_x, expected)


def test_cinic10_greyscale_is_converted(tmp_path):
    from PIL import Image

    make_cinic(tmp_path, {"train": 1, "test": 1})
    grey = np.full((32, 32), 77, np.uint8)
    Image.fromarray(grey, mode="L").save(tmp_path / "cinic-10" / "test" / "bird" / "bird-0.png")
    ds = load_dataset("cinic10", tmp_path)
    assert (ds.test_x[2] == 77).all()


def test_cinic10_missing_and_corrupt(tmp_path):
    with pytest.raises(DatasetError) as info:
        load_dataset("cinic10", tmp_path, download=True)
    message = str(info.value)
    assert str((tmp_path / "cinic-10").resolve()) in message and "not downloaded automatically" in message

    make_cinic(tmp_path, {"train": 1, "test": 1})
    bad = tmp_path / "cinic-10" / "train" / "frog" / "frog-0.png"
    bad.write_bytes(bad.read_bytes()[:30])
    with pytest.raises(DatasetError, match="frog-0.png: cannot decode PNG"):
        load_dataset("cinic10", tmp_path)
    bad.unlink()
    with pytest.raises(DatasetError, match="no .png files in .*frog"):
        load_dataset("cinic10", tmp_path)
    (tmp_path / "cinic-10" / "train" / "frog").rmdir()
    with pytest.raises(DatasetError, match="class folder.*frog missing"):
        load_dataset("cinic10", tmp_path)


# --- digits (embedded) --------------------------------------------------------------------------------


def test_digits_offline_deterministic_stratified(tmp_path):
    ds = load_dataset("digits", tmp_path / "does-not-exist")
    assert_valid_dataset(ds, 1438, 359, (1, 8, 8), 10)
    assert ds.train_x.max().item() == 255 and ds.train_x.min().item() == 0
    assert not (tmp_path / "does-not-exist").exists()
    # every class is split about 80/20
    train_counts = torch.bincount(ds.train_y, minlength=10).double()
    test_counts = torch.bincount(ds.test_y, minlength=10).double()
    fraction = test_counts / (train_counts + test_counts)
    assert ((fraction - 0.2).abs() < 0.01).all()
    again = load_dataset("digits")
    assert torch.equal(ds.train_x, again.train_x) and torch.equal(ds.test_y, again.test_y)
    assert ds.mean[0] == pytest.approx(ds.train_x.double().mean().item() / 255)
    # pixel scaling: v in 0..16 -> round(v * 255 / 16)
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    raw = bunch.images
    values = set(np.unique(ds.train_x.numpy()).tolist())
    assert values <= {int(round(v * 255 / 16)) for v in range(17)}
    assert ds.train_x.shape[0] + ds.test_x.shape[0] == raw.shape[0]
    # read from scikit-learn's file without importing it: the same images and labels as its loader, in its order
    images = torch.zeros(raw.shape[0], 1, 8, 8, dtype=torch.uint8)
    labels = torch.zeros(raw.shape[0], dtype=torch.int64)
    from fedistill.data.sources.digits import DIGITS_SEED, DIGITS_TEST_FRACTION, _stratified_split

    train_idx, test_idx = _stratified_split(bunch.target, DIGITS_TEST_FRACTION, DIGITS_SEED)
    images[train_idx], images[test_idx] = ds.train_x, ds.test_x
    labels[train_idx], labels[test_idx] = ds.train_y, ds.test_y
    assert torch.equal(images[:, 0], torch.from_numpy(np.rint(raw * 255 / 16).astype(np.uint8)))
    assert torch.equal(labels, torch.from_numpy(bunch.target).long())


def test_digits_without_scikit_learns_file_is_one_line(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DatasetError, match=r"digits: scikit-learn's digits.csv.gz was not found .*pip install --force-reinstall scikit-learn"):
        load_dataset("digits")


# --- dispatch -----------------------------------------------------------------------------------------


def test_registered_names():
    assert set(DATASETS.names()) >= {
        "mnist", "fashion_mnist", "emnist", "cifar10", "cifar100", "svhn", "cinic10", "digits",
    }


def test_unknown_dataset_and_option(tmp_path):
    with pytest.raises(ConfigError, match="unknown dataset 'imagenet'.*cifar10.*mnist"):
        load_dataset("imagenet", tmp_path)
    with pytest.raises(ConfigError, match="unknown option.*split"):
        load_dataset("mnist", tmp_path, split="letters")


def test_data_dir_resolution(tmp_path, monkeypatch):
    from_env = tmp_path / "env"
    from_arg = tmp_path / "arg"
    cwd = tmp_path / "cwd"
    make_mnist_dir(from_env / "mnist", n_train=2)
    make_mnist_dir(from_arg / "mnist", n_train=3)
    make_mnist_dir(cwd / "data" / "mnist", n_train=4)
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("FEDISTILL_DATA", raising=False)
    assert load_dataset("mnist", verify=False).train_x.shape[0] == 4  # ./data
    monkeypatch.setenv("FEDISTILL_DATA", str(from_env))
    assert load_dataset("mnist", verify=False).train_x.shape[0] == 2
    assert load_dataset("mnist", str(from_arg), verify=False).train_x.shape[0] == 3


def test_expected_files():
    assert expected_files("mnist")[0] == "mnist/train-images-idx3-ubyte.gz"
    assert expected_files("fashion_mnist")[3] == "fashion-mnist/t10k-labels-idx1-ubyte.gz"
    assert expected_files("emnist", split="letters")[1] == "emnist/emnist-letters-train-labels-idx1-ubyte.gz"
    assert expected_files("cifar10")[-1] == "cifar-10-batches-py/test_batch"
    assert expected_files("cifar100") == ["cifar-100-python/train", "cifar-100-python/test"]
    assert expected_files("svhn") == ["svhn/train_32x32.mat", "svhn/test_32x32.mat"]
    assert len(expected_files("cinic10")) == 20
    assert expected_files("digits") == []
    with pytest.raises(ConfigError):
        expected_files("nope")


# --- dataset.train_samples: a reduced protocol's fixed training subset ------------------------------------


def test_train_subset_is_a_fixed_ordered_subset_and_leaves_the_test_split(digits):
    from fedistill.data.dataset import train_subset

    small = train_subset(digits, 300)
    again = train_subset(digits, 300)
    assert small.train_x.shape == (300, *digits.train_x.shape[1:]) and small.train_y.shape == (300,)
    assert torch.equal(small.train_x, again.train_x) and torch.equal(small.train_y, again.train_y)
    assert small.test_x is digits.test_x and small.test_y is digits.test_y
    # Every kept image is one of the original ones, with its own label, in the original order.
    flat = digits.train_x.reshape(len(digits.train_y), -1)
    rows = [int(torch.nonzero((flat == img.reshape(1, -1)).all(1))[0]) for img in small.train_x]
    assert rows == sorted(rows) and len(set(rows)) == 300
    assert torch.equal(digits.train_y[rows], small.train_y)
    # A random subset, not the first 300 (which would keep the files' order of classes).
    assert rows != list(range(300))
    # A larger subset is not required to contain a smaller one; the whole set is the dataset itself.
    assert train_subset(digits, len(digits.train_y)) is digits and train_subset(digits, None) is digits
    with pytest.raises(ValueError, match="1500 training samples of digits"):
        train_subset(digits, 1501)


def test_train_samples_reduces_what_the_clients_hold(tmp_path):
    from fedistill.runner import load_dataset_for
    from fedistill.simulation import Simulation
    from conftest import small_config

    cfg = small_config(**{"dataset.train_samples": 500})
    sim = Simulation(cfg, load_dataset_for(cfg))
    sizes = sim.federation.client_sizes()
    assert sizes.sum() == 500 and len(sizes) == 6


def test_train_samples_is_refused_for_the_synthetic_federation():
    from fedistill.config import build_config

    with pytest.raises(Exception, match="dataset.train_samples: dataset synthetic generates"):
        build_config({"dataset": {"name": "synthetic", "train_samples": 10}, "partition": {"scheme": "natural"}})
