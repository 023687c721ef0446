"""The examples/ scripts (issue 27) run as a user runs them, and do what they say."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fedistill
from fedistill.registry import ALGORITHMS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _script(name: str, *args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _accuracies(run_dir: Path) -> list[float]:
    return [json.loads(line)["test_accuracy"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sweep_example_runs_each_value_and_plots_them(tmp_path):
    out = _script("sweep.py", "--rounds", "2", "--mu", "0", "1", "--out", str(tmp_path / "sweep"), cwd=tmp_path)
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 10_000
    mu0, mu1 = (_accuracies(tmp_path / "sweep" / name) for name in ("fedprox-mu0", "fedprox-mu1"))
    assert len(mu0) == len(mu1) == 2 and mu0 != mu1 and "mu=1: final" in out
    # FedProx with mu 0 is FedAvg step for step: the sweep's first curve is FedAvg's
    fedavg = fedistill.run("digits_fedavg", rounds=2, out_dir=str(tmp_path), name="fedavg", threads=1)
    assert [row["test_accuracy"] for row in fedavg.history] == mu0


@pytest.fixture
def isolated_registry(monkeypatch):
    from fedistill import plugins

    monkeypatch.setattr(ALGORITHMS, "_entries", dict(ALGORITHMS._entries))
    monkeypatch.setattr(ALGORITHMS, "_help", dict(ALGORITHMS._help))
    monkeypatch.setattr(plugins, "_loaded", set())
    monkeypatch.setenv(plugins.PLUGIN_ENV, "")


def test_confidence_penalty_plugin_runs_from_the_cli(tmp_path, isolated_registry, capsys):
    from fedistill.cli import main

    fast = ["--rounds", "2", "--clients", "6", "--clients-per-round", "3", "--epochs", "1", "--no-progress", "--out", str(tmp_path)]
    plugin = ["--plugin", str(EXAMPLES / "confidence_penalty.py"), "--algorithm", "fedavg_cp"]
    assert main(["run", *plugin, "--set", "algorithm.beta=0.5", *fast, "--name", "cp"]) == 0
    assert main(["run", *plugin, "--set", "algorithm.beta=0", *fast, "--name", "cp0"]) == 0
    assert main(["run", "--algorithm", "fedavg", *fast, "--name", "fedavg"]) == 0
    cp, cp0, fedavg = (fedistill.load_run(tmp_path / n) for n in ("cp", "cp0", "fedavg"))
    assert (cp.config["algorithm"]["name"], cp.config["algorithm"]["beta"]) == ("fedavg_cp", 0.5)
    assert [r["test_accuracy"] for r in cp0.history] == [r["test_accuracy"] for r in fedavg.history]  # beta 0 is FedAvg
    assert [r["train_loss"] for r in cp.history] != [r["train_loss"] for r in fedavg.history]
    # the penalty written out: uniform logits over 2 classes give beta * log(1/2); a confident row gives ~0
    penalty = ALGORITHMS.get("fedavg_cp").__module__
    module = sys.modules[penalty]
    assert module.confidence_penalty(torch.zeros(4, 2), 0.5).item() == pytest.approx(0.5 * math.log(0.5))
    assert module.confidence_penalty(torch.tensor([[30.0, 0.0]]), 1.0).item() == pytest.approx(0.0, abs=1e-9)
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    expected = 0.3 * float((probs * probs.log()).sum())
    assert module.confidence_penalty(probs.log(), 0.3).item() == pytest.approx(expected, rel=1e-5)


def test_the_plugins_local_cp_is_local_at_beta_zero_on_clients_of_different_architectures(tmp_path, isolated_registry):
    """examples/confidence_penalty.py's ``local_cp`` (the plugin docs/guides/rank.md ranks on fd-hetero-mnist): at
    beta 0 every client's accuracy equals Local's in every round, bit for bit; at beta 1 the training differs."""
    from fedistill import plugins

    plugins.add_plugins([str(EXAMPLES / "confidence_penalty.py")])
    base = {"dataset": {"name": "digits"}, "model": {"clients": ["digits_cnn", "logistic"]}, "rounds": 2,
            "partition": {"scheme": "lda", "num_clients": 4, "alpha": 0.5, "per_client_test": True}, "clients_per_round": 4,
            "local": {"batch_size": 32, "lr": 0.05}, "run": {"threads": 1, "progress": False}}  # fmt: skip
    runs = {name: fedistill.run(base, algorithm=algorithm, out_dir=str(tmp_path), name=name, threads=1)
            for name, algorithm in (("local", "local_only"), ("cp0", {"name": "local_cp", "beta": 0.0}),
                                    ("cp1", {"name": "local_cp", "beta": 1.0}))}  # fmt: skip
    personal = {name: [r["personal_accuracies"] for r in run.history] for name, run in runs.items()}
    assert personal["cp0"] == personal["local"]
    assert [r["train_loss"] for r in runs["cp1"].history] != [r["train_loss"] for r in runs["local"].history]
    assert runs["cp1"].history[-1]["bytes_up"] == 0  # nothing travels, as in Local


def test_custom_dataset_example_learns_its_four_classes(tmp_path):
    out = _script("custom_dataset.py", "--rounds", "3", "--out", str(tmp_path / "bars"), cwd=tmp_path)
    accuracies = _accuracies(tmp_path / "bars" / "fedavg-bars")
    assert len(accuracies) == 3 and accuracies[-1] > 60, (accuracies, out)  # chance is 25 %
    config = fedistill.load_run(tmp_path / "bars" / "fedavg-bars").config
    assert config["dataset"]["name"] == "bars" and config["model"]["name"] == "mlp"


def test_rank_my_method_example_ranks_a_plugin_against_published_cells(tmp_path):
    """examples/rank_my_method.py on a tiny published suite: fedavg_cp at beta 0 is FedAvg, so it ties with it."""
    import yaml

    from fedistill.studies.bench import bench, load_suite

    suite = {
        "name": "tiny-example", "title": "tiny", "seeds": [0, 1],
        "protocol": {"rounds": 2, "clients_per_round": 3, "dataset": {"name": "digits"},
                     "partition": {"num_clients": 6, "seed": 3, "scheme": "lda", "alpha": 0.3},
                     "local": {"epochs": 1, "batch_size": 32, "lr": 0.05}},
        "settings": {"lda": {"label": "digits LDA", "config": {}}},
        "methods": {"FedAvg": {"config": {"algorithm": {"name": "fedavg"}}},
                    "FedProx": {"config": {"algorithm": {"name": "fedprox", "mu": 1.0}}}},
    }  # fmt: skip
    path = tmp_path / "tiny-example.yaml"
    path.write_text(yaml.safe_dump(suite))
    bench(load_suite(str(path)), tmp_path / "published", overrides=["run.threads=1"])
    cells = tmp_path / "published" / "tiny-example" / "cells.json"
    out = _script("rank_my_method.py", "--suite", str(path), "--published", str(cells), "--out", str(tmp_path / "mine"),
                  "--set", "algorithm.beta=0", "--set", "run.threads=1", cwd=tmp_path)  # fmt: skip
    assert "lda: fedavg_cp ranks" in out and "fedavg_cp ~ FedAvg: +0.00" in out


def test_hetero_clients_example_trains_three_architectures_and_reports_what_each_method_sends(tmp_path):
    """examples/hetero_clients.py (docs/guides/model-groups.md): every method trains the three architectures and
    ends above chance (10 %) on the clients' own test splits; Local sends nothing, LG-FedAvg nine heads of
    64 x 10 + 10 floats and n_k a round (9 x 2,608 B = 23.5 kB), FD's per-class logits less than FedProto's
    per-class 64-wide prototypes."""
    out = _script("hetero_clients.py", "--rounds", "2", "--out", str(tmp_path / "hetero"), cwd=tmp_path)
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in out.splitlines()[1:]}
    assert set(rows) == {"local_only", "fd", "fedproto", "fedtgp", "lg_fedavg"}, out
    assert all(accuracy > 20 for accuracy, _ in rows.values()), out
    assert rows["local_only"][1] == 0.0 and rows["lg_fedavg"][1] == pytest.approx(23.5) and 0 < rows["fd"][1] < rows["fedproto"][1]
    config = fedistill.load_run(tmp_path / "hetero" / "fedproto").config
    assert config["model"]["clients"] == ["digits_cnn", "resnet8", "logistic"]
