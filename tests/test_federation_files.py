"""A federation read from files (issue 63 item 4): HtFLlib's ``{train,test}/<client>.npz`` taken as they are, each
problem with the files one clear line, a pickle that would run code refused before it runs, and the pooled
accuracy beside the mean over clients."""

from __future__ import annotations

import builtins
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedistill.cli import main
from fedistill.config import build_config
from fedistill.data.pipeline import TensorPipeline
from fedistill.data.sources import load_dataset
from fedistill.engine.federation import build_federation
from fedistill.engine.summary import personal_metrics, personal_metrics_from_counts, personal_metrics_of_ranges, summarise
from fedistill.errors import ConfigError, DatasetError
from fedistill.protocol import EVAL_PREFIX
from fedistill.simulation import Simulation

TRAIN_SIZES = (20, 14, 26)
TEST_SIZES = (10, 4, 16)  # unequal, so that the pooled accuracy and the mean over clients differ in general
CLASSES = 4


def write_client(path: Path, x: np.ndarray, y: np.ndarray, form: str = "data") -> None:
    """One client file: HtFLlib's pickled dict under ``data`` (np.savez_compressed), or plain ``x`` and ``y`` arrays."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if form == "data":
        np.savez_compressed(path, data={"x": x, "y": y})
    else:
        np.savez(path, x=x, y=y)


def make_federation(root: Path, shape=(1, 28, 28), form: str = "data", seed: int = 0) -> dict[str, list]:
    """Three clients in ``root``: float32 images on [-1, 1] whose mean encodes the label (so a model can learn
    them), int64 labels; returns {split: [(x, y) per client]} as written."""
    rng = np.random.default_rng(seed)
    written: dict[str, list] = {"train": [], "test": []}
    for split, sizes in (("train", TRAIN_SIZES), ("test", TEST_SIZES)):
        for cid, n in enumerate(sizes):
            y = rng.integers(0, CLASSES, n).astype(np.int64)
            y[0] = CLASSES - 1 if cid == 0 else y[0]  # the largest class occurs, so the inferred count is CLASSES
            noise = rng.uniform(-0.2, 0.2, (n, *shape)).astype(np.float32)
            x = (noise + (y[:, None, None, None] / (CLASSES - 1) * 1.6 - 0.8)).astype(np.float32)
            write_client(root / split / f"{cid}.npz", x, y, form)
            written[split].append((x, y))
    return written


def federation_config(root: Path, **overrides):
    base = {
        "dataset": {"name": "npz_federation", "data_dir": str(root)},
        "partition": {"num_clients": 3},
        "clients_per_round": 3,
        "rounds": 1,
        "model": {"name": "mlp"},
        "local": {"epochs": 1, "batch_size": 10, "lr": 0.05},
        "run": {"progress": False, "figures": False, "threads": 1},
    }
    return build_config(base, overrides)


# --------------------------------------------------------------------------------------------------
# Loading: the files as they are
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["data", "plain"])
def test_the_engine_sees_exactly_the_files(tmp_path, form):
    written = make_federation(tmp_path, form=form)
    cfg = federation_config(tmp_path)
    assert cfg.partition.scheme == "natural" and cfg.partition.per_client_test and cfg.accuracy_metric() == "personal"
    ds = load_dataset("npz_federation", tmp_path, **cfg.dataset_options())
    assert ds.num_classes == CLASSES and ds.input_shape == (1, 28, 28)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    fed = build_federation(cfg, ds)
    assert fed.num_clients == 3
    assert fed.client_sizes().tolist() == list(TRAIN_SIZES)
    assert [int(ix.numel()) for ix in fed.test_indices] == list(TEST_SIZES)
    # the per-client label counts are the files' own
    expected = np.stack([np.bincount(y, minlength=CLASSES) for _, y in written["train"]])
    assert np.array_equal(fed.class_counts(), expected)
    # what a client trains on and is tested on, after the pipeline's normalisation, is bit for bit its files
    pipeline = TensorPipeline(ds)
    for cid in range(3):
        x, y = pipeline.clean_batch(fed.train_indices[cid])
        assert torch.equal(x, torch.from_numpy(written["train"][cid][0])) and torch.equal(y, torch.from_numpy(written["train"][cid][1]))
        (tx, ty), = pipeline.test_batches_of(fed.test_indices[cid], batch_size=100)
        assert torch.equal(tx, torch.from_numpy(written["test"][cid][0])) and torch.equal(ty, torch.from_numpy(written["test"][cid][1]))
    # the run's test split is the clients' test files one after another (the pooled test set)
    assert torch.equal(ds.test_x, torch.from_numpy(np.concatenate([x for x, _ in written["test"]])))


def test_config_surface(tmp_path):
    cfg = federation_config(tmp_path)
    assert cfg.model_name() == "mlp" and cfg.augmentations() == []
    assert build_config({"dataset": {"name": "npz_federation"}, "partition": {"num_clients": 3}, "clients_per_round": 3}).model_name() == "cnn"
    resolved = cfg.resolved_dict()
    assert resolved["partition"]["scheme"] == "natural" and resolved["partition"]["per_client_test"] is True
    # per_client_test false is kept: the global model on all the test files pooled
    assert federation_config(tmp_path, **{"partition.per_client_test": False}).accuracy_metric() == "global"
    with pytest.raises(ConfigError, match="partition.scheme: dataset npz_federation makes its own clients; use partition.scheme: natural"):
        federation_config(tmp_path, **{"partition.scheme": "lda"})
    with pytest.raises(ConfigError, match="dataset.num_classes: only npz_federation takes it"):
        build_config({"dataset": {"num_classes": 10}})
    with pytest.raises(ConfigError, match="dataset.resize: npz_federation takes its files' images as they are"):
        federation_config(tmp_path, **{"dataset.resize": 32})
    with pytest.raises(ConfigError, match="dataset.train_samples: npz_federation's clients are its files"):
        federation_config(tmp_path, **{"dataset.train_samples": 10})
    with pytest.raises(ConfigError, match="dataset.num_classes"):
        federation_config(tmp_path, **{"dataset.num_classes": 1})


def test_num_classes_given_or_inferred(tmp_path):
    make_federation(tmp_path)
    assert load_dataset("npz_federation", tmp_path, num_classes=7).num_classes == 7  # classes absent from the files
    with pytest.raises(DatasetError, match=r"0\.npz: label 3 is out of range for dataset.num_classes 3 \(labels 0..2\)"):
        load_dataset("npz_federation", tmp_path, num_classes=3)
    with pytest.raises(ConfigError, match=r"partition.num_clients: 5, but .* holds 3 clients \(train/0.npz .. train/2.npz\); set partition.num_clients: 3"):
        load_dataset("npz_federation", tmp_path, num_clients=5)


# --------------------------------------------------------------------------------------------------
# Validation: one line each, naming what is wrong and how to fix it
# --------------------------------------------------------------------------------------------------
def _client(root: Path, split: str = "train", cid: int = 1) -> Path:
    return root / split / f"{cid}.npz"


def _rewrite(root: Path, split: str, cid: int, **changes) -> None:
    """Rewrite one client's file with some of its arrays changed (HtFLlib's form)."""
    x, y = changes.get("x"), changes.get("y")
    if x is None or y is None:
        data = np.load(_client(root, split, cid), allow_pickle=True)["data"].item()  # our own test file: trusted
        x = data["x"] if x is None else x
        y = data["y"] if y is None else y
    write_client(_client(root, split, cid), x, y)


def _spoil_name(root: Path) -> None:
    (root / "train" / "x1.npz").write_bytes(b"")


SPOILERS = {
    "no directory": (lambda r: None, r"does not exist; point dataset.data_dir \(--data-dir\) at the directory holding train/<client>.npz and test/<client>.npz"),
    "no train folder": (lambda r: os.rename(r / "train", r / "other"), "no directory .*train; point dataset.data_dir"),
    "no test file": (lambda r: _client(r, "test", 2).unlink(), "client 2 has train/2.npz but no test/2.npz"),
    "no train file": (lambda r: _client(r, "train", 1).unlink(), "client 1 has test/1.npz but no train/1.npz"),
    "ids with a gap": (
        lambda r: [os.rename(_client(r, s, 2), _client(r, s, 3)) for s in ("train", "test")],
        r"must be 0..K-1 without gaps, but 2 is missing among 0..3; renumber the files",
    ),
    "a name that is no id": (_spoil_name, r"x1.npz: client files are named <id>.npz"),
    "not an npz": (lambda r: _client(r).write_text("x,y\n1,2\n"), r"1.npz: not an .npz archive"),
    "truncated npz": (lambda r: _client(r).write_bytes(_client(r).read_bytes()[:300]), r"1.npz: (not an .npz archive|cannot be read)"),
    "a lone npy": (lambda r: np.save(open(_client(r), "wb"), np.zeros(3)), r"1.npz: a single .npy array, not an .npz archive"),
    "no data entry": (lambda r: np.savez(_client(r), images=np.zeros(3)), r"1.npz: holds images but no data entry"),
    "data not x and y": (lambda r: np.savez(_client(r), data={"images": np.zeros(3)}), r"1.npz: data holds a dict with keys \['images'\], not a dict with x and y"),
    "data a plain array": (lambda r: np.savez(_client(r), data=np.zeros(3)), r"1.npz: data is a plain float64 array of shape \(3,\)"),
    "x and y lengths": (lambda r: _rewrite(r, "train", 1, y=np.zeros(13, np.int64)), r"1.npz: x holds 14 images but y 13 labels"),
    "x without channels": (
        lambda r: _rewrite(r, "train", 1, x=np.zeros((14, 28, 28), np.float32)),
        r"1.npz: x has shape \(14, 28, 28\); it must be \(n, C, H, W\) images.*x\[:, None\]",
    ),
    "image shapes differ": (
        lambda r: _rewrite(r, "test", 2, x=np.zeros((16, 1, 32, 32), np.float32)),
        r"test/2.npz: its images are 1x32x32 \(C x H x W\), but .*0.npz's are 1x28x28; every client's images must have one shape",
    ),
    "float labels": (lambda r: _rewrite(r, "train", 1, y=np.zeros(14, np.float32)), r"1.npz: y is float32; the labels must be integers"),
    "negative labels": (lambda r: _rewrite(r, "train", 1, y=np.full(14, -2, np.int64)), r"1.npz: label -2 is negative"),
    "an empty client": (
        lambda r: _rewrite(r, "train", 1, x=np.zeros((0, 1, 28, 28), np.float32), y=np.zeros(0, np.int64)),
        r"train/1.npz: the client has no training samples",
    ),
    "every test file empty": (
        lambda r: [_rewrite(r, "test", c, x=np.zeros((0, 1, 28, 28), np.float32), y=np.zeros(0, np.int64)) for c in range(3)],
        r"every test file in .* is empty",
    ),
    "non-finite values": (
        lambda r: _rewrite(r, "train", 1, x=np.where(np.arange(14)[:, None, None, None] == 3, np.nan, np.zeros((14, 1, 28, 28), np.float32)).astype(np.float32)),
        r"1.npz: x holds 784 non-finite values",
    ),
    "unnormalised bytes": (lambda r: _rewrite(r, "train", 1, x=np.zeros((14, 1, 28, 28), np.uint8)), r"1.npz: x is uint8, but the images must be floats"),
}


@pytest.mark.parametrize("case", sorted(SPOILERS))
def test_each_problem_is_one_clear_line(tmp_path, case):
    root = tmp_path / "federation"
    if case != "no directory":
        make_federation(root)
    spoil, expected = SPOILERS[case]
    spoil(root)
    with pytest.raises(DatasetError, match=expected) as raised:
        load_dataset("npz_federation", root)
    assert "\n" not in str(raised.value)


def test_the_cli_says_it_in_one_line(tmp_path, capsys):
    root = tmp_path / "federation"
    make_federation(root)
    _client(root, "test", 0).unlink()
    code = main(["run", "--dataset", "npz_federation", "--data-dir", str(root), "--clients", "3", "--clients-per-round", "3", "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and "no test/0.npz" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# --------------------------------------------------------------------------------------------------
# A pickle that would run code is refused before it runs
# --------------------------------------------------------------------------------------------------
class _Shell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Eval:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize(
    "payload, global_name",
    [
        (lambda m: _Shell(m), f"{os.system.__module__}.system"),  # the whole entry a command
        (lambda m: {"x": _Eval(m), "y": np.zeros(3, np.int64)}, "builtins.eval"),  # hidden inside HtFLlib's dict
    ],
)
def test_a_malicious_pickle_is_refused_without_running(tmp_path, payload, global_name):
    root = tmp_path / "federation"
    make_federation(root)
    marker = tmp_path / "pwned"
    np.savez_compressed(_client(root, "train", 1), data=payload(marker))  # numpy pickles the object as it is
    with pytest.raises(DatasetError, match=rf"1.npz: refusing to unpickle data: it names the global {global_name}, which could run code") as raised:
        load_dataset("npz_federation", root)
    assert "\n" not in str(raised.value)
    assert not marker.exists()


# --------------------------------------------------------------------------------------------------
# Per-client evaluation and the pooled accuracy
# --------------------------------------------------------------------------------------------------
def test_pooled_accuracy_is_correct_over_all_test_samples():
    """Hand case: client 0 gets 1 of 2 right (50 %), client 1 3 of 8 (37.5 %), client 2 has no test sample. Mean
    over clients 43.75 %, pooled 4 / 10 = 40 %; the three ways the engine measures give the same."""
    t, f = True, False
    by_client = {0: torch.tensor([t, f]), 1: torch.tensor([t, t, t, f, f, f, f, f]), 2: torch.tensor([], dtype=torch.bool)}
    row = personal_metrics(by_client)
    assert row["personal_accuracy"] == 43.75 and row["personal_pooled_accuracy"] == 40.0
    ranges = personal_metrics_of_ranges(torch.cat(list(by_client.values())), np.array([0, 2, 10, 10]))
    replies = {cid: {f"{EVAL_PREFIX}correct": int(c.sum()), f"{EVAL_PREFIX}count": c.numel()} for cid, c in by_client.items()}
    counts = personal_metrics_from_counts(replies)
    for other in (ranges, counts):
        assert other["personal_accuracy"] == 43.75 and other["personal_pooled_accuracy"] == 40.0
    history = [{"round": 1, "bytes_down": 0, "bytes_up": 0, "seconds": 0.0, "train_loss": 1.0, **row},
               {"round": 2, "bytes_down": 0, "bytes_up": 0, "seconds": 0.0, "train_loss": 1.0, **row, "personal_pooled_accuracy": 30.0}]  # fmt: skip
    summary = summarise(history, None, "personal")
    assert summary["final_personal_pooled_accuracy"] == 30.0 and summary["best_personal_pooled_accuracy"] == 40.0


def test_each_client_is_evaluated_on_its_own_test_file(tmp_path):
    """The global model's accuracy on each client's test file, computed here from the files, is the client's
    personal accuracy; the pooled one is their correct predictions over all test samples."""
    written = make_federation(tmp_path)
    cfg = federation_config(tmp_path)
    sim = Simulation(cfg, load_dataset("npz_federation", tmp_path, **cfg.dataset_options()))
    (row,) = sim.run()
    with torch.inference_mode():
        right = [(sim.server.model(torch.from_numpy(x)).argmax(1) == torch.from_numpy(y)) for x, y in written["test"]]
    assert row["personal_clients"] == [0, 1, 2]
    assert row["personal_accuracies"] == pytest.approx([100.0 * float(r.double().mean()) for r in right], abs=1e-9)
    pooled = 100.0 * sum(int(r.sum()) for r in right) / sum(TEST_SIZES)
    assert row["personal_pooled_accuracy"] == pytest.approx(pooled, abs=1e-9)
    assert row["test_accuracy"] == pytest.approx(pooled, abs=1e-6)  # the global test set is the pooled test files


def test_fedistill_run_on_a_federation_from_files(tmp_path, capsys):
    root = tmp_path / "federation"
    make_federation(root)
    args = ["run", "--dataset", "npz_federation", "--data-dir", str(root), "--algorithm", "fedavg", "--clients", "3",
            "--clients-per-round", "3", "--rounds", "2", "--epochs", "1", "--batch-size", "10", "--no-progress",
            "--set", "run.figures=false", "--set", "run.threads=1", "--out", str(tmp_path / "runs"), "--name", "r"]  # fmt: skip
    assert main(args) == 0
    run = tmp_path / "runs" / "r"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    assert [r["round"] for r in rows] == [1, 2] and summary["accuracy_metric"] == "personal"
    for row in rows:
        # the reference's metric written out from the per-client numbers: total correct / total test samples
        correct = [round(acc * n / 100.0) for acc, n in zip(row["personal_accuracies"], TEST_SIZES)]
        assert row["personal_pooled_accuracy"] == pytest.approx(100.0 * sum(correct) / sum(TEST_SIZES), abs=1e-9)
        assert row["personal_accuracy"] == pytest.approx(float(np.mean(row["personal_accuracies"])), abs=1e-9)
    assert summary["final_accuracy"] == rows[-1]["personal_accuracy"]
    assert summary["final_personal_pooled_accuracy"] == rows[-1]["personal_pooled_accuracy"]
    assert "personal_pooled_accuracy" in (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert len((run / "partition_counts.csv").read_text().splitlines()) == 4  # header + the 3 files' clients
