"""The class-distribution diagnostic behind FedLMD Fig. 2: per round, the labels the round's clients train on
and the classes the global model predicts on the test set."""

from __future__ import annotations

import csv
import math

import numpy as np
import torch

from fedistill.simulation import Simulation, kl_from_uniform
from fedistill.report.plots import class_distribution_matrices


def test_kl_from_uniform_by_hand():
    assert kl_from_uniform(torch.tensor([5, 5, 5, 5])) == 0.0
    assert math.isclose(kl_from_uniform(torch.tensor([8, 0, 0, 0])), math.log(4))
    # p = (3/4, 1/4) over C = 2: log 2 + 3/4 log 3/4 + 1/4 log 1/4
    assert math.isclose(kl_from_uniform(torch.tensor([3, 1])), math.log(2) + 0.75 * math.log(0.75) + 0.25 * math.log(0.25))


def test_rows_hold_the_rounds_training_labels_and_the_test_predictions(make_config, digits):
    sim = Simulation(make_config(rounds=2, **{"partition.alpha": 0.1}), digits)
    counts = sim.federation.class_counts()
    for rnd in (1, 2):
        row = sim.run_round(rnd)
        selected = sim.server_runtime.select_clients(rnd)
        assert row["train_label_counts"] == counts[selected].sum(axis=0).tolist()
        assert sum(row["prediction_counts"]) == digits.test_y.numel()
        assert len(row["prediction_counts"]) == digits.num_classes
        # The predictions agree with an independent pass over the test set.
        with torch.no_grad():
            x = (digits.test_x.float() / 255 - digits.mean[0]) / digits.std[0]
            guesses = sim.server.model.eval()(x).argmax(1)
        expected = torch.bincount(guesses, minlength=10).tolist()
        assert sum(abs(a - b) for a, b in zip(row["prediction_counts"], expected)) <= 2  # batched vs one pass
        assert math.isclose(row["prediction_kl_uniform"], kl_from_uniform(torch.tensor(row["prediction_counts"])))


def test_run_directory_gets_the_csv_and_heatmaps_and_compare_draws_them(tmp_path):
    from fedistill.cli import main

    args = ["run", "--dataset", "digits", "--rounds", "3", "--set", "partition.num_clients=6", "--set", "clients_per_round=3", "--set", "run.progress=false"]
    for name in ("a", "b"):
        assert main([*args, "--out", str(tmp_path), "--name", name]) == 0
    run = tmp_path / "a"
    assert (run / "class_distributions.png").stat().st_size > 0
    with open(run / "class_distributions.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["round"], r["kind"]) for r in rows] == [(str(i), k) for i in (1, 2, 3) for k in ("train_labels", "predictions")]
    from fedistill.data.sources import load_dataset

    assert sum(int(rows[1][f"class_{c}"]) for c in range(10)) == load_dataset("digits").test_y.numel()
    with open(run / "metrics.csv") as fh:
        assert "prediction_counts" not in next(csv.reader(fh))  # lists stay out of metrics.csv
    out = tmp_path / "cmp.png"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert (tmp_path / "cmp_class_distributions.png").stat().st_size > 0


def test_heatmap_rows_are_per_round_proportions():
    history = [
        {"round": 1, "train_label_counts": [3, 1, 0], "prediction_counts": [0, 0, 10]},
        {"round": 2, "train_label_counts": [0, 0, 5]},
    ]
    m = class_distribution_matrices(history)
    rounds, share = m["training labels of the round's clients"]
    assert rounds == [1, 2] and np.allclose(share, [[0.75, 0.25, 0], [0, 0, 1]])
    rounds, share = m["global model's test predictions"]
    assert rounds == [1] and np.allclose(share, [[0, 0, 1]])
