"""Compare two leaderboard.json files of one suite, method by method (issue 41, item 2's check).

    python benchmarks/compare_leaderboards.py PUBLISHED.json NEW.json [--moved feddf,fedftg,dafkd]

When the cells themselves are gone and only the published leaderboard is kept, its per-method means and
standard deviations (full floats in leaderboard.json) still say whether a re-run computed the same numbers: for
every method not named in ``--moved`` the final and best accuracy's mean and std and the MB per round must be
equal to the last bit ("same"), which three seeds' floats agree on only when every cell does. For the methods
in ``--moved`` (a faster kernel moved their floats) the new 3-seed mean must lie within one published standard
deviation of the published mean ("within 1 std"). Prints one line per (setting, method) and the seconds per
round and % of peak of both; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys

SAME = ("final_accuracy", "final_accuracy_std", "best_accuracy", "best_accuracy_std", "mb_per_round")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("published")
    ap.add_argument("new")
    ap.add_argument("--moved", default="", help="methods whose floats may move (comma-separated)")
    args = ap.parse_args(argv)
    moved = {m for m in args.moved.split(",") if m}
    old = {(r["setting"], r["method"]): r for r in json.load(open(args.published))}
    new = {(r["setting"], r["method"]): r for r in json.load(open(args.new))}
    failures = 0
    print("| setting | method | check | final acc: published -> new | s/round: published -> new | % of peak: published -> new |")
    print("|---|---|---|---|---|---|")
    for key in sorted(old.keys() & new.keys()):
        a, b = old[key], new[key]
        if a.get("final_accuracy") is None or b.get("final_accuracy") is None:
            continue
        if key[1] in moved:
            std = a.get("final_accuracy_std") or 0.0
            ok = abs(b["final_accuracy"] - a["final_accuracy"]) <= std
            check = "within 1 std" if ok else f"moved {b['final_accuracy'] - a['final_accuracy']:+.2f} (std {std:.2f})"
        else:
            differing = [f for f in SAME if a.get(f) != b.get(f)]
            ok = not differing
            check = "same" if ok else "DIFFERS: " + ", ".join(differing)
        failures += not ok

        def pct(r):
            return f"{r['percent_of_bf16_peak']:.1f}" if r.get("percent_of_bf16_peak") else "-"

        print(
            f"| {key[0]} | {key[1]} | {check} | {a['final_accuracy']:.2f} ± {a.get('final_accuracy_std') or 0:.2f} -> "
            f"{b['final_accuracy']:.2f} ± {b.get('final_accuracy_std') or 0:.2f} | {a['seconds_per_round']:.2f} -> "
            f"{b['seconds_per_round']:.2f} | {pct(a)} -> {pct(b)} |"
        )
    print(f"\n{failures} check(s) failed" if failures else "\nevery check passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
