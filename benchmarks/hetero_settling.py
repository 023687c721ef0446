"""Have the fd-hetero leaders settled by the last round? (issue 65, item 1: "enough rounds for the leaders to settle,
FedTGP's server loss flat by the end").

Reads a bench directory (``fedistill bench``'s ``--out/SUITE``, or a kept copy: SETTING/METHOD/seedN/metrics.jsonl)
and prints, per setting and method, the seeds' mean personalised accuracy over the last two windows of ``--window``
rounds, their difference and the least-squares slope per round over the last window, and the same for what a
method's server logs about its own training (``server_loss``; FedTGP's ``margin``). Windows are of
even length because FedTGP alternates between odd and even rounds (fedtgp.md A3, the code's prototype lag): an odd
window would read that alternation as a trend.

    python benchmarks/hetero_settling.py benchmarks/claims/kept/fd_hetero/fd-hetero-mnist [--window 10] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from scipy import stats


# What a server logs about its own training, where it does: the loss of its step (FedTGP's prototype generator,
# FedGen's generator, ...) and FedTGP's adaptive margin δ_t (fedtgp.md T5), which that loss grows with.
SERVER_KEYS = ("server_loss", "margin")


def read_history(metrics_file: Path) -> list[dict]:
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def window_summary(series: list[list[float]], window: int) -> dict:
    """The seeds' mean over the second-to-last and the last ``window`` rounds, their difference, and the mean slope
    over the last window."""
    before = statistics.fmean(statistics.fmean(s[-2 * window:-window]) for s in series)
    last = statistics.fmean(statistics.fmean(s[-window:]) for s in series)
    slope = statistics.fmean(stats.linregress(range(window), s[-window:]).slope for s in series)
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
            for key in SERVER_KEYS:
                if all(h[-1].get(key) is not None for h in histories):
                    row[key] = window_summary([[r[key] for r in h] for h in histories], window)
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
            for key in SERVER_KEYS:
                if key in row:
                    value = row[key]
                    line += (f"   {key.replace('_', ' ')} {value['before']:.3f} -> {value['last']:.3f} "
                             f"({value['change']:+.3f}, {value['slope_per_round']:+.4f}/round)")
            print(line)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
