"""Where a FedAvg round's time goes on the FedLMD MNIST protocol (issue 15, target 1).

The same protocol as ``bench_fedavg_mnist.py`` (100 clients, LDA 0.1, 10 per round, E = 5, B = 50, the FedNTD
CNN, crop+flip+cutout, bf16 unless ``--precision fp32``). The library is not modified: the phases are timed from
outside through hooks, so the numbers include the hooks' own (microsecond) cost.

- ``data``: fetching a batch (index gather from the uint8 tensors, normalisation, batched augmentation);
- ``forward``: the model's forward (module forward hooks);
- ``loss + backward``: from the end of the forward to the optimizer's step (cross-entropy, zero_grad, backward);
- ``optimizer``: the fused SGD step (global optimizer step hooks);
- ``rest of step``: from the end of the step to the next batch (the running-loss accumulation, Python);
- ``client overhead``: a client's local update minus its steps (loading the broadcast into the worker model,
  building the optimizer, flattening the upload);
- ``server``: broadcast, aggregation and bookkeeping (the round minus clients and evaluation);
- ``evaluation``: the global model on the 10,000 test images.

One process, one thread: on 2 cores the library runs two such one-thread workers, so the per-step shares are
those of each worker. A second pass with ``run.workers=2`` gives the process overhead (the pool's wall time
against half the summed client time).

Run: python benchmarks/profile_fedavg_mnist.py --data-dir ../shared/data --rounds 3
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from bench_fedavg_mnist import PROTOCOL
from fedistill.config import build_config
from fedistill.data.pipeline import TensorPipeline
from fedistill.data.sources import load_dataset
from fedistill.simulation import ClientRuntime, Simulation, build_federation

PHASES = ("data", "forward", "loss + backward", "optimizer", "rest of step", "client overhead", "server", "evaluation")


class PhaseClock:
    """Attributes wall time between hook events to the phases above."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.mark = time.perf_counter()
        self.steps = 0
        self.client_seconds = 0.0

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self.mark
        self.mark = now


def install_hooks(clock: PhaseClock) -> None:
    original_batches = TensorPipeline.epoch_batches

    def timed_batches(self, *args, **kwargs):
        iterator = original_batches(self, *args, **kwargs)
        while True:
            clock.lap("rest of step")
            try:
                batch = next(iterator)
            except StopIteration:
                clock.lap("data")
                return
            clock.lap("data")
            yield batch

    TensorPipeline.epoch_batches = timed_batches  # type: ignore[method-assign]

    original_update = ClientRuntime.update

    def timed_update(self, *args, **kwargs):
        started = time.perf_counter()
        before = sum(clock.seconds[k] for k in PHASES[:5])
        clock.mark = started
        out = original_update(self, *args, **kwargs)
        clock.lap("rest of step")
        inside = sum(clock.seconds[k] for k in PHASES[:5]) - before
        clock.seconds["client overhead"] += (time.perf_counter() - started) - inside
        clock.client_seconds += time.perf_counter() - started
        return out

    ClientRuntime.update = timed_update  # type: ignore[method-assign]

    def pre_step(optimizer, args, kwargs):
        clock.lap("loss + backward")

    def post_step(optimizer, args, kwargs):
        clock.lap("optimizer")
        clock.steps += 1

    register_optimizer_step_pre_hook(pre_step)
    register_optimizer_step_post_hook(post_step)


def hook_model(model: torch.nn.Module, clock: PhaseClock) -> None:
    def before(module, args):
        if module.training:
            clock.lap("rest of step")

    def after(module, args, output):
        if module.training:
            clock.lap("forward")

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", default="bf16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = {"rounds": args.rounds, "dataset.data_dir": args.data_dir, "run.precision": args.precision, "run.threads": 1}
    dataset = load_dataset("mnist", args.data_dir)
    cfg = build_config(PROTOCOL, base)
    federation = build_federation(cfg, dataset)

    clock = PhaseClock()
    install_hooks(clock)
    sim = Simulation(cfg, dataset, federation=federation)
    hook_model(sim.executor.client_runtime.worker, clock)  # the in-process executor's one reused worker model
    rows = []
    for rnd in range(1, args.rounds + 1):
        if rnd == 2:  # round 1 warms up oneDNN's kernels and the allocator: left out
            clock.seconds.clear()
            clock.steps, clock.client_seconds = 0, 0.0
        before_clients = clock.client_seconds
        row = sim.run_round(rnd)
        clients = clock.client_seconds - before_clients
        if rnd >= 2:
            clock.seconds["evaluation"] += row["eval_seconds"]
            clock.seconds["server"] += row["seconds"] - row["eval_seconds"] - clients
            rows.append(row)
        print(f"round {rnd}: {row['seconds']:.2f} s (eval {row['eval_seconds']:.2f}), acc {row['test_accuracy']:.2f}", flush=True)
    sim.close()
    total = sum(r["seconds"] for r in rows)
    print(f"\n{args.precision}, one process, one thread: {total / len(rows):.2f} s/round over rounds 2-{args.rounds}, "
          f"{clock.steps / len(rows):.0f} steps/round\n")
    print("| phase | s/round | share | µs/step |")
    print("|---|---|---|---|")
    for phase in PHASES:
        s = clock.seconds.get(phase, 0.0)
        per_step = f"{1e6 * s / clock.steps:.0f}" if phase in PHASES[:5] and clock.steps else "-"
        print(f"| {phase} | {s / len(rows):.3f} | {100 * s / total:.1f}% | {per_step} |")
    accounted = sum(clock.seconds.get(p, 0.0) for p in PHASES)
    print(f"| (unaccounted) | {(total - accounted) / len(rows):.3f} | {100 * (total - accounted) / total:.1f}% | - |")

    # Process overhead: the same rounds on two one-thread worker processes.
    cfg2 = build_config(PROTOCOL, {**base, "run.workers": 2})
    sim2 = Simulation(cfg2, dataset, federation=federation)
    wall = []
    for rnd in range(1, args.rounds + 1):
        row = sim2.run_round(rnd)
        if rnd >= 2:
            wall.append(row["train_seconds"])
    sim2.close()
    one = clock.client_seconds / len(rows)
    two = sum(wall) / len(wall)
    print(f"\nclients' training per round: {one:.2f} s in one process; {two:.2f} s wall with two workers "
          f"(ideal {one / 2:.2f} s; pool overhead and load imbalance {two - one / 2:.2f} s, {100 * (two - one / 2) / two:.0f}%)")


if __name__ == "__main__":
    main()
