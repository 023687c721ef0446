"""Issue 62: every committed claims.json evaluated again with the library's current statistics (scipy's t-quantile
and Wilcoxon test since issue 62), from the per-seed values each link records; the files are rewritten in place.

Only what the statistics compute changes (each link's interval, verdict and Wilcoxon fields, each row's verdict);
the values, seeds and notes stay as the runs wrote them. tests/test_claims.py checks that every verdict and
p-value of these files stands under the current code.

    PYTHONPATH=src python benchmarks/regenerate_claims.py benchmarks/claims/*.json benchmarks/leaderboards/*/claims.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedistill.fileio import atomic_write
from fedistill.report.claims import LinkResult, chain_verdict, link_verdict, paired_interval, wilcoxon_record


def evaluate_again(record: dict) -> list[str]:
    """Re-evaluate ``record``'s links in place; return what changed, one line each."""
    changes, verdicts = [], []
    for link in record["links"]:
        seeds = sorted(link["a_values"], key=int)
        a_values = {int(s): link["a_values"][s] for s in seeds}
        b_values = {int(s): link["b_values"][s] for s in seeds}
        interval = paired_interval(list(a_values.values()), list(b_values.values()))
        verdict = link_verdict(link["relation"], interval, record["margin"])
        result = LinkResult(link["a"], link["relation"], link["b"], a_values, b_values, interval, verdict)
        new = {"n": interval.n, "mean_difference": interval.mean, "std_difference": interval.std, "ci95_low": interval.low,
               "ci95_high": interval.high, "a_wins": interval.a_wins, "a_below": interval.a_below, "verdict": verdict,
               **wilcoxon_record(result)}  # fmt: skip
        for key, value in new.items():
            if link.get(key) != value:
                changes.append(f"{record['claim']} / {record['column']} / {link['a']} {link['relation']} {link['b']}: {key} {link.get(key)!r} -> {value!r}")
            link[key] = value
        verdicts.append(verdict)
    if record["links"] and record.get("why") is None:
        verdict = chain_verdict(verdicts)
        if verdict != record["verdict"]:
            changes.append(f"{record['claim']} / {record['column']}: verdict {record['verdict']} -> {verdict}")
        record["verdict"] = verdict
    return changes


def main(paths: list[str]) -> None:
    for name in paths:
        path = Path(name)
        records = json.loads(path.read_text())
        changes = [line for record in records for line in evaluate_again(record)]
        atomic_write(path, json.dumps(records, indent=1))  # as reproduce and bench write it
        print(f"{path}: {len(changes)} values changed")
        for line in changes:
            print(f"  {line}")


if __name__ == "__main__":
    main(sys.argv[1:])
