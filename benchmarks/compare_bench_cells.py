"""Compare the cells of two ``fedistill bench`` output directories round by round, bit for bit (issue 28's
from-scratch check: a committed leaderboard's cells re-run on a fresh clone must give the same numbers).

    python benchmarks/compare_bench_cells.py REFERENCE_DIR NEW_DIR

Both are a suite's directory (``<out>/<suite>``). Every cell that finished in NEW_DIR is compared with the same
cell (setting/method/seed) in REFERENCE_DIR: every round's accuracies, losses and byte counts must be equal (the
seconds are not compared), and so must how the run ended (finished, or diverged in which round). Exit status 0 when every compared cell matches, 1 otherwise or when none was compared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# What a round computed; the timings are the only fields a re-run may change.
COMPARED = ("test_accuracy", "test_loss", "train_loss", "personal_accuracy", "bytes_down", "bytes_up", "train_label_counts")


def rounds(cell: Path) -> list[dict]:
    """The cell's recorded rounds; none for a cell that diverged in its first round (no metrics.jsonl)."""
    rows = []
    if not (cell / "metrics.jsonl").is_file():
        return rows
    for line in (cell / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line a killed run left half-written (the readers skip it too)
    return rows


def outcome(cell: Path) -> str:
    """How the run ended: its summary's status, and for a diverged run the round and reason from its run.log."""
    status = json.loads((cell / "summary.json").read_text()).get("status", "finished")
    log = cell / "run.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    diverged = [line.split("diverged: ", 1)[1].split(";", 1)[0] for line in lines if "diverged: " in line]
    return f"{status} ({diverged[-1]})" if diverged else status


def first_difference(reference: list[dict], new: list[dict]) -> str | None:
    if len(new) > len(reference):
        return f"the reference has {len(reference)} rounds, the new cell {len(new)}"
    for ref_row, new_row in zip(reference, new):
        for key in COMPARED:
            if ref_row.get(key) != new_row.get(key):
                return f"round {new_row.get('round')}: {key} {ref_row.get(key)!r} vs {new_row.get(key)!r}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    reference, new = Path(argv[0]), Path(argv[1])
    compared, differing, missing = 0, 0, 0
    for summary in sorted(new.glob("*/*/seed*/summary.json")):
        cell = summary.parent
        name = str(cell.relative_to(new))
        ref_cell = reference / name
        if not (ref_cell / "summary.json").is_file():
            print(f"{name}: not in the reference")
            missing += 1
            continue
        new_rows = rounds(cell)
        difference = first_difference(rounds(ref_cell), new_rows)
        if difference is None and outcome(ref_cell) != outcome(cell):
            difference = f"ended {outcome(ref_cell)!r} vs {outcome(cell)!r}"
        compared += 1
        if difference is None:
            print(f"{name}: {len(new_rows)} rounds identical, {outcome(cell)}")
        else:
            differing += 1
            print(f"{name}: DIFFERENT, {difference}")
    print(f"{compared} cells compared, {compared - differing} identical, {differing} differ, {missing} not in the reference")
    differing += missing
    return 0 if compared and not differing else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
