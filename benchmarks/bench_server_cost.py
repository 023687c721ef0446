"""Server seconds against client seconds per round for the server-side methods (issue 15, target 2).

FedFTG, DaFKD, FedGen and FedDF spend time on the server after aggregation (a fine-tune, a distillation, a
generator); every round records it as ``server_seconds`` beside ``train_seconds`` (the clients' local updates).
The target: no method spends more on the server than its clients spend training in the same round.

The protocol is a column of a ``fedistill reproduce`` preset (default: ``benchmarks/presets/dafkd_reduced.yaml``,
MNIST alpha 0.1, 20 clients, 8 per round, E = 2, B = 32, the FedNTD CNN, bf16), each method with the preset's own
settings, for ``--rounds`` rounds (s/round excludes round 1 when there are more). ``--epochs`` overrides E, to
put the server's fixed cost beside the paper's E = 20.

    PYTHONPATH=src python benchmarks/bench_server_cost.py --data-dir ../shared/data [--rounds 3]
        [--methods FedAvg,FedFTG,FedGen,FedDF,DaFKD] [--epochs 2] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from fedistill.data.sources import load_dataset
from fedistill.simulation import Simulation
from fedistill.studies.reproduce import load_preset, run_config

HERE = Path(__file__).resolve().parent


def measure(cfg, dataset) -> dict:
    sim = Simulation(cfg, dataset)
    rows = sim.run()
    timed = rows[1:] if len(rows) > 1 else rows
    mean = lambda key: sum(float(r.get(key) or 0.0) for r in timed) / len(timed)  # noqa: E731
    return {
        "rounds": len(rows),
        "s_per_round": mean("seconds"),
        "clients_s": mean("train_seconds"),
        "server_s": mean("server_seconds"),
        "eval_s": mean("eval_seconds"),
        "server_per_round": [round(float(r["server_seconds"]), 2) for r in rows],
        "clients_per_round": [round(float(r["train_seconds"]), 2) for r in rows],
        "accuracy": [r["test_accuracy"] for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--preset", default=str(HERE / "presets" / "dafkd_reduced.yaml"))
    ap.add_argument("--column", default="mnist_0.1")
    ap.add_argument("--methods", default="FedAvg,FedFTG,FedGen,FedDF,DaFKD")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=None, help="local epochs (default: the preset's)")
    ap.add_argument("--workers", type=int, default=2, help="client worker processes (one thread each)")
    ap.add_argument("--out", default=str(HERE / "out"))
    args = ap.parse_args()

    preset = load_preset(args.preset)
    overrides: dict = {"dataset.data_dir": args.data_dir, "run.checkpoint_every": 0}
    if args.workers > 1:
        overrides.update({"run.workers": args.workers, "run.threads": 1})
    if args.epochs is not None:
        overrides["local.epochs"] = args.epochs
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(), "torch": torch.__version__},
        "preset": args.preset, "column": args.column, "overrides": overrides, "runs": {},
    }  # fmt: skip
    dataset = None
    for method in args.methods.split(","):
        cfg = run_config(preset, args.column, method, seed=0, rounds=args.rounds, overrides=dict(overrides))
        if dataset is None:
            dataset = load_dataset(cfg.dataset.name, args.data_dir)
        started = time.perf_counter()
        results["runs"][method] = measure(cfg, dataset)
        print(f"{method}: {json.dumps(results['runs'][method])} ({time.perf_counter() - started:.0f} s)", flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / f"bench_server_cost-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print("\n| method | s/round | clients s | server s | server / clients | eval s |")
    print("|---|---|---|---|---|---|")
    for method, r in results["runs"].items():
        ratio = r["server_s"] / r["clients_s"] if r["clients_s"] else float("nan")
        print(f"| {method} | {r['s_per_round']:.1f} | {r['clients_s']:.1f} | {r['server_s']:.1f} | {ratio:.2f} | {r['eval_s']:.2f} |")
    print(f"\nraw: {out}")


if __name__ == "__main__":
    main()
