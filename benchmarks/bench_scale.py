"""Scale (issue 15 target 3): many clients on one machine -- peak memory, disk, start-up, seconds per round.

Three groups of settings, each setting in its own process so that its peak RSS (``ru_maxrss``) is its own:

* ``mnist``: MNIST, ``client_dirichlet`` alpha 0.5, 10 clients per round, the defaults otherwise (FedLMD
  CNN, E = 5, B = 50, lr 0.01, augmentation, evaluation on the 10k test images every round), K = 100
  (600 samples per client) against K = 10,000 (6 per client), FedAvg and SCAFFOLD (client state on disk,
  fp32 and ``run.client_state_dtype: bf16``). The K = 100 runs are the seconds-per-round reference and run
  ``--reference-rounds`` rounds (a round costs the same in round 10 as in round 50 there).
* ``accuracy``: what bf16 client state does to SCAFFOLD's accuracy where clients come back often enough for
  their control variates to matter: the embedded digits, 20 clients, 5 per round, several seeds.
* ``synthetic``: FedProx's Synthetic(1, 1), K = 1,000 / 10,000 / 100,000 clients, FedAvg with logistic
  regression, 10 clients per round, FedProx's local settings (E = 20, B = 10, lr 0.01, plain SGD).

Start-up is load + partition + Simulation construction (imports excluded, reported apart). Disk is what
``client_states/`` holds at the end, per client that has trained. Timings on a shared machine are indicative.

    PYTHONPATH=src python benchmarks/bench_scale.py --data-dir ../shared/data [--groups mnist,accuracy,synthetic]
        [--rounds 50] [--reference-rounds 10] [--eval-every 5] [--synthetic-rounds 20] [--json benchmarks/out/scale.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()


def _mnist_config(algorithm: str, clients: int, dtype: str, rounds: int, data_dir: str, threads: int, every: int) -> dict:
    return {
        "algorithm": algorithm,
        "rounds": rounds,
        "clients_per_round": 10,
        "eval": {"every": every},
        "dataset": {"name": "mnist", "data_dir": data_dir},
        "partition": {"scheme": "client_dirichlet", "alpha": 0.5, "num_clients": clients},
        "run": {"progress": False, "threads": threads, "checkpoint_every": 10, "client_state": "disk", "client_state_dtype": dtype},
    }


def _digits_config(dtype: str, seed: int, rounds: int, threads: int) -> dict:
    return {
        "algorithm": "scaffold",
        "seed": seed,
        "rounds": rounds,
        "clients_per_round": 5,
        "dataset": {"name": "digits"},
        "partition": {"scheme": "client_dirichlet", "alpha": 0.5, "num_clients": 20},
        "local": {"epochs": 2, "batch_size": 20, "lr": 0.05},
        "run": {"progress": False, "threads": threads, "checkpoint_every": 0, "client_state": "memory", "client_state_dtype": dtype},
    }


def _synthetic_config(clients: int, rounds: int, threads: int, equal_sizes: bool = False) -> dict:
    # equal_sizes: every client floor(e^4) + 50 = 104 samples, so that every round does the same work and
    # seconds per round can be compared across K without the lognormal's heavy tail in the way.
    options = {"alpha": 1.0, "beta": 1.0, **({"size_log_sigma": 0.0} if equal_sizes else {})}
    return {
        "algorithm": "fedavg",
        "rounds": rounds,
        "clients_per_round": 10,
        "dataset": {"name": "synthetic", "synthetic": options},
        "partition": {"scheme": "natural", "num_clients": clients},
        "local": {"epochs": 20, "batch_size": 10, "lr": 0.01, "lr_decay": 1.0, "momentum": 0.0, "weight_decay": 0.0},
        "run": {"progress": False, "threads": threads, "checkpoint_every": 10},
    }


def _dir_bytes(path: Path) -> tuple[int, int]:
    files = [f for f in path.iterdir() if f.is_file()] if path.is_dir() else []
    return sum(f.stat().st_size for f in files), len(files)


def run_one(setting: dict) -> dict:
    """One setting in this process: its start-up phases, every round, peak memory and disk."""
    from fedistill.config import build_config
    from fedistill.simulation import Simulation, build_federation
    from fedistill.runner import load_dataset_for

    imported = time.perf_counter()
    cfg = build_config(setting["config"])
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        run_dir = Path(tmp)
        t0 = time.perf_counter()
        dataset = load_dataset_for(cfg)
        t1 = time.perf_counter()
        federation = build_federation(cfg, dataset)
        t2 = time.perf_counter()
        sim = Simulation(cfg, dataset, run_dir=run_dir, federation=federation)
        t3 = time.perf_counter()
        generated = getattr(dataset, "clients", None)  # the synthetic federation: how many samples it holds
        sizes = {"clients": federation.num_clients, "train_rows": generated.num_rows if generated is not None else len(dataset.train_y)}
        rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows = []
        for rnd in range(1, cfg.rounds + 1):
            start = time.perf_counter()
            row = sim.run_round(rnd)
            rows.append(
                {
                    "round": rnd,
                    "seconds": time.perf_counter() - start,
                    "train_seconds": row["train_seconds"],
                    "eval_seconds": row["eval_seconds"],
                    "accuracy": row["test_accuracy"],
                    "samples": int(sum(row["train_label_counts"])),
                }
            )
        sim.close()
        state_bytes, state_files = _dir_bytes(run_dir / "client_states")
        with_state = len(sim.state.client_states)
        checkpoint = run_dir / "checkpoint.pt"
        checkpoint_bytes = checkpoint.stat().st_size if checkpoint.exists() else 0
    n = len(rows)
    later = rows[1:] or rows  # round 1 pays one-off costs (allocator warm-up, first state files)
    accuracies = [r["accuracy"] for r in rows if r["accuracy"] is not None]
    return {
        **{k: v for k, v in setting.items() if k != "config"},
        **sizes,
        "import_s": imported - STARTED,
        "load_s": t1 - t0,
        "partition_s": t2 - t1,
        "simulation_s": t3 - t2,
        "startup_s": t3 - t0,
        "rss_after_startup_mb": rss_start,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rounds": n,
        "s_per_round": sum(r["seconds"] for r in rows) / n,
        "s_per_round_after_first": sum(r["seconds"] for r in later) / len(later),
        "train_s_per_round": sum(r["train_seconds"] for r in rows) / n,
        "eval_s_per_round": sum(r["eval_seconds"] for r in rows) / n,
        "s_per_evaluation": sum(r["eval_seconds"] for r in rows) / max(1, len([r for r in rows if r["accuracy"] is not None])),
        "other_s_per_round": sum(r["seconds"] - r["train_seconds"] - r["eval_seconds"] for r in rows) / n,
        "samples_per_round": sum(r["samples"] for r in rows) / n,
        "us_per_sample_epoch": 1e6 * sum(r["train_seconds"] for r in rows)
        / max(1, sum(r["samples"] for r in rows) * cfg.local.epochs),
        "final_accuracy": accuracies[-1] if accuracies else None,
        "best_accuracy": max(accuracies) if accuracies else None,
        "clients_with_state": with_state,
        "state_files": state_files,
        "state_mb": state_bytes / 1e6,
        "state_mb_per_client": state_bytes / 1e6 / with_state if with_state else 0.0,
        "checkpoint_mb": checkpoint_bytes / 1e6,
        "per_round": rows,
    }


def settings(groups: list[str], args: argparse.Namespace) -> list[dict]:
    out: list[dict] = []
    if "mnist" in groups:
        for clients in (100, 10_000):
            for algorithm, dtype in (("fedavg", "fp32"), ("scaffold", "fp32"), ("scaffold", "bf16")):
                out.append(
                    {
                        "group": "mnist",
                        "name": f"{algorithm}{'-bf16' if dtype == 'bf16' else ''} K={clients}",
                        "config": _mnist_config(
                            algorithm, clients, dtype, args.rounds if clients > 100 else args.reference_rounds, args.data_dir,
                            args.threads, args.eval_every,
                        ),
                    }
                )
    if "accuracy" in groups:
        for seed in range(args.seeds):
            for dtype in ("fp32", "bf16"):
                out.append(
                    {
                        "group": "accuracy",
                        "name": f"scaffold-{dtype} digits seed={seed}",
                        "dtype": dtype,
                        "seed": seed,
                        "config": _digits_config(dtype, seed, args.accuracy_rounds, args.threads),
                    }
                )
    if "synthetic" in groups:
        for clients in (1_000, 10_000, 100_000):
            out.append(
                {
                    "group": "synthetic",
                    "name": f"fedavg synthetic(1,1) K={clients}",
                    "config": _synthetic_config(clients, args.synthetic_rounds, args.threads),
                }
            )
        for clients in (1_000, 10_000, 100_000, 1_000_000):
            out.append(
                {
                    "group": "synthetic",
                    "name": f"fedavg synthetic(1,1) equal sizes K={clients}",
                    "config": _synthetic_config(clients, args.synthetic_rounds, args.threads, equal_sizes=True),
                }
            )
    return out


def _print_tables(results: list[dict]) -> None:
    mnist = [r for r in results if r["group"] == "mnist"]
    if mnist:
        print("\n| setting | start-up s (load / partition / sim) | peak RSS MB | s/round (train / eval) | s per evaluation | state MB per client | clients with state | state dir MB | checkpoint MB | acc % |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in mnist:
            print(
                f"| {r['name']} | {r['startup_s']:.2f} ({r['load_s']:.2f} / {r['partition_s']:.2f} / {r['simulation_s']:.2f}) "
                f"| {r['peak_rss_mb']:.0f} | {r['s_per_round']:.2f} ({r['train_s_per_round']:.2f} / {r['eval_s_per_round']:.2f}) "
                f"| {r['s_per_evaluation']:.2f} | {r['state_mb_per_client']:.2f} | {r['clients_with_state']} | {r['state_mb']:.0f} | {r['checkpoint_mb']:.1f} "
                f"| {r['final_accuracy']:.2f} |"
            )
    accuracy = [r for r in results if r["group"] == "accuracy"]
    if accuracy:
        print("\n| seed | SCAFFOLD, fp32 state: final / mean of last 10 rounds, acc % | bf16 state: final / mean of last 10 | bf16 - fp32: final / last 10 / mean abs per round |")
        print("|---|---|---|---|")
        for seed in sorted({r["seed"] for r in accuracy}):
            a = next(r for r in accuracy if r["seed"] == seed and r["dtype"] == "fp32")
            b = next(r for r in accuracy if r["seed"] == seed and r["dtype"] == "bf16")
            curve_a = [x["accuracy"] for x in a["per_round"]]
            curve_b = [x["accuracy"] for x in b["per_round"]]
            last_a, last_b = sum(curve_a[-10:]) / len(curve_a[-10:]), sum(curve_b[-10:]) / len(curve_b[-10:])
            gap = sum(abs(x - y) for x, y in zip(curve_a, curve_b)) / len(curve_a)
            print(
                f"| {seed} | {a['final_accuracy']:.2f} / {last_a:.2f} | {b['final_accuracy']:.2f} / {last_b:.2f} "
                f"| {b['final_accuracy'] - a['final_accuracy']:+.2f} / {last_b - last_a:+.2f} / {gap:.2f} |"
            )
    synthetic = [r for r in results if r["group"] == "synthetic"]
    if synthetic:
        print("\n| setting | samples N | start-up s (load / partition / sim) | peak RSS MB | s/round (train / eval / other) | samples per round | µs per sample-epoch | acc % |")
        print("|---|---|---|---|---|---|---|---|")
        for r in synthetic:
            print(
                f"| {r['name'].replace('fedavg synthetic(1,1) ', '')} | {r['train_rows']:,} | {r['startup_s']:.2f} ({r['load_s']:.2f} / {r['partition_s']:.2f} / {r['simulation_s']:.2f}) "
                f"| {r['peak_rss_mb']:.0f} | {r['s_per_round']:.2f} ({r['train_s_per_round']:.2f} / {r['eval_s_per_round']:.3f} / {r['other_s_per_round']:.3f}) "
                f"| {r['samples_per_round']:.0f} | {r['us_per_sample_epoch']:.1f} | {r['final_accuracy']:.2f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("FEDISTILL_DATA", "data"))
    parser.add_argument("--groups", default="mnist,accuracy,synthetic")
    parser.add_argument("--rounds", type=int, default=50, help="MNIST rounds at K = 10,000")
    parser.add_argument(
        "--reference-rounds", type=int, default=10, help="MNIST rounds at K = 100 (the per-round reference; 600 samples per client)"
    )
    parser.add_argument("--eval-every", type=int, default=1, help="MNIST: evaluate every N rounds (and after the last)")
    parser.add_argument("--synthetic-rounds", type=int, default=20)
    parser.add_argument("--accuracy-rounds", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the bf16 accuracy comparison")
    parser.add_argument("--threads", type=int, default=1, help="run.threads of every setting")
    parser.add_argument("--only", action="append", default=[], help="run only settings whose name contains this")
    parser.add_argument("--json", type=Path, help="also write every result (with every round) here")
    parser.add_argument("--tables", type=Path, nargs="+", help="only print the tables of results saved with --json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        setting = json.loads(args.one)
        print(json.dumps(run_one(setting)))
        return
    if args.tables:
        _print_tables([r for path in args.tables for r in json.loads(path.read_text())])
        return
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    chosen = [s for s in settings(groups, args) if not args.only or any(o in s["name"] for o in args.only)]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({os.cpu_count()} cores), python {platform.python_version()}")
    results = []
    for setting in chosen:
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(setting)], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{setting['name']}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(result)
        print(
            f"{result['name']}: start-up {result['startup_s']:.2f} s, peak {result['peak_rss_mb']:.0f} MB, "
            f"{result['s_per_round']:.2f} s/round, final acc {result['final_accuracy']}",
            flush=True,
        )
    _print_tables(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
