"""Have the fd-hetero leaders settled by the last round? (issue 65, item 1: "enough rounds for the leaders to settle,
FedTGP's server loss flat by the end").

Reads a bench directory (``fedistill bench``'s ``--out/SUITE``, or a kept copy: SETTING/METHOD/seedN/metrics.jsonl)
and prints, per setting and method, the seeds' mean personalised accuracy over the last two windows of ``--window``
rounds and their difference, and for every method that logs a ``server_loss`` (FedTGP's prototype generator, FedGen's
generator, ...) the same for that loss with its least-squares slope per round over the last window. Windows are of
even length because FedTGP alternates between odd and even rounds (fedtgp.md A3, the code's prototype lag): an odd
window would read that alternation as a trend.

    python benchmarks/hetero_settling.py benchmarks/claims/kept/fd_hetero/fd-hetero-mnist [--window 10] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def read_history(metrics_file: Path) -> list[dict]:
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def least_squares_slope(values: list[float]) -> float:
    """Slope per round of the ordinary least-squares line through ``values`` at rounds 0, 1, ..."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    variance = sum((x - mean_x) ** 2 for x in range(n))
    return covariance / variance


def window_summary(series: list[list[float]], window: int) -> dict:
    """The seeds' mean over the second-to-last and the last ``window`` rounds, their difference, and the mean slope
    over the last window."""
    before = statistics.fmean(statistics.fmean(s[-2 * window:-window]) for s in series)
    last = statistics.fmean(statistics.fmean(s[-window:]) for s in series)
    slope = statistics.fmean(least_squares_slope(s[-window:]) for s in series)
    return {"before": before, "last": last, "change": last - before, "slope_per_round": slope, "seeds": len(series)}


def settling(bench_dir: Path, window: int) -> dict:
    table: dict = {}
    for setting_dir in sorted(p for p in bench_dir.iterdir() if p.is_dir()):
        for method_dir in sorted(p for p in setting_dir.iterdir() if p.is_dir()):
            histories = [read_history(seed_dir / "metrics.jsonl")
                         for seed_dir in sorted(method_dir.glob("seed*")) if (seed_dir / "summary.json").exists()]
            histories = [h for h in histories if len(h) >= 2 * window]
            if not histories:
                continue
            row = {"accuracy": window_summary([[r["personal_accuracy"] for r in h] for h in histories], window)}
            if all(h[-1].get("server_loss") is not None for h in histories):
                row["server_loss"] = window_summary([[r["server_loss"] for r in h] for h in histories], window)
            table.setdefault(setting_dir.name, {})[method_dir.name] = row
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_dir", type=Path)
    parser.add_argument("--window", type=int, default=10, help="rounds per window (even; default 10)")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    if args.window < 2 or args.window % 2:
        parser.error(f"--window must be an even number of at least 2 rounds, got {args.window}")
    table = settling(args.bench_dir, args.window)
    w = args.window
    for setting, methods in table.items():
        print(f"\n{setting}: seeds' mean over the {w} rounds before the last {w}, over the last {w}, change; slope per round in the last {w}")
        for method, row in methods.items():
            acc = row["accuracy"]
            line = (f"  {method:12s} accuracy {acc['before']:6.2f} -> {acc['last']:6.2f} ({acc['change']:+5.2f}, "
                    f"{acc['slope_per_round']:+.3f}/round, {acc['seeds']} seeds)")
            if "server_loss" in row:
                loss = row["server_loss"]
                line += (f"   server loss {loss['before']:.3f} -> {loss['last']:.3f} ({loss['change']:+.3f}, "
                         f"{loss['slope_per_round']:+.4f}/round)")
            print(line)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
