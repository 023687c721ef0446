"""Our side of the comparison with HtFLlib's own code (issue 63, item 6; protocol in spec/experiments-hetero.md §5).

Runs Local, FD, FedProto, FedGH and FedTGP (or issue 64's FML, LG-FedAvg, FedKD, FedMRL) on HtFLlib's MNIST 20-client split read from its own files
(``npz_federation``), every client in every round, each method on its HtFLlib defaults (SGD 0.01 without momentum,
batch 10, one local epoch, the method's λ and server settings), client k training member k mod M of the
assignment, one thread in this process, fp32. Per method and seed it records, after every round, the pooled
accuracy (HtFLlib's metric: correct over all clients' test samples) and the mean over clients (ours), with the
seconds per round and the bytes. Results go to ``--out`` (JSON) as each run finishes, so a stopped comparison
continues where it stopped; the summary table (mean ± std over seeds) is printed at the end.

    python benchmarks/compare_htfllib.py --data-dir path/to/HtFLlib/dataset/mnist \
        [--rounds 6] [--seeds 0 1 2] [--methods fd,fedproto,fedgh,fedtgp,local_only] [--batch-order sequential] [--out FILE]

A method may carry settings of its card, ``--methods "fd:teacher=logits"`` (HtFLlib's current FD target); the
results are keyed by that whole name.

The reference's runs are read from their logs (one ``<NAME>_seed<S>.log`` per run, its ``EVAL_JSON`` lines, which
the local edit 5 prints; REFERENCE_LOGS maps our method names to theirs) and set beside ours, with the acceptance of
spec/experiments-hetero.md §5.4 (our 3-seed mean of the final pooled accuracy within two standard deviations of
the reference's mean):

    python benchmarks/compare_htfllib.py --table-only --out FILE --reference-logs path/to/logs

``--reference-logs`` writes what it read to ``<out>-reference.json``; without it, that file is used if present, or
the one ``--reference FILE`` names (several runs of ours against the same reference rows share one file).

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
# issue 64's half (a shared part beside a private model): --methods fml,lg_fedavg,fedkd,fedmrl
SHARED_PART_METHODS = ["fml", "lg_fedavg", "fedkd", "fedmrl"]
# HtFLlib's FedAvgCNN (dim 1024 for 28x28), ResNet-4 and ResNet-6, one-channel stems: the reduced protocol's
# assignment (the reference's HtFE-mnist-3, built from its own code with the same members in the same order)
ASSIGNMENT = ["ht_fedavgcnn", "ht_resnet4", "ht_resnet6"]


# our method (with its card settings) -> the reference's log name (HtFLlib's -algo, and which tree: FDsoftmax is FD
# with the soft target of HtFLlib before its commit ca3e29a, the local edit 8 of RESULTS)
REFERENCE_LOGS = {"fd": "FDsoftmax", "fd:teacher=logits": "FDlogits", "fedproto": "FedProto", "fedgh": "FedGH",
                  "fedtgp": "FedTGP", "fml": "FML", "lg_fedavg": "LG-FedAvg", "fedkd": "FedKD", "fedmrl": "FedMRL"}  # fmt: skip


def parse_method(spec: str) -> dict:
    """``fd`` or ``fd:teacher=logits,lam=2``: a method and settings of its card (values read as YAML scalars)."""
    import yaml

    name, _, settings = spec.partition(":")
    params = {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        params[key] = yaml.safe_load(value)
    return {"name": name, **params}


def config_tree(method: str, data_dir: str, rounds: int, seed: int, batch_order: str = "shuffled") -> dict:
    return {
        "local": {"batch_order": batch_order},
        "algorithm": parse_method(method),
        "dataset": {"name": "npz_federation", "data_dir": data_dir},
        "model": {"clients": list(ASSIGNMENT)},
        "partition": {"num_clients": 20},
        "clients_per_round": 20,
        "rounds": rounds,
        "seed": seed,
        "run": {"threads": 1, "workers": 1, "progress": False, "checkpoint_every": 0, "figures": False},
    }


def run_one(method: str, data_dir: str, rounds: int, seed: int, batch_order: str = "shuffled") -> dict:
    import torch

    from fedistill.config import build_config
    from fedistill.errors import TrainingDiverged
    from fedistill.runner import load_dataset_for
    from fedistill.simulation import Simulation

    torch.set_num_threads(1)
    cfg = build_config(config_tree(method, data_dir, rounds, seed, batch_order))
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
                     f"{seconds:.1f} | {second['bytes_up'] or 0:,} / {second['bytes_down'] or 0:,} |")  # fmt: skip
    return "\n".join(lines)


def read_reference_logs(log_dir: Path) -> dict:
    """The reference's runs as ours are stored: {method: {seed: {"rounds": [...]}}}, accuracies in %.

    HtFLlib evaluates before every round's training, so its row i is the model after i rounds and row 0 the
    untrained one (dropped). A run that stopped with an error (``EXIT`` in the log, e.g. scikit-learn refusing the
    NaN scores of a diverged model) is recorded as diverged with its last error line.
    """
    import re

    results: dict = {}
    for method, name in REFERENCE_LOGS.items():
        for log in sorted(log_dir.glob(f"{name}_seed*.log")):
            seed = re.fullmatch(rf"{name}_seed(\d+)\.log", log.name).group(1)
            lines = log.read_text(errors="replace").splitlines()
            evals = [json.loads(line[len("EVAL_JSON "):]) for line in lines if line.startswith("EVAL_JSON ")]
            rows = [{"round": i, "pooled": 100 * e["pooled"], "client_mean": 100 * e["client_mean"]}
                    for i, e in enumerate(evals) if i > 0]  # fmt: skip
            run: dict = {"rounds": rows}
            if any(line.startswith("EXIT") for line in lines):
                errors = [line for line in lines if "Error" in line]
                run["diverged"] = errors[-1] if errors else "stopped with an error"
            elif not any("All done" in line for line in lines):
                continue  # still running
            results.setdefault(method, {})[seed] = run
    return results


def side_by_side(ours: dict, reference: dict) -> str:
    """Final and best pooled accuracy and the final mean over clients of both sides, with §5.4's verdict."""
    lines = [
        "| method | ours: final pooled | reference: final pooled | ours − reference | within 2 std of the reference | "
        "ours: best pooled | reference: best pooled | ours: final client mean | reference: final client mean |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for method in ours:
        if method not in reference:
            continue
        sides = []
        for by_seed in (ours[method], reference[method]):
            finished = [r["rounds"] for r in by_seed.values() if "diverged" not in r]
            diverged = [r for r in by_seed.values() if "diverged" in r]
            sides.append((finished, diverged))
        if any(diverged for _, diverged in sides):
            described = []
            for finished, diverged in sides:
                described.append(f"{len(diverged)} of {len(diverged) + len(finished)} seeds non-finite "
                                 f"(round {min(len(r['rounds']) + 1 for r in diverged)})" if diverged else "finite")  # fmt: skip
            lines.append(f"| {method} | {described[0]} | {described[1]} | | both sides diverge: {'yes' if all(d for _, d in sides) else 'no'} | | | | |")
            continue
        (o, _), (r, _) = sides
        final_o, final_r = [x[-1]["pooled"] for x in o], [x[-1]["pooled"] for x in r]
        gap = statistics.mean(final_o) - statistics.mean(final_r)
        std_r = statistics.stdev(final_r) if len(final_r) > 1 else float("nan")
        std_max = max(std_r, statistics.stdev(final_o) if len(final_o) > 1 else 0.0)
        verdict = ("yes" if abs(gap) <= 2 * std_r else
                   f"only with our larger std ({2 * std_max:.2f})" if abs(gap) <= 2 * std_max else
                   f"no (2 std = {2 * std_r:.2f})")  # fmt: skip
        lines.append(
            f"| {method} | {mean_std(final_o)} | {mean_std(final_r)} | {gap:+.2f} | {verdict} | "
            f"{mean_std([max(x['pooled'] for x in run) for run in o])} | {mean_std([max(x['pooled'] for x in run) for run in r])} | "
            f"{mean_std([x[-1]['client_mean'] for x in o])} | {mean_std([x[-1]['client_mean'] for x in r])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", help="HtFLlib's dataset/mnist (train/ and test/ of .npz files)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated; with settings, separate by ';'")
    parser.add_argument("--out", default="benchmarks/out/htfllib-comparison.json")
    parser.add_argument("--batch-order", choices=["shuffled", "sequential"], default="shuffled",
                        help="sequential: HtFLlib's order (stored order, last partial batch dropped) for a like-for-like run")
    parser.add_argument("--reference-logs", type=Path, help="the reference runs' logs (<NAME>_seed<S>.log)")
    parser.add_argument("--reference", type=Path, help="the reference rows to compare with (default <out>-reference.json)")
    parser.add_argument("--table-only", action="store_true", help="run nothing; print the tables of --out")
    args = parser.parse_args()
    if args.reference is not None and args.reference_logs is not None:
        parser.error("--reference and --reference-logs: give one (the logs are read into <out>-reference.json)")
    if args.table_only:
        return print_tables(Path(args.out), args.reference_logs, args.reference)
    if not args.data_dir:
        parser.error("--data-dir is required unless --table-only")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.exists() else {}
    protocol = {"rounds": args.rounds, "assignment": ASSIGNMENT, "batch_order": args.batch_order}
    held = results.get("_protocol", {})
    if any(held.get(key, protocol[key]) != protocol[key] for key in ("rounds", "batch_order")):
        raise SystemExit(f"{out} holds runs of another protocol ({held}): name another --out")
    results["_protocol"] = protocol
    for method in args.methods.split(";" if ":" in args.methods else ","):
        for seed in args.seeds:
            if str(seed) in results.get(method, {}):
                continue  # finished in an earlier invocation
            results.setdefault(method, {})[str(seed)] = run_one(method, args.data_dir, args.rounds, seed, args.batch_order)
            out.write_text(json.dumps(results, indent=1))
    print_tables(out, args.reference_logs, args.reference)


def print_tables(out: Path, reference_logs: Path | None, reference: Path | None = None) -> None:
    ours = {m: r for m, r in json.loads(out.read_text()).items() if not m.startswith("_")}
    print(table(ours))
    reference_file = reference or out.with_name(out.stem + "-reference.json")
    if reference is not None and not reference.is_file():
        raise SystemExit(f"--reference {reference}: no such file")
    if reference_logs is not None:
        reference_file.write_text(json.dumps(read_reference_logs(reference_logs), indent=1))
    if reference_file.exists():
        print("\nAgainst HtFLlib's code (" + str(reference_file) + "):\n")
        print(side_by_side(ours, json.loads(reference_file.read_text())))


if __name__ == "__main__":
    main()
