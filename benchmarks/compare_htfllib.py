"""Our side of the comparison with HtFLlib's own code (issue 63, item 6; protocol in spec/experiments-hetero.md §5).

Runs Local, FD, FedProto, FedGH and FedTGP on HtFLlib's MNIST 20-client split read from its own files
(``npz_federation``), every client in every round, each method on its HtFLlib defaults (SGD 0.01 without momentum,
batch 10, one local epoch, the method's λ and server settings), client k training member k mod M of the
assignment, one thread in this process, fp32. Per method and seed it records, after every round, the pooled
accuracy (HtFLlib's metric: correct over all clients' test samples) and the mean over clients (ours), with the
seconds per round and the bytes. Results go to ``--out`` (JSON) as each run finishes, so a stopped comparison
continues where it stopped; the summary table (mean ± std over seeds) is printed at the end.

    python benchmarks/compare_htfllib.py --data-dir path/to/HtFLlib/dataset/mnist \
        [--rounds 6] [--seeds 0 1 2] [--methods fd,fedproto,fedgh,fedtgp,local_only] [--out FILE]

A method may carry settings of its card, ``--methods "fd:teacher=logits"`` (HtFLlib's current FD target); the
results are keyed by that whole name.

The reference side's procedure (the local edits to HtFLlib and its commands) is written out in
benchmarks/RESULTS.md, "The class-statistics family against HtFLlib's code".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

METHODS = ["fd", "fedproto", "fedgh", "fedtgp", "local_only"]
# HtFLlib's FedAvgCNN (dim 1024 for 28x28), ResNet-4 and ResNet-6, one-channel stems: the reduced protocol's
# assignment (the reference's HtFE-mnist-3, built from its own code with the same members in the same order)
ASSIGNMENT = ["ht_fedavgcnn", "ht_resnet4", "ht_resnet6"]


def parse_method(spec: str) -> dict:
    """``fd`` or ``fd:teacher=logits,lam=2``: a method and settings of its card (values read as YAML scalars)."""
    import yaml

    name, _, settings = spec.partition(":")
    params = {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        params[key] = yaml.safe_load(value)
    return {"name": name, **params}


def config_tree(method: str, data_dir: str, rounds: int, seed: int) -> dict:
    return {
        "algorithm": parse_method(method),
        "dataset": {"name": "npz_federation", "data_dir": data_dir},
        "model": {"clients": list(ASSIGNMENT)},
        "partition": {"num_clients": 20},
        "clients_per_round": 20,
        "rounds": rounds,
        "seed": seed,
        "run": {"threads": 1, "workers": 1, "progress": False, "checkpoint_every": 0, "figures": False},
    }


def run_one(method: str, data_dir: str, rounds: int, seed: int) -> dict:
    import torch

    from fedistill.config import build_config
    from fedistill.errors import TrainingDiverged
    from fedistill.runner import load_dataset_for
    from fedistill.simulation import Simulation

    torch.set_num_threads(1)
    cfg = build_config(config_tree(method, data_dir, rounds, seed))
    sim = Simulation(cfg, load_dataset_for(cfg))
    rows = []
    try:
        for rnd in range(1, rounds + 1):  # a run that goes non-finite is recorded as such, with its rounds
            started = time.perf_counter()
            row = sim.run_round(rnd)
            rows.append({
                "round": rnd, "seconds": time.perf_counter() - started,
                "pooled": row["personal_pooled_accuracy"], "client_mean": row["personal_accuracy"],
                "bytes_up": row.get("bytes_up"), "bytes_down": row.get("bytes_down"),
            })  # fmt: skip
            print(f"{method} seed {seed} round {rnd}: pooled {row['personal_pooled_accuracy']:.2f}, "
                  f"client mean {row['personal_accuracy']:.2f} ({rows[-1]['seconds']:.0f} s)", flush=True)  # fmt: skip
    except TrainingDiverged as error:
        print(f"{method} seed {seed}: diverged: {error}", flush=True)
        return {"rounds": rows, "diverged": str(error)}
    finally:
        sim.close()
    return {"rounds": rows}


def mean_std(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.2f}" if values else "-"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def table(results: dict) -> str:
    lines = [
        "| method | seeds | final pooled | best pooled | final client mean | s/round | bytes up / down (round 2) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for method, by_seed in results.items():
        diverged = [seed for seed, r in by_seed.items() if "diverged" in r]
        if diverged:
            first = min(len(by_seed[s]["rounds"]) + 1 for s in diverged)
            lines.append(f"| {method} | {len(by_seed)} | non-finite in round {first} (seeds {', '.join(diverged)}) | | | | |")
            continue
        runs = [r["rounds"] for r in by_seed.values()]
        if not runs:
            continue
        final = [r[-1]["pooled"] for r in runs]
        best = [max(x["pooled"] for x in r) for r in runs]
        client = [r[-1]["client_mean"] for r in runs]
        seconds = statistics.mean(x["seconds"] for r in runs for x in r[1:] or r)
        second = runs[0][1] if len(runs[0]) > 1 else runs[0][0]
        lines.append(f"| {method} | {len(runs)} | {mean_std(final)} | {mean_std(best)} | {mean_std(client)} | "
                     f"{seconds:.1f} | {second['bytes_up']:,} / {second['bytes_down']:,} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="HtFLlib's dataset/mnist (train/ and test/ of .npz files)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated; with settings, separate by ';'")
    parser.add_argument("--out", default="benchmarks/out/htfllib-comparison.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.exists() else {}
    if results.get("_protocol", {}).get("rounds", args.rounds) != args.rounds:
        raise SystemExit(f"{out} holds runs of another number of rounds: name another --out")
    results["_protocol"] = {"rounds": args.rounds, "assignment": ASSIGNMENT}
    for method in args.methods.split(";" if ":" in args.methods else ","):
        for seed in args.seeds:
            if str(seed) in results.get(method, {}):
                continue  # finished in an earlier invocation
            results.setdefault(method, {})[str(seed)] = run_one(method, args.data_dir, args.rounds, seed)
            out.write_text(json.dumps(results, indent=1))
    print(table({m: r for m, r in results.items() if not m.startswith("_")}))


if __name__ == "__main__":
    main()
