"""Peak memory of a stateful method with many clients: client state in memory vs on disk.

MOON keeps each client's previous local model. Here: the embedded digits, K clients, an MLP of
~1.2 M parameters (4.7 MB per state), every client sampled once, ``run.client_state`` memory vs disk.
Each setting runs in its own process so that peak RSS (ru_maxrss) is its own.

    PYTHONPATH=src python benchmarks/bench_client_state.py --clients 200
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time


def one(store: str, clients: int) -> dict:
    from fedistill.config import build_config
    from fedistill.data.sources import load_dataset
    from fedistill.simulation import Simulation

    per_round = 20
    cfg = build_config(
        {
            "algorithm": "moon",
            "rounds": clients // per_round,
            "clients_per_round": per_round,
            "dataset": {"name": "digits"},
            "model": {"name": "mlp", "kwargs": {"hidden": [1024, 1024]}},
            "partition": {"scheme": "iid", "num_clients": clients},
            "local": {"epochs": 1, "batch_size": 8, "lr": 0.05},
            "eval": {"every": 1000},
            "run": {"progress": False, "client_state": store, "checkpoint_every": 5},
        }
    )
    dataset = load_dataset("digits")
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(cfg, dataset, run_dir=__import__("pathlib").Path(tmp))
        start = time.perf_counter()
        history = sim.run()
        seconds = time.perf_counter() - start
        with_state = len(sim.state.client_states)
    return {
        "store": store,
        "clients": clients,
        "clients_with_state": with_state,
        "rounds": len(history),
        "seconds_per_round": seconds / len(history),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--one", choices=["memory", "disk"])
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.clients)))
        return
    for store in ("memory", "disk"):
        out = subprocess.run(
            [sys.executable, __file__, "--one", store, "--clients", str(args.clients)], capture_output=True, text=True, check=True
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {r['store']} | {r['clients']} | {r['clients_with_state']} | {r['peak_rss_mb']:.0f} | {r['seconds_per_round']:.2f} |"
        )


if __name__ == "__main__":
    main()
