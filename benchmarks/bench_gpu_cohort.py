"""Cohort training against the graphed sequential step on a GPU (issue 66, item 4), side by side in one call.

The FedLMD MNIST protocol of ``bench_fedavg_mnist.py`` (the FedNTD CNN, 100 clients, Dirichlet 0.1, 10 a round,
E = 5, B = 50, SGD lr 0.01 momentum 0.9, crop + flip + cutout), fp32 unless ``--precision``, for FedAvg, FedProx,
FedNTD, FedLMD and SCAFFOLD (the issue's list; ``--methods`` for others that batch). Each method runs twice on the
same seed: ``sequential`` = one client after another with ``run.cuda_graphs`` (the fastest path before this
issue), ``cohort`` = ``run.cohort = K`` (K = the round's 10 clients) without graphs; ``+resident`` adds
``run.resident_weights`` to either (the vectors stay on the GPU across the Message boundary, item 3). Reported per method and path:
seconds per round (the mean of rounds 2..R: round 1 carries the CUDA context, cuDNN's choices and the captures),
training samples per second, the final accuracy, and the cohort's padded slots over the run (steps spent masked
because its clients have different step counts). The GPU's busy share comes from ``profile_gpu_round.py --cohort K`` (gpu_check.sh's
``cohort`` stage runs both).

Targets (the issue): FedAvg's round at or under 0.075 s (5x the 0.37 s of the H200's graphed round) at the same
accuracy within the seeds' spread; every batched method under 0.2 s.

    python benchmarks/bench_gpu_cohort.py --data-dir DATA [--rounds 4] [--methods ...] [--json out.json]
    python benchmarks/bench_gpu_cohort.py --data-dir DATA --device cpu --rounds 2 --clients 4  # the plumbing, on a CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from bench_fedavg_mnist import PROTOCOL

from fedistill.config import build_config
from fedistill.engine.cohort_choice import MEASURED, record_measurements
from fedistill.data.sources import load_dataset
from fedistill.simulation import Simulation, build_federation

METHODS = "fedavg,fedprox,fedntd,fedlmd,scaffold"


def one_run(dataset, method: str, path: str, args: argparse.Namespace) -> dict:
    overrides = {"rounds": args.rounds, "algorithm.name": method, "run.device": args.device, "run.precision": args.precision,
                 "run.workers": 1, "clients_per_round": args.clients}  # fmt: skip
    if path.endswith("+resident"):
        overrides["run.resident_weights"] = True
    if path.startswith("cohort"):
        overrides["run.cohort"] = args.clients
    elif args.device.startswith("cuda"):
        overrides["run.cuda_graphs"] = True
    cfg = build_config(PROTOCOL, overrides)
    sim = Simulation(cfg, dataset, federation=build_federation(cfg, dataset))
    seconds, samples, row = [], 0, {}
    for rnd in range(1, args.rounds + 1):
        started = time.perf_counter()
        row = sim.run_round(rnd)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if rnd > 1:
            seconds.append(time.perf_counter() - started)
            samples += sum(row.get("train_label_counts") or []) * cfg.local.epochs  # the round's clients' samples, E passes
    executor = sim.executor
    sim.close()
    mean = sum(seconds) / len(seconds) if seconds else float("nan")
    return {
        "method": method, "path": path, "seconds_per_round": mean,
        "samples_per_second": samples / sum(seconds) if seconds and samples else None,
        "final_accuracy": row.get("test_accuracy"), "padded_slots": getattr(executor, "padded_slots", None),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--clients", type=int, default=10, help="clients a round, and the cohort's K")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--paths", default="sequential,cohort,sequential+resident,cohort+resident",
                    help="which paths (sequential, cohort, each with +resident), in this order")
    ap.add_argument("--json")
    ap.add_argument("--record", action="store_true",
                    help="also merge the rows into src/fedistill/engine/cohort_measured.json, which run.cohort=auto reads "
                    "(a GPU's rows; commit the file)")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be 2 or more: round 1 (allocations, graph capture) is left out of the timing")
    dataset = load_dataset("mnist", args.data_dir)
    rows = []
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"| method | path | s/round | samples/s | final acc. % | padded slots | ({name}, {args.precision}, rounds 2-{args.rounds})")
    for method in args.methods.split(","):
        for path in args.paths.split(","):
            r = one_run(dataset, method, path, args)
            rows.append(r)
            sps = f"{r['samples_per_second']:,.0f}" if r["samples_per_second"] else "-"
            print(f"| {method} | {path} | {r['seconds_per_round']:.3f} | {sps} | {r['final_accuracy']:.2f} | "
                  f"{r['padded_slots'] if r['padded_slots'] is not None else '-'} |", flush=True)  # fmt: skip
    result = {"device": name, "precision": args.precision, "rounds": args.rounds, "clients": args.clients,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.record:
        try:
            print(f"{record_measurements(result)} rows in {MEASURED}")
        except ValueError as error:
            sys.exit(f"not recorded: {error}")


if __name__ == "__main__":
    main()
