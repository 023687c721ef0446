"""Seconds per round of the distillation methods against FedAvg on the FedLMD MNIST protocol.

FedLMD and FedNTD add one teacher forward per batch (the frozen global model, inference mode, one module per
worker process); FedLMD-Tf and FedNTD-Tf add only a few C-wide tensor operations. The same rounds, clients
and batches for every method (LDA α=0.1, 100 clients, 10 per round, E=5, B=50, bf16, two one-thread
workers by default). Training time only (``train_seconds``: broadcast + local updates), evaluation excluded.

    PYTHONPATH=src python benchmarks/bench_fedlmd_overhead.py --data-dir ../shared/data --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

METHODS = [
    ("FedAvg", {"algorithm.name": "fedavg"}),
    ("FedLMD", {"algorithm.name": "fedlmd"}),
    ("FedLMD-Tf", {"algorithm.name": "fedlmd_tf"}),
    ("FedNTD", {"algorithm.name": "fedntd"}),
    ("FedNTD-Tf", {"algorithm.name": "fedntd", "algorithm.teacher_free": True}),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--precision", default="bf16")
    args = parser.parse_args()

    from fedistill.config import build_config, read_yaml
    from fedistill.simulation import Simulation
    from fedistill.runner import load_dataset_for

    base = read_yaml("configs/mnist_fedlmd_protocol_fedavg.yaml")
    rows = []
    dataset = None
    for label, overrides in METHODS:
        cfg = build_config(
            base,
            {
                **overrides,
                "rounds": args.rounds,
                "dataset.data_dir": args.data_dir,
                "eval.every": 1000,  # evaluate only after the last round
                "run.workers": args.workers,
                "run.precision": args.precision,
                "run.progress": False,
            },
        )
        dataset = dataset or load_dataset_for(cfg)
        sim = Simulation(cfg, dataset)
        start = time.perf_counter()
        history = sim.run()
        wall = time.perf_counter() - start
        # Round 1 includes starting the worker processes; report rounds 2.. when there are any.
        train = [r["train_seconds"] for r in history[1:]] or [history[0]["train_seconds"]]
        rows.append((label, statistics.fmean(train), history[-1]["test_accuracy"], wall))
    reference = rows[0][1]
    print(f"| method | train s/round | × FedAvg | accuracy after {args.rounds} rounds | wall s |")
    print("|---|---|---|---|---|")
    for label, seconds, accuracy, wall in rows:
        print(f"| {label} | {seconds:.2f} | {seconds / reference:.2f} | {accuracy:.2f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
