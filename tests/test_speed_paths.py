"""Issue 15's engine paths that a CPU can check: the accelerator data path, on-device evaluation counts, the
client state kept off the device between clients, and the server's seconds per round."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from fedistill.algorithms.local import evaluate
from conftest import toy_dataset
from fedistill.data.pipeline import AugmentSpec, TensorPipeline
from fedistill.engine.executors import state_to
from fedistill.simulation import Simulation


def _dataset(n=53, c=1, h=12, w=12):
    return toy_dataset(n, c, h, w, classes=5, seed=1, mean=0.4, std=0.3, test=9)


def test_the_accelerator_epoch_path_gives_the_host_paths_batches():
    """The accelerator path draws an epoch's order and augmentation up front and applies them from one table;
    forced onto the CPU it must give exactly the batches of the per-batch host path (same draws, same order)."""
    ds = _dataset()
    spec = AugmentSpec(crop_padding=4, flip=True, cutout=6)
    host = TensorPipeline(ds, spec)
    table = TensorPipeline(ds, spec)
    table.on_host = False  # the device path, here on the CPU
    indices = torch.arange(3, 50)
    a = list(host.epoch_batches(indices, 8, torch.Generator().manual_seed(7)))
    b = list(table.epoch_batches(indices, 8, torch.Generator().manual_seed(7)))
    assert [x.shape[0] for x, _ in a] == [8] * 5 + [7]
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_evaluate_counts_match_a_direct_computation():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    x = torch.randn(10, 1, 2, 2)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    result = evaluate(model, batches, per_sample=True)
    with torch.no_grad():
        logits = model(x)
    guesses = logits.argmax(1)
    assert result.accuracy == int((guesses == y).sum()) / 10
    assert math.isclose(result.loss, float(F.cross_entropy(logits, y)), rel_tol=1e-6)
    assert result.predictions.tolist() == [int((guesses == k).sum()) for k in range(3)]
    assert result.correct.tolist() == (guesses == y).tolist()
    assert result.predictions.device.type == "cpu" and result.correct.device.type == "cpu"


def test_state_to_moves_every_nested_tensor_and_keeps_the_rest():
    state = {"c": torch.ones(3, dtype=torch.float64), "nested": {"m": [torch.zeros(2), 5]}, "round": 4}
    moved = state_to(state, torch.device("meta"))
    assert moved["c"].device.type == "meta" and moved["c"].dtype == torch.float64
    assert moved["nested"]["m"][0].device.type == "meta" and moved["nested"]["m"][1] == 5
    assert moved["round"] == 4 and state["c"].device.type == "cpu"  # the original is untouched


def test_every_round_records_the_servers_seconds_beside_the_clients(make_config, digits):
    history = Simulation(make_config(rounds=2), digits).run()
    for row in history:
        assert row["server_seconds"] >= 0 and row["train_seconds"] >= 0
        assert row["server_seconds"] + row["train_seconds"] + row["eval_seconds"] <= row["seconds"] + 1e-6


def test_the_bf16_teacher_gives_autocasts_logits_bit_for_bit():
    """FedLMD/FedNTD's frozen teacher is kept in bf16 under bf16 precision (rounded once, not per batch); its
    logits must equal the fp32 teacher's under autocast exactly, and a model with BatchNorm keeps fp32."""
    from types import SimpleNamespace

    from fedistill.algorithms.teacher import GlobalTeacher, bf16_exact
    from fedistill.models import build_model
    from fedistill.models.flat import get_flat

    torch.manual_seed(3)
    for name, shape in (("cnn", (1, 28, 28)), ("digits_cnn", (1, 8, 8)), ("mlp", (1, 8, 8))):
        student = build_model(name, shape, 10).to(memory_format=torch.channels_last)
        weights = get_flat(student) + 0.01 * torch.randn(get_flat(student).shape)
        x = torch.randn(6, *shape).contiguous(memory_format=torch.channels_last)
        reference = build_model(name, shape, 10).to(memory_format=torch.channels_last).eval()
        from fedistill.models.flat import set_flat

        set_flat(reference, weights)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = reference(x)
        teacher = GlobalTeacher()
        client = SimpleNamespace(model=student, precision="bf16")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = GlobalTeacher.logits(teacher.load(client, weights), x)
        assert next(teacher._model.parameters()).dtype == torch.bfloat16
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    assert not bf16_exact(build_model("resnet8", (3, 32, 32), 10))


def test_resume_refuses_a_different_partition_of_the_same_configuration(make_config, digits, tmp_path):
    import pytest

    from fedistill.engine.checkpoint import load_checkpoint, save_checkpoint
    from fedistill.simulation import Federation, build_federation
    from fedistill.errors import ConfigError

    cfg = make_config(rounds=2)
    Simulation(cfg, digits, run_dir=tmp_path).run()
    fed = build_federation(cfg, digits)
    # Same sizes, one sample swapped between clients 0 and 1: what an older sampler of the same seed would give.
    train = [ix.clone() for ix in fed.train_indices]
    train[0][0], train[1][0] = fed.train_indices[1][0], fed.train_indices[0][0]
    moved = Federation(digits, train, fed.test_indices)
    assert moved.partition_digest() != fed.partition_digest()
    with pytest.raises(ConfigError, match="partition differs"):
        Simulation(make_config(rounds=4), digits, run_dir=tmp_path, federation=moved).restore()
    assert Simulation(make_config(rounds=4), digits, run_dir=tmp_path).restore()  # the same partition resumes

    # A checkpoint from before the fingerprint: accepted, except for client_dirichlet, whose sampler changed.
    path = tmp_path / "checkpoint.pt"
    payload = load_checkpoint(path)
    del payload["partition_digest"]
    save_checkpoint(path, payload)
    assert Simulation(make_config(rounds=4), digits, run_dir=tmp_path).restore()
    old = make_config(rounds=2, **{"partition.scheme": "client_dirichlet", "partition.alpha": 0.5})
    Simulation(old, digits, run_dir=tmp_path / "cd").run()
    payload = load_checkpoint(tmp_path / "cd" / "checkpoint.pt")
    del payload["partition_digest"]
    save_checkpoint(tmp_path / "cd" / "checkpoint.pt", payload)
    with pytest.raises(ConfigError, match="predates partition fingerprints"):
        Simulation(make_config(rounds=4, **{"partition.scheme": "client_dirichlet", "partition.alpha": 0.5}), digits, run_dir=tmp_path / "cd").restore()


def test_a_cuda_run_asks_cudnn_for_deterministic_algorithms(monkeypatch):
    """Exact resume on a GPU needs cuDNN's deterministic algorithms and no per-shape autotuning; the CPU
    path leaves the flags alone. (No GPU in CI: the flags are checked, not a CUDA run.)"""
    from fedistill.engine.perf import deterministic_kernels

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    asked: list[tuple] = []  # recorded, not applied: the flag is process-wide and this process runs on the CPU
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, **kw: asked.append((mode, kw)))
    deterministic_kernels(torch.device("cpu"))
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic and not asked
    deterministic_kernels(torch.device("cuda", 0))
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    # beyond cuDNN: deterministic variants of every op (warn where none exists) and cuBLAS's fixed workspace
    assert asked == [(True, {"warn_only": True})] and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
