"""Profile one FedAvg round on a GPU (issue 29): is the GPU busy, and does the host wait for it once per step?

The round is the FedLMD MNIST protocol of ``bench_fedavg_mnist.py`` (the FedNTD CNN, 100 clients, LDA 0.1, 10 a
round, E = 5, B = 50, crop+flip+cutout), ``run.device=cuda``. Two rounds warm up (CUDA context, cuDNN handles,
the allocator); then

1. one round under ``torch.profiler``: wall seconds, the GPU's busy time (kernels and copies, summed over the
   device events) as a share of the wall, the optimiser steps, and how often the host waited for the device
   (``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` calls, device-to-host copies);
2. one round under CUDA's sync debug mode ("warn"): each synchronising operation with the source line that made
   it, counted, so that a per-step sync shows as a line with one count per step.

Run: python benchmarks/profile_gpu_round.py --data-dir DATA [--precision bf16] [--json out.json] [--trace out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import traceback
import warnings

import torch
from bench_fedavg_mnist import PROTOCOL
from torch.profiler import ProfilerActivity, profile

from fedistill.config import build_config
from fedistill.data.sources import load_dataset
from fedistill.simulation import Simulation, build_federation


def device_time_us(event) -> float:
    """An averaged event's own time on the device, across torch versions' attribute names."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--cuda-graphs", action="store_true", help="run.cuda_graphs: the clients' step replayed from a graph")
    ap.add_argument("--algorithm", default="fedavg", help="a method whose client step goes through local_sgd (fedprox, fedntd, ...)")
    ap.add_argument("--no-partial-graphs", action="store_true", help="the partial batches eagerly, as before issue 41")
    ap.add_argument("--cohort", type=int, help="run.cohort = K: the round's clients trained K at a time as one batched step (issue 66)")
    ap.add_argument("--resident", action="store_true", help="run.resident_weights: the vectors stay on the GPU across the Message boundary (issue 66 item 3)")
    ap.add_argument("--json")
    ap.add_argument("--trace", help="also write the round's Chrome trace here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_gpu_round.py needs a CUDA device")

    if args.no_partial_graphs:
        from fedistill.engine import cuda_graphs

        cuda_graphs.CAPTURE_PARTIAL_BATCHES = False
    settings = {"rounds": 5, "run.device": "cuda", "run.precision": args.precision, "run.cuda_graphs": args.cuda_graphs, "algorithm.name": args.algorithm}
    if args.cohort:
        settings.update({"run.cohort": args.cohort, "run.workers": 1})
    if args.resident:
        settings.update({"run.resident_weights": True, "run.workers": 1})
    cfg = build_config(PROTOCOL, settings)
    dataset = load_dataset("mnist", args.data_dir)
    federation = build_federation(cfg, dataset)
    sim = Simulation(cfg, dataset, federation=federation)
    for rnd in (1, 2):
        sim.run_round(rnd)
    torch.cuda.synchronize()

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        row = sim.run_round(3)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    averages = prof.key_averages()
    by_name = {e.key: e for e in averages}
    busy_us = sum(device_time_us(e) for e in averages if e.device_type == torch.autograd.DeviceType.CUDA)
    count = lambda *names: sum(by_name[n].count for n in names if n in by_name)  # noqa: E731
    dtoh = sum(e.count for e in averages if "DtoH" in e.key or "Device -> Pageable" in e.key or "Device -> Pinned" in e.key)
    steps = count("Optimizer.step#SGD.step")
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "precision": args.precision,
        "cuda_graphs": args.cuda_graphs,
        "cohort": args.cohort,
        "resident_weights": args.resident,
        "algorithm": args.algorithm,
        "partial_graphs": not args.no_partial_graphs,
        "round_wall_s": wall,
        "round_seconds_row": row["seconds"],
        "eval_seconds_row": row["eval_seconds"],
        "gpu_busy_s": busy_us / 1e6,
        "gpu_busy_share": busy_us / 1e6 / wall,
        "optimizer_steps": steps,
        "stream_synchronize_calls": count("cudaStreamSynchronize"),
        "device_synchronize_calls": count("cudaDeviceSynchronize"),
        "device_to_host_copies": dtoh,
        "kernel_launches": count("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"),
    }
    top = sorted((e for e in averages if device_time_us(e) > 0), key=device_time_us, reverse=True)[:15]
    report["top_device_ops"] = [{"name": e.key, "count": e.count, "device_ms": device_time_us(e) / 1e3} for e in top]
    # Where the host's time goes (what keeps the GPU idle): the CPU-side ops and runtime calls by their own time.
    host = sorted((e for e in averages if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    report["top_host_ops"] = [{"name": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in host]
    if args.trace:
        prof.export_chrome_trace(args.trace)

    # 2. Where the remaining synchronisations come from.
    torch.cuda.set_sync_debug_mode("warn")
    sites: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "fedistill" in f.filename]
            where = f"{frames[-1].filename.split('fedistill/')[-1]}:{frames[-1].lineno} {frames[-1].line}" if frames else f"{filename}:{lineno}"
            sites[where] += 1
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            sim.run_round(4)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = original
    sim.close()
    report["sync_sites_round4"] = [{"where": k, "count": v} for k, v in sites.most_common(25)]
    report["sync_total_round4"] = sum(sites.values())

    for key, value in report.items():
        if key not in ("top_device_ops", "sync_sites_round4", "top_host_ops"):
            print(f"{key}: {value}")
    print("\ntop device ops (one round):")
    for op in report["top_device_ops"]:
        print(f"  {op['device_ms']:9.2f} ms  x{op['count']:<6} {op['name'][:90]}")
    print("\ntop host ops by own CPU time (one round):")
    for op in report["top_host_ops"]:
        print(f"  {op['self_cpu_ms']:9.2f} ms  x{op['count']:<6} {op['name'][:90]}")
    print(f"\nsynchronising operations in round 4 ({report['sync_total_round4']} in all, {steps} optimiser steps a round):")
    for site in report["sync_sites_round4"]:
        print(f"  x{site['count']:<6} {site['where'][:140]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
