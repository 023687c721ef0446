"""torch.compile (inductor) on the CPU for one client training step: compile cost and speed-up (issue 41, item 2).

The step of fd-mnist's clients: the suite's narrow FedAvg CNN (conv 16 and 32, fc 128) on MNIST-shaped batches of 32,
bf16 autocast, cross-entropy, fused SGD with momentum 0.9, one thread. Eager against ``torch.compile`` of the model
(forward and backward through AOTAutograd); the optimizer step stays eager. Records the first compiled step's time
(the compile cost) and the steady-state step times, and whether a round's steps pay the compile back.

    python benchmarks/bench_compile_step.py [--steps 300]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fedistill.models.registry import build_model


def make_step(model, opt):
    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def timed(step, batches, steps):
    t0 = time.perf_counter()
    first = None
    for i in range(steps):
        x, y = batches[i % len(batches)]
        step(x, y)
        if i == 0:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return first, (total - first) / (steps - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 1, 28, 28, generator=gen).to(memory_format=torch.channels_last), torch.randint(0, 10, (32,), generator=gen)) for _ in range(8)]
    results = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = build_model("cnn", (1, 28, 28), 10, channels=[16, 32], hidden=128).to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
        if mode == "compiled":
            model = torch.compile(model)
        results[mode] = timed(make_step(model, opt), batches, args.steps)
        print(f"{mode}: first step {results[mode][0]:.2f} s, then {1e3 * results[mode][1]:.3f} ms a step", flush=True)
    (_, eager), (first, compiled) = results["eager"], results["compiled"]
    saved = eager - compiled
    print(f"speed-up {eager / compiled:.2f}x; compile cost {first:.1f} s, paid back after "
          f"{'never' if saved <= 0 else f'{first / saved:,.0f} steps'} (an fd-mnist round: 10 clients x ~19 steps of 32 = ~190 steps)")


if __name__ == "__main__":
    main()
