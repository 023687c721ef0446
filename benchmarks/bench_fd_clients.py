"""Memory of federated distillation with many clients (issue 12: "memory stays bounded with the paper's
120-150 device setting").

FedICT on Fashion-MNIST with FedICT's TMD-style random mix of fully connected clients (A^C_6/7/8, 13-float
features) and the A^S_1 server, every client in every round, for K = 10, 120 and 150 clients. Each K runs in
its own process (peak RSS is per process); reported: peak RSS, the client-state files on disk, the server
state in the checkpoint, seconds per round and bytes per round.

    python benchmarks/bench_fd_clients.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(k: int, data_dir: str, rounds: int) -> dict:
    import torch

    from fedistill.config import build_config
    from fedistill.simulation import Simulation
    from fedistill.runner import load_dataset_for

    cfg = build_config(
        {
            "rounds": rounds,
            "clients_per_round": k,
            "algorithm": {"name": "fedict", "variant": "balance"},
            "dataset": {"name": "fashion_mnist", "data_dir": data_dir, "augment": []},
            "partition": {"num_clients": k, "alpha": 1.0, "per_client_test": True, "min_size": 10},
            "model": {"client_mix": {"fd_mlp64": 0.1, "fd_mlp32": 0.3, "fd_mlp16": 0.6}, "server": "fd_server_mlp"},
            "local": {"epochs": 1, "batch_size": 64, "lr": 0.01, "lr_decay": 1.0, "weight_decay": 5e-4},
            "run": {"progress": False, "client_state": "disk", "checkpoint_every": 1},
        }
    )
    dataset = load_dataset_for(cfg, data_dir, False)
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(cfg, dataset, run_dir=Path(tmp))
        started = time.perf_counter()
        history = sim.run()
        seconds = (time.perf_counter() - started) / rounds
        states = sum(f.stat().st_size for f in (Path(tmp) / "client_states").glob("*.pt"))
        checkpoint = (Path(tmp) / "checkpoint.pt").stat().st_size
        knowledge = sum(t.numel() * t.element_size() for t in sim.server.state["knowledge"].values())
    return {
        "clients": k,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "client_state_files_mb": states / 1e6,
        "checkpoint_mb": checkpoint / 1e6,
        "server_knowledge_mb": knowledge / 1e6,
        "seconds_per_round": seconds,
        "bytes_per_round_mb": history[-1]["bytes_up"] / 1e6 + history[-1]["bytes_down"] / 1e6,
        "personal_accuracy": history[-1]["personal_accuracy"],
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, nargs="*", default=[10, 120, 150])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.data_dir, args.rounds)))
        return
    print("| clients | peak RSS MB | client-state files MB | checkpoint MB | server knowledge MB | s/round | MB/round | personal acc % |")
    print("|---|---|---|---|---|---|---|---|")
    for k in args.clients:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(k), "--data-dir", args.data_dir, "--rounds", str(args.rounds)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {r['clients']} | {r['peak_rss_mb']:.0f} | {r['client_state_files_mb']:.2f} | {r['checkpoint_mb']:.2f} | "
            f"{r['server_knowledge_mb']:.2f} | {r['seconds_per_round']:.1f} | {r['bytes_per_round_mb']:.2f} | {r['personal_accuracy']:.1f} |"
        )


if __name__ == "__main__":
    main()
