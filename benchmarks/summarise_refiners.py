"""Seconds per round and accuracy curves of server-refiner runs (FedFTG, FedDF, FedGen) against FedAvg.

Reads the run directories that ``fedistill reproduce PRESET`` wrote (``reproduce/PRESET/<column>/<method>/seed<s>``)
and prints, per column and method: the mean seconds per round (rounds 2.., round 1 has start-up costs), the
clients' share (``train_seconds``), the server refiner's share (``*_refine_seconds``), the ratio to FedAvg,
and the test accuracy every few rounds. Usage::

    python benchmarks/summarise_refiners.py reproduce/dafkd_table1_baselines [--every 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from statistics import mean

from fedistill.report.rundir import read_run


def summarise(root: Path, every: int) -> str:
    lines: list[str] = []
    for column in sorted(p for p in root.iterdir() if p.is_dir()):
        runs = {}
        for method_dir in sorted(p for p in column.iterdir() if p.is_dir()):
            for seed_dir in sorted(method_dir.glob("seed*")):
                _, rows, _ = read_run(seed_dir, require_metrics=False)
                if rows:
                    runs[method_dir.name] = rows
        if not runs:
            continue
        def per_round(rows, key):
            later = rows[1:] or rows
            return mean(float(r.get(key) or 0.0) for r in later)

        def refine(rows):
            later = rows[1:] or rows
            return mean(sum(float(v) for k, v in r.items() if k.endswith("refine_seconds") and v is not None) for r in later)

        base = per_round(runs["FedAvg"], "seconds") if "FedAvg" in runs else None
        lines.append(f"\n### {column.name}\n")
        lines.append("| method | rounds | s/round | clients s | server refine s | x FedAvg | best acc % | final acc % |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for name, rows in runs.items():
            accs = [r["test_accuracy"] for r in rows if r.get("test_accuracy") is not None]
            s = per_round(rows, "seconds")
            ratio = f"{s / base:.2f}" if base else "-"
            lines.append(
                f"| {name} | {len(rows)} | {s:.1f} | {per_round(rows, 'train_seconds'):.1f} | {refine(rows):.1f} | {ratio} | "
                f"{max(accs):.2f} | {accs[-1]:.2f} |"
            )
        lines.append("\naccuracy (%) by round:\n")
        rounds = [r["round"] for r in next(iter(runs.values()))]
        shown = [r for r in rounds if r == 1 or r % every == 0]
        lines.append("| method | " + " | ".join(str(r) for r in shown) + " |")
        lines.append("|---|" + "---|" * len(shown))
        for name, rows in runs.items():
            by_round = {r["round"]: r.get("test_accuracy") for r in rows}
            cells = [f"{by_round[r]:.1f}" if by_round.get(r) is not None else "-" for r in shown]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="reproduce/PRESET directory")
    parser.add_argument("--every", type=int, default=2, help="show the accuracy every N rounds")
    args = parser.parse_args()
    print(summarise(args.root, args.every))


if __name__ == "__main__":
    main()
