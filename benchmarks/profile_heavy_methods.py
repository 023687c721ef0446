"""Where a round of fd-mnist's heavy methods goes: arithmetic kernels against everything else (issue 41, item 2).

For each method, the first seed's cell of one fd-mnist setting (the suite's protocol, card defaults and the suite's
method_settings, one thread, one process, as `fedistill bench` runs it) trains two rounds in this process; the
second (the first pays for one-time allocations, and for DaFKD the GAN's warm-up is round 1's too) runs under
torch.profiler. Its time is split by the operators' own (self) CPU time:

- **matmul/conv**: the kernels that do the FLOPs the leaderboard counts (convolutions forward and backward, mm,
  addmm, bmm, and oneDNN's kernels);
- **elementwise**: every other aten operator (activations, losses, optimizer updates, copies, casts, reductions,
  indexing, BatchNorm);
- **outside operators**: the round's wall time less the operators' self time: Python, autograd's bookkeeping,
  the dispatcher, the loop's own work.

The FLOP rate of the matmul/conv share alone says how close the kernels themselves run to the bf16 peak; the other
two shares are what is not arithmetic. Run on an idle machine:

    python benchmarks/profile_heavy_methods.py --data-dir ../shared/data [--methods fedftg,feddf] [--setting lda_0.1]

Prints a markdown table for benchmarks/RESULTS.md and the top operators of each method.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

HEAVY = ["fedftg", "feddf", "fedgkt", "feddkc", "fedict", "dafkd", "pfedme"]
# Operators whose own time is the FLOPs the leaderboard counts (convolutions forward and backward, oneDNN's
# kernels, matrix products); composites (linear, matmul, _convolution) only dispatch to these.
MATMUL_CONV = {"mm", "addmm", "bmm", "baddbmm", "_addmm_activation"}


def arithmetic(name: str) -> bool:
    op = name.removeprefix("aten::")
    return "convolution" in op or "mkldnn" in op or op in MATMUL_CONV


def profile_method(method: str, setting: str, data_dir: str, top: int) -> dict:
    from fedistill.studies.bench import load_suite, suite_cells
    from fedistill.simulation import Simulation
    from fedistill.runner import load_dataset_for

    suite = load_suite("fd-mnist")
    overrides = ["run.threads=1", "run.workers=1", "run.progress=false", f"dataset.data_dir={data_dir}", "run.checkpoint_every=0"]
    cells = [c for c in suite_cells(suite, Path("/tmp/unused"), overrides) if c.method == method and c.setting == setting]
    cell = min(cells, key=lambda c: c.seed)
    if cell.why_not:
        return {"method": method, "error": cell.why_not}
    cfg = cell.config
    torch.set_num_threads(1)
    dataset = load_dataset_for(cfg)
    sim = Simulation(cfg, dataset)
    sim.run_round(1)
    started = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        row = sim.run_round(2)
    wall = time.perf_counter() - started
    sim.close()
    shares: dict[str, float] = defaultdict(float)
    ops = []
    for event in prof.key_averages():
        self_s = event.self_cpu_time_total / 1e6
        kind = "matmul/conv" if arithmetic(event.key) else "elementwise"
        shares[kind] += self_s
        ops.append((self_s, event.key, event.count))
    ops.sort(reverse=True)
    profiled = sum(shares.values())
    return {
        "method": method,
        "round_seconds_profiled": wall,
        "round_seconds_row": row.get("seconds"),
        "server_seconds": row.get("server_seconds"),
        "matmul_conv_s": shares["matmul/conv"],
        "elementwise_s": shares["elementwise"],
        "outside_s": max(0.0, wall - profiled),
        "top": [(round(s, 3), k, n) for s, k, n in ops[:top]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=os.environ.get("FEDISTILL_DATA"))
    ap.add_argument("--methods", default=",".join(HEAVY))
    ap.add_argument("--setting", default="lda_0.1")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    rows = []
    for method in args.methods.split(","):
        r = profile_method(method, args.setting, args.data_dir, args.top)
        rows.append(r)
        if "error" in r:
            print(f"{method}: n/a ({r['error']})", flush=True)
            continue
        print(f"\n{method}: round {r['round_seconds_profiled']:.2f} s under the profiler (row: {r['round_seconds_row']:.2f} s, server {r['server_seconds']:.2f} s)", flush=True)
        for s, k, n in r["top"]:
            print(f"    {s:8.3f} s  {n:7d}x  {k}", flush=True)
    print("\n| method | round s (profiled) | matmul/conv % | elementwise % | outside operators % | top non-arithmetic operator |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            continue
        total = r["round_seconds_profiled"]
        other = next(((s, k) for s, k, _ in r["top"] if not arithmetic(k)), (0.0, "-"))
        print(
            f"| {r['method']} | {total:.2f} | {100 * r['matmul_conv_s'] / total:.0f} | {100 * r['elementwise_s'] / total:.0f} | "
            f"{100 * r['outside_s'] / total:.0f} | {other[1]} ({100 * other[0] / total:.0f} %) |"
        )


if __name__ == "__main__":
    main()
