"""Issue 61's table of whole DaFKD and FedAvg runs, read from their files (kept or under ``--out``).

For every column and seed under ROOT (``<column>/<method>/seed<S>/{summary.json,metrics.jsonl}``, the layout
of ``fedistill reproduce``): FedAvg's and DaFKD's final accuracy, DaFKD's lowest accuracy from round 3 on, its
most negative server step (``server_step_accuracy_change``: the test accuracy after the server's distillation
minus that of the clients' aggregate before it, with the round) and its rounds at chance (from round 3 on, at
11 % or below), then per column the paired difference DaFKD − FedAvg over the seeds both finished.

    python benchmarks/summarise_dafkd_runs.py benchmarks/claims/kept/dafkd_alpha005_issue61_sgd/dafkd_reduced_issue10
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

CHANCE = 11.0


def read_run(path: Path) -> dict | None:
    summary = path / "summary.json"
    if not summary.exists():
        return None
    info = json.loads(summary.read_text())
    if info.get("status") not in ("finished", "diverged"):
        return None
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    late = [r["test_accuracy"] for r in rows if r["round"] >= 3]
    steps = [(r["server_step_accuracy_change"], r["round"]) for r in rows if r.get("server_step_accuracy_change") is not None]
    return {
        "final": info["final_accuracy"],
        "status": info["status"],
        "lowest_from_3": min(late) if late else None,
        "worst_step": min(steps) if steps else None,
        "at_chance": sum(a <= CHANCE for a in late),
    }


def main(root: str) -> None:
    base = Path(root)
    print("| column, seed | FedAvg | DaFKD | DaFKD lowest from r3 | worst step (round) | rounds at chance |")
    print("|---|---:|---:|---:|---:|---:|")
    for column in sorted(p.name for p in base.iterdir() if p.is_dir()):
        seeds = sorted({int(p.name[4:]) for p in base.glob(f"{column}/*/seed*")})
        pairs = []
        for seed in seeds:
            fedavg = read_run(base / column / "FedAvg" / f"seed{seed}")
            dafkd = read_run(base / column / "DaFKD" / f"seed{seed}")
            if fedavg is None and dafkd is None:
                continue
            cells = [f"{fedavg['final']:.2f}" if fedavg else "(not finished)"]
            if dafkd:
                step = dafkd["worst_step"]
                cells += [f"{dafkd['final']:.2f}" + ("" if dafkd["status"] == "finished" else f" ({dafkd['status']})"),
                          f"{dafkd['lowest_from_3']:.1f}", f"{step[0]:+.1f} (r{step[1]})" if step else "-",
                          str(dafkd["at_chance"])]  # fmt: skip
            else:
                cells += ["(not finished)", "", "", ""]
            print(f"| {column}, {seed} | " + " | ".join(cells) + " |")
            if fedavg and dafkd:
                pairs.append(dafkd["final"] - fedavg["final"])
        if pairs:
            spread = f" ± {statistics.stdev(pairs):.2f}" if len(pairs) > 1 else ""
            print(f"| {column}: DaFKD − FedAvg, {len(pairs)} paired seeds | | {statistics.mean(pairs):+.2f}{spread} | | | |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
