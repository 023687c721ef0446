"""Issue 28, item 5: where the papers' claims and the leaderboard disagree. Puts a bench suite's claim verdicts
(``<out>/<suite>/claims.json``, tested on the leaderboard's cells) beside the same claims' verdicts on the papers'
reduced protocols (the ``claims.json`` of ``fedistill reproduce`` runs, README's claims table), as Markdown.

    python benchmarks/claims_vs_leaderboard.py bench/fd-mnist/claims.json claims/*/claims.json

Claims are matched by their methods and relations, with method names compared without case, punctuation or a
parenthesised variant ("FedLMD-Tf" is fd-mnist's "fedlmd_tf", "FedICT (sim)" its "fedict"), and by metric.
A row says "agree" when both verdicts are the same, "disagree" when one holds and the other does not hold, and
"differ" otherwise (one side inconclusive), "-" when either was not run.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def method_key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", re.sub(r"\(.*?\)", "", name.lower()))


def claim_key(record: dict) -> tuple:
    parts = re.split(r"\s+(>|<|~|≈)\s+", record["claim"].strip())
    methods = tuple(method_key(p) for p in parts[0::2])
    relations = tuple("~" if r == "≈" else r for r in parts[1::2])
    return methods, relations, record["metric"]


def verdict_text(record: dict) -> str:
    links = record.get("links") or []
    diffs = "; ".join(f"{link['mean_difference']:+.2f} [{link['ci95_low']:+.2f}, {link['ci95_high']:+.2f}]"
                      for link in links if link.get("ci95_low") is not None)  # fmt: skip
    return f"{record['verdict']}" + (f" ({diffs})" if diffs else "")


def agreement(a: str, b: str) -> str:
    if "not run" in (a, b):
        return "-"
    if a == b:
        return "agree"
    if {a, b} == {"holds", "does not hold"}:
        return "disagree"
    return "differ"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[4].strip(), file=sys.stderr)
        return 2
    suite = json.loads(Path(argv[0]).read_text())
    # A paper-protocol record that was never run (a sweep row left out of the invocation) has nothing to compare.
    papers = [r for path in argv[1:] for r in json.loads(Path(path).read_text()) if r["verdict"] != "not run"]
    print("| claim | metric | paper protocol (setting: verdict) | leaderboard (setting: verdict) | |")
    print("|---|---|---|---|---|")
    for record in suite:
        matches = [p for p in papers if claim_key(p) == claim_key(record)]
        if not matches:
            print(f"| {record['claim']} | {record['metric']} | not tested on a paper protocol | {record['setting']}: {verdict_text(record)} | |")
            continue
        for paper in matches:
            print(
                f"| {record['claim']} | {record['metric']} | {paper['setting']}: {verdict_text(paper)} | "
                f"{record['setting']}: {verdict_text(record)} | {agreement(paper['verdict'], record['verdict'])} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
