"""The CUDA path (issue 15, target 5): samples/s and s/round on a GPU, beside the CPU figures.

Two workloads, each in fp32 and bf16 (autocast, fp32 master weights), ``run.device=cuda``:

- ``mnist``: FedAvg on the FedLMD MNIST protocol (the FedNTD CNN, 100 clients, LDA 0.1, 10 per round, E = 5,
  B = 50, crop+flip+cutout), as ``bench_fedavg_mnist.py`` runs it on the CPU;
- ``resnet18``: ResNet-18 (cifar stem, 11.2 M parameters) on a stand-in of CIFAR-10's size (50,000 training and
  10,000 test 3x32x32 uint8 images with random pixels and labels, seeded): speed only, its accuracy means
  nothing. Same federation settings as the MNIST protocol.

On the device the uint8 dataset lives in GPU memory, an epoch's order and augmentation draws go over in one
copy, the loss and the evaluation counts accumulate on the device (no host synchronisation per step), and a
client's state is on the device only while it trains. s/round and samples/s leave out round 1 (CUDA context,
cuDNN autotuning). ``--cpu-steps N`` also times N training steps of each model on this machine's CPU.

A third workload, ``--server-methods``, runs the server-side methods of the source papers on the GPU with their
reduced presets' settings (issue 29): FedFTG and DaFKD on ``dafkd_reduced``'s MNIST column (CNN, 20 clients, Dirichlet
0.1, 8 a round, E = 2), FedICT (sim) on ``fedict_fmnist_reduced``'s clients and server on MNIST; seconds per round
with the server's share (``server_seconds``: aggregation plus the generator / distillation step).

Run: python benchmarks/bench_gpu.py --data-dir DATA --rounds 5 [--only mnist] [--server-methods 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

from bench_fedavg_mnist import PROTOCOL
from fedistill.config import build_config
from fedistill.data.dataset import Dataset
from fedistill.data.sources import load_dataset
from fedistill.engine.seeding import sample_clients
from fedistill.simulation import Simulation, build_federation


def stand_in_cifar10(seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset(
        name="cifar10",
        train_x=torch.from_numpy(rng.integers(0, 256, (50_000, 3, 32, 32), dtype=np.uint8)),
        train_y=torch.from_numpy(rng.integers(0, 10, 50_000).astype(np.int64)),
        test_x=torch.from_numpy(rng.integers(0, 256, (10_000, 3, 32, 32), dtype=np.uint8)),
        test_y=torch.from_numpy(rng.integers(0, 10, 10_000).astype(np.int64)),
        num_classes=10,
        mean=(0.5, 0.5, 0.5),
        std=(0.25, 0.25, 0.25),
    )


def workload(name: str, data_dir: str) -> tuple[dict, Dataset]:
    if name == "mnist":
        return PROTOCOL, load_dataset("mnist", data_dir)
    protocol = {**PROTOCOL, "dataset": {"name": "cifar10"}, "model": {"name": "resnet18"}}
    return protocol, stand_in_cifar10()


def run(protocol: dict, dataset: Dataset, overrides: dict, rounds: int) -> dict:
    cfg = build_config(protocol, {"rounds": rounds, **overrides})
    federation = build_federation(cfg, dataset)
    device = torch.device(cfg.run.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sim = Simulation(cfg, dataset, federation=federation)
    rows = []
    for rnd in range(1, rounds + 1):
        row = sim.run_round(rnd)
        if device.type == "cuda":
            torch.cuda.synchronize()
        chosen = sample_clients(federation.num_clients, cfg.clients_per_round, cfg.seed, rnd)
        row["samples"] = cfg.local.epochs * sum(int(federation.train_indices[c].numel()) for c in chosen)
        rows.append(row)
        print(f"  round {rnd}: {row['seconds']:.2f} s (eval {row['eval_seconds']:.2f}), acc {row['test_accuracy']:.2f}", flush=True)
    sim.close()
    timed = rows[1:] if len(rows) > 1 else rows
    train = sum(r["seconds"] - r["eval_seconds"] for r in timed)
    return {
        "s_per_round": float(np.mean([r["seconds"] for r in timed])),
        "train_samples_per_s": sum(r["samples"] for r in timed) / train,
        "eval_s_per_round": float(np.mean([r["eval_seconds"] for r in timed])),
        "eval_images_per_s": len(dataset.test_y) / float(np.mean([r["eval_seconds"] for r in timed])),
        "accuracy_last": rows[-1]["test_accuracy"],
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
    }


SERVER_METHODS = (
    ("FedFTG", "benchmarks/presets/dafkd_reduced.yaml", "mnist_0.1", "FedFTG", {}),
    ("FedICT (sim)", "benchmarks/presets/fedict_fmnist_reduced.yaml", "fmnist_0.5", "FedICT (sim)", {"dataset.name": "mnist"}),
    # last: 16-24 s a round on an H200 (its GAN rounds), it used up the first measurement's time limit
    ("DaFKD", "benchmarks/presets/dafkd_reduced.yaml", "mnist_0.1", "DaFKD", {}),
)


def round_accuracy(row: dict) -> float | None:
    """The global model's test accuracy, or the clients' own models' where a method has no global model."""
    return row.get("test_accuracy") if row.get("test_accuracy") is not None else row.get("personal_accuracy")


def run_rounds(sim: Simulation, rounds: int, device: str, label: str | None = None, stop_after_s: float | None = None) -> list[dict]:
    """Rounds 1..``rounds`` of ``sim`` (each synchronised on a GPU, so its seconds are the device's too), then closed;
    stops early after a round longer than ``stop_after_s``. With ``label``, one line a round."""
    rows = []
    for rnd in range(1, rounds + 1):
        row = sim.run_round(rnd)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        rows.append(row)
        if label is not None:
            print(f"  {label} round {rnd}: {row['seconds']:.2f} s (server {row.get('server_seconds', 0.0):.2f}), acc {round_accuracy(row):.2f}", flush=True)
        if stop_after_s is not None and row["seconds"] > stop_after_s:
            break
    sim.close()
    return rows


def server_methods(data_dir: str, rounds: int, device: str) -> dict:
    """Seconds per round and the server's share for FedFTG, DaFKD and FedICT on their reduced presets' settings."""
    from pathlib import Path

    from fedistill.studies.reproduce import load_preset, run_config
    from fedistill.runner import load_dataset_for

    repo = Path(__file__).resolve().parents[1]
    out = {}
    for label, preset_file, column, method, extra in SERVER_METHODS:
        preset = load_preset(str(repo / preset_file))
        cfg = run_config(preset, column, method, 0, rounds, {"run.device": device, "dataset.data_dir": data_dir, **extra})
        dataset = load_dataset_for(cfg)
        rows = run_rounds(Simulation(cfg, dataset), rounds, device, label=label)
        timed = rows[1:] if len(rows) > 1 else rows
        out[label] = {
            "preset": f"{preset_file} [{column}]",
            "s_per_round": float(np.mean([r["seconds"] for r in timed])),
            "server_s_per_round": float(np.mean([r.get("server_seconds", 0.0) for r in timed])),
            "round1_s": rows[0]["seconds"],
            "accuracy_last": round_accuracy(rows[-1]),
        }
    return out


def cpu_steps(protocol: dict, dataset: Dataset, precision: str, steps: int) -> float:
    """Training samples/s of ``steps`` steps of one client's local SGD on this machine's CPU."""
    cfg = build_config(protocol, {"rounds": 1, "run.precision": precision, "run.device": "cpu"})
    federation = build_federation(cfg, dataset)
    sim = Simulation(cfg, dataset, federation=federation)
    runtime = sim.executor.client_runtime
    from fedistill.algorithms.local import local_sgd

    largest = int(np.argmax([int(ix.numel()) for ix in federation.train_indices]))
    ctx = runtime.context(largest, 1, {})
    ctx.train_indices = ctx.train_indices.repeat(max(1, steps * 50 // max(1, ctx.train_indices.numel()) + 1))[: (steps + 2) * 50]
    local_sgd(ctx, lr=0.01, epochs=1, batch_size=50)  # warm-up: kernels and allocator
    started = time.perf_counter()
    result = local_sgd(ctx, lr=0.01, epochs=1, batch_size=50)
    sim.close()
    return result.samples_seen / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", action="append", choices=["mnist", "resnet18", "none"], help="none: only --server-methods")
    ap.add_argument("--cpu-steps", type=int, default=0)
    ap.add_argument("--server-methods", type=int, default=0, metavar="ROUNDS", help="also FedFTG, DaFKD and FedICT for ROUNDS rounds")
    ap.add_argument("--graphs", action="store_true", help="also each precision with run.cuda_graphs (the captured client step)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--json")
    args = ap.parse_args()
    variants = [(p, False) for p in args.precisions.split(",")] + ([(p, True) for p in args.precisions.split(",")] if args.graphs else [])
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "runs": {},
    }
    for name in args.only or ["mnist", "resnet18"]:
        if name == "none":
            continue
        protocol, dataset = workload(name, args.data_dir)
        if torch.cuda.is_available():
            for precision, graphs in variants:
                label = precision + ("+graphs" if graphs else "")
                print(f"{name} cuda {label}", flush=True)
                results["runs"][f"{name}-cuda-{label}"] = run(
                    protocol, dataset, {"run.device": "cuda", "run.precision": precision, "run.cuda_graphs": graphs}, args.rounds
                )
        if args.cpu_steps:
            for precision in ("fp32", "bf16"):
                results["runs"][f"{name}-cpu-{precision}-steps"] = {"train_samples_per_s": cpu_steps(protocol, dataset, precision, args.cpu_steps)}
    print("\n| workload | device | precision | s/round | training samples/s | eval s/round | eval images/s | peak GPU MB |")
    print("|---|---|---|---|---|---|---|---|")
    for key, r in results["runs"].items():
        name, device, precision = key.split("-")[:3]
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"| {name} | {device} | {precision} | {fmt(r.get('s_per_round'), '.2f')} | {r['train_samples_per_s']:.0f} | "
              f"{fmt(r.get('eval_s_per_round'), '.3f')} | {fmt(r.get('eval_images_per_s'), '.0f')} | {fmt(r.get('peak_gpu_mb'), '.0f')} |")
    if args.server_methods:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        print(f"server-side methods on {device}", flush=True)
        results["server_methods"] = server_methods(args.data_dir, args.server_methods, device)
        print("\n| method | preset | s/round | server s/round | round 1 s | accuracy after the last round |")
        print("|---|---|---|---|---|---|")
        for label, r in results["server_methods"].items():
            print(f"| {label} | {r['preset']} | {r['s_per_round']:.2f} | {r['server_s_per_round']:.2f} | {r['round1_s']:.2f} | {r['accuracy_last']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
