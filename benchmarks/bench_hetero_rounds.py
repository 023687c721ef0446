"""Seconds per round of the class-statistics family on heterogeneous clients (issue 63, item 7).

Each method (Local, FD, FedProto, FedGH, FedTGP by default) runs on MNIST with 20 clients of a model group
(``--group``, default ``mixed4``: client k trains member k mod 4), Dirichlet alpha = 0.1, every client in every
round, HtFLlib's client defaults (each method's own: SGD 0.01, batch 10, one epoch), one thread in one process,
fp32. Per method, in a fresh process: round 1's floating-point operations are counted (FlopCounterMode, as a
bench cell's first seed), then ``--rounds`` rounds are timed; the table gives the mean seconds of rounds 2..R
(round 1 builds the workers and the caches), the server's share, GFLOP/s and the share of this machine's
one-thread bf16 matmul peak (measured here first: the convention of the leaderboards' "% of peak"). Run on an idle
machine (about 35 min for the five methods on the
Intel Xeon host; no timeout shorter than that):

    python benchmarks/bench_hetero_rounds.py --data-dir ../shared/data [--methods fd,fedproto] [--group mixed8] [--precision bf16]

Writes benchmarks/out/hetero-rounds-<time>.json and prints a markdown table for benchmarks/RESULTS.md.
``--profile METHOD`` instead prints where one round of that method goes (cProfile, top 25 by own time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

METHODS = ["local_only", "fd", "fedproto", "fedgh", "fedtgp"]

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from fedistill.config import build_config
from fedistill.engine.flops import counted_flops
from fedistill.runner import load_dataset_for
from fedistill.simulation import Simulation

tree, rounds, profile = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
cfg = build_config(tree)
data = load_dataset_for(cfg)
if profile:
    import cProfile, pstats
    sim = Simulation(cfg, data)
    sim.run_round(1)
    prof = cProfile.Profile()
    prof.enable()
    sim.run_round(2)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    sim.close()
    sys.exit(0)
counter = Simulation(build_config({**tree, "rounds": 1}), data)
flops = counted_flops(lambda: counter.run_round(1))
counter.close()
sim = Simulation(cfg, data)
out = []
for rnd in range(1, rounds + 1):
    started = time.perf_counter()
    row = sim.run_round(rnd)
    out.append({"round": rnd, "seconds": time.perf_counter() - started, "server_seconds": row.get("server_seconds"),
                "personal_accuracy": row.get("personal_accuracy"), "bytes_up": row.get("bytes_up")})
sim.close()
print("RESULT " + json.dumps({"flops_per_round": flops, "rounds": out}))
"""


def config_tree(method: str, group: str, data_dir: str, rounds: int, precision: str = "fp32") -> dict:
    return {
        "algorithm": {"name": method},
        "dataset": {"name": "mnist", "data_dir": data_dir},
        "model": {"group": group},
        "partition": {"scheme": "lda", "num_clients": 20, "alpha": 0.1},
        "clients_per_round": 20,
        "rounds": rounds,
        "run": {"threads": 1, "workers": 1, "progress": False, "checkpoint_every": 0, "figures": False, "precision": precision},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--group", default="mixed4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", metavar="METHOD")
    # fp32 by default (HtFLlib's, and the comparison's); bf16 shows how much of the gap to the bf16 peak is precision
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    if args.profile:
        tree = config_tree(args.profile, args.group, args.data_dir, 2, args.precision)
        subprocess.run([sys.executable, "-c", CHILD, json.dumps(tree), "2", "1"], check=True)
        return

    from fedistill.engine.flops import measure_bf16_peak

    peak = measure_bf16_peak(1, seconds=2.0)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    path = out / f"hetero-rounds-{time.strftime('%Y%m%d-%H%M%S')}.json"
    results = {}
    for method in args.methods.split(","):  # a method takes 5-8 min here: each result is written as it comes
        tree = config_tree(method, args.group, args.data_dir, args.rounds, args.precision)
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(tree), str(args.rounds), "0"], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            sys.exit(f"{method}: the child failed\n{done.stderr[-3000:]}")
        results[method] = json.loads(lines[-1][len("RESULT "):])
        path.write_text(json.dumps({"peak_gflops_1_thread": peak, "group": args.group, "precision": args.precision, "results": results}, indent=1))
        print(f"{method}: done ({path})", file=sys.stderr)

    peak_text = "none (bf16 not in this CPU's hardware)" if peak is None else f"{peak:.0f} GFLOP/s"
    print(f"one-thread bf16 matmul peak here: {peak_text}; MNIST, 20 clients of {args.group}, alpha 0.1, all in every round, {args.precision}\n")
    print("| method | s/round (rounds 2-%d) | of it server | GFLOP/round | GFLOP/s | %% of peak | kB up/round | personal acc. after round %d |" % (args.rounds, args.rounds))
    print("|---|---|---|---|---|---|---|---|")
    for method, result in results.items():
        later = result["rounds"][1:] or result["rounds"]
        seconds = sum(r["seconds"] for r in later) / len(later)
        server = sum(r["server_seconds"] or 0.0 for r in later) / len(later)
        gflop = result["flops_per_round"] / 1e9
        last = result["rounds"][-1]
        share = "-" if peak is None else f"{100 * gflop / seconds / peak:.1f}"
        print(
            f"| {method} | {seconds:.2f} | {server:.3f} | {gflop:.1f} | {gflop / seconds:.1f} | {share} | "
            f"{(last['bytes_up'] or 0) / 1e3:.1f} | {last['personal_accuracy']:.2f} |"
        )
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
