"""Every method's round on the FedLMD MNIST protocol on a GPU, eager and with ``run.cuda_graphs`` (issue 41, item 3).

The protocol is ``bench_fedavg_mnist.py``'s (the FedNTD CNN, MNIST, 100 clients, Dirichlet 0.1, 10 a round,
E = 5, B = 50, SGD lr 0.01 momentum 0.9, fp32) with per-client test splits, so the methods that rank by their
clients' own models (FedGKT, FedDKC, FedICT, the personalised methods) report something. Each method runs with
its card's defaults and fd-mnist's stated departures (``configs/bench/fd-mnist.yaml`` method_settings: a narrower
generator for DaFKD, FedDF and FedFTG, one block per stage in the FD family's server, pFedMe's personal lr), as the
leaderboard runs them. Round 1 carries the CUDA context, cuDNN's choices and the first capture; the seconds
reported are round 2's (it captures anew too, since the protocol's learning rate decays every round).

Methods whose client step goes through ``local_sgd`` run twice, eager and with graphs (the plain step, and since
issue 41 the steps with loss terms and corrections that declare a ``graph_key``); the others (their own client
loops: pFedMe, FedGen, the FD family, DaFKD) run once, eager. ``--budget-s`` stops starting methods once the
script has run that long, so a lease's time limit cuts the slowest (last) ones, not the report.

Run (on the GPU machine): python benchmarks/bench_gpu_methods.py --data-dir DATA --json out.json [--methods a,b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench_fedavg_mnist import PROTOCOL
from bench_gpu import round_accuracy, run_rounds
from fedistill.algorithms.fedavg import FedAvg
from fedistill.studies.bench import load_suite, suite_cells
from fedistill.registry import ALGORITHMS
from fedistill.runner import load_dataset_for
from fedistill.simulation import Simulation

# Issue 41's list first (the steps with loss terms or corrections), the slowest last: a spent budget cuts those.
FIRST = ("fedavg", "fedprox", "fedlmd", "fedntd", "moon", "scaffold", "feddyn", "fedrs", "fedcurv", "fednova")
LAST = ("fedgkt", "feddkc", "fedict", "dafkd")


def order(name: str) -> tuple:
    if name in FIRST:
        return (0, FIRST.index(name), name)
    return (2, LAST.index(name), name) if name in LAST else (1, 0, name)


def protocol(data_dir: str, device: str, rounds: int, graphs: bool) -> dict:
    tree = json.loads(json.dumps(PROTOCOL))
    tree["rounds"] = rounds
    tree["partition"]["per_client_test"] = True
    tree["dataset"]["data_dir"] = data_dir
    tree["run"].update({"device": device, "precision": "fp32", "cuda_graphs": graphs, "checkpoint_every": 0, "progress": False})
    return tree


def method_configs(data_dir: str, device: str, rounds: int, graphs: bool) -> dict:
    """Each registered method's config on the protocol (fd-mnist's card settings and departures), seed 0."""
    suite = load_suite("fd-mnist")
    suite = suite.model_copy(update={
        "protocol": protocol(data_dir, device, rounds, graphs),
        "settings": {"lda_0.1": suite.settings["lda_0.1"]},
        "seeds": [0],
    })
    return {cell.method: (cell.config, cell.why_not) for cell in suite_cells(suite, Path("/tmp/bench_gpu_methods"))}


def uses_local_sgd(name: str) -> bool:
    cls = ALGORITHMS.get(name)
    return isinstance(cls, type) and issubclass(cls, FedAvg) and cls.local_update is FedAvg.local_update


def run(cfg, dataset, rounds: int, device: str) -> dict:
    rows = run_rounds(Simulation(cfg, dataset), rounds, device, stop_after_s=60)  # a heavy method: one round says enough
    timed = rows[-1]
    return {
        "round1_s": rows[0]["seconds"],
        "s_per_round": timed["seconds"],
        "server_s": timed.get("server_seconds"),
        "eval_s": timed.get("eval_seconds"),
        "timed_round": len(rows),
        "accuracy": round_accuracy(timed),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", help="comma-separated registered names (default: every method)")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    eager = method_configs(args.data_dir, args.device, args.rounds, False)
    graphed = method_configs(args.data_dir, args.device, args.rounds, True) if args.device.startswith("cuda") else {}
    names = args.methods.split(",") if args.methods else sorted(eager, key=order)
    dataset = None
    report: dict = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "methods": {}}
    started = time.perf_counter()
    print(f"{'method':16} {'eager s':>8} {'graphs s':>8} {'server s':>8} {'acc eager':>9} {'acc graphs':>10}", flush=True)
    for name in names:
        if time.perf_counter() - started > args.budget_s:
            report["methods"][name] = {"skipped": f"budget of {args.budget_s:.0f} s spent"}
            continue
        cfg, why_not = eager[name]
        if cfg is None:
            report["methods"][name] = {"not_applicable": why_not}
            continue
        if dataset is None:
            dataset = load_dataset_for(cfg)
        entry: dict = {}
        try:
            entry["eager"] = run(cfg, dataset, args.rounds, args.device)
            if name in graphed and uses_local_sgd(name):
                entry["graphs"] = run(graphed[name][0], dataset, args.rounds, args.device)
        except Exception as exc:  # a method that breaks is a finding to report, not the end of the lease's report
            entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        report["methods"][name] = entry
        e, g = entry.get("eager", {}), entry.get("graphs", {})
        fmt = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"  # noqa: E731
        print(f"{name:16} {fmt(e.get('s_per_round'), '8.2f')} {fmt(g.get('s_per_round'), '8.2f')} {fmt(e.get('server_s'), '8.2f')} "
              f"{fmt(e.get('accuracy'), '9.2f')} {fmt(g.get('accuracy'), '10.2f')} {entry.get('error', '')}", flush=True)
    report["wall_s"] = time.perf_counter() - started
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
