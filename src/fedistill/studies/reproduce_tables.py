"""``fedistill reproduce``'s tables: the comparison table and the claims as Markdown, CSV and JSON, and printed.

Formatting only: the rows come from :func:`fedistill.reproduce.comparison_rows` and the claims from
:mod:`fedistill.report.claims`; nothing here runs or reads a run.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from ..fileio import atomic_open, atomic_write
from ..report.tables import markdown_table as write_markdown_table


def _acc(value: float | None, std: float | None = None) -> str:
    """``91.23 ± 0.41`` (report.groups' format; one seed: ``91.23 ± n/a``; no mean: ``-``)."""
    from ..report.groups import format_stat

    return format_stat({"mean": value, "std": std})


def _speedup(row: dict[str, Any]) -> str:
    if row["failed"]:
        return f"Failed ({row['failed']})"
    if row["speedup"] is None:
        return "n/r"
    partial = "" if row["speedup_reached"].split("/")[0] == row["speedup_reached"].split("/")[1] else f" ({row['speedup_reached']} seeds)"
    return f"{row['speedup']:.2f}×{partial}"


def _published(row: dict[str, Any]) -> str:
    if row["published_accuracy"] is None:
        return row["published_note"] or "-"
    speed = f" ({row['published_speedup']:.2f}×)" if row["published_speedup"] is not None else ""
    return f"{row['published_accuracy']:.2f}{speed}" + (f" {row['published_note']}" if row["published_note"] else "")


def markdown_table(preset, rows: list[dict[str, Any]], rounds: int, seeds: list[int], claims: list[dict[str, Any]] | None = None,
                   provisional: str | None = None) -> str:
    out = io.StringIO()
    out.write(f"# {preset.title}\n\n{preset.source}\n\n")
    if provisional:
        out.write(provisional + "\n\n")
    out.write(
        f"Ours: best and final accuracy over **{rounds}** rounds (the paper ran {preset.paper_rounds}), seeds {seeds}; "
        "the accuracy is the global model's on the test set, or the clients' average on their own test splits where "
        "the partition has per-client test splits (eval.metric); "
        f"speedup = rounds for {preset.reference_method} to reach its best / rounds for the method to reach it "
        "(n/r = not reached; the paper prints 1.00× there).\n\n"
    )
    for note in preset.notes:
        out.write(f"- {note}\n")
    if preset.notes:
        out.write("\n")
    if claims:
        from ..report.claims import claims_markdown

        out.write(
            "## Claims\n\nEach claim paired over the seeds both methods ran (same seed, same partition): the mean "
            "difference with its 95 % t-interval; holds = the interval excludes 0 in the claimed direction (for "
            "'~': lies within the margin), does not hold = it excludes 0 the other way (for '~': lies outside the "
            "margin), inconclusive otherwise.\n\n"
        )
        out.write(claims_markdown(claims) + "\n")
    for column in dict.fromkeys(r["column"] for r in rows):
        part = [r for r in rows if r["column"] == column]
        out.write(f"## {part[0]['setting']}\n\n")
        table = []
        for r in part:
            delta = (
                f"{r['best_accuracy'] - r['published_accuracy']:+.2f}"
                if r["best_accuracy"] is not None and r["published_accuracy"] is not None
                else "-"
            )
            secs = f"{r['seconds_per_round']:.2f}" if r["seconds_per_round"] else "-"
            ratio = f"{r['seconds_vs_reference']:.2f}" if r["seconds_vs_reference"] else "-"
            traffic = f"{r['bytes_per_round'] / 1e6:.3f}" if r["bytes_per_round"] is not None else "-"
            versus = f"{r['bytes_vs_weight_exchange']:.4g}" if r["bytes_vs_weight_exchange"] is not None else "-"
            table.append([r["method"], _acc(r["best_accuracy"], r["best_accuracy_std"]), _acc(r["final_accuracy"], r["final_accuracy_std"]), _speedup(r),
                          _published(r), delta, secs, ratio, traffic, versus])  # fmt: skip
        columns = ["method", "ours: best acc %", "ours: final acc %", "ours: speedup", "paper: acc % (speedup)", "Δ acc",
                   "s/round", f"× {preset.reference_method}", "MB/round", "× weight exchange"]  # fmt: skip
        out.write(write_markdown_table(columns, table) + "\n")
        out.write("\n")
    return out.getvalue()


def write_tables(preset, rows: list[dict[str, Any]], root: Path, rounds: int, seeds: list[int], claims: list[dict[str, Any]] | None = None,
                 provisional: str | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / "table.md", markdown_table(preset, rows, rounds, seeds, claims, provisional))
    if claims:
        from ..report.claims import claims_records

        atomic_write(root / "claims.json", json.dumps(claims_records(claims), indent=1))
    with atomic_open(root / "table.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    atomic_write(root / "table.json", json.dumps(rows, indent=1))


def print_table(console, preset, rows: list[dict[str, Any]], rounds: int, seeds: list[int], root: Path) -> None:
    from rich.table import Table

    table = Table(title=f"{preset.title}: {rounds} rounds (paper {preset.paper_rounds}), seeds {seeds}", title_justify="left")
    for col in ("setting", "method", "ours acc %", "ours speedup", "paper acc % (speedup)", "s/round", f"× {preset.reference_method}"):
        table.add_column(col, justify="left" if col in ("setting", "method") else "right")
    for r in rows:
        table.add_row(
            r["setting"],
            r["method"],
            _acc(r["best_accuracy"], r["best_accuracy_std"]),
            _speedup(r),
            _published(r),
            f"{r['seconds_per_round']:.2f}" if r["seconds_per_round"] else "-",
            f"{r['seconds_vs_reference']:.2f}" if r["seconds_vs_reference"] else "-",
        )
    console.print(table)
    console.print(f"table: {root / 'table.md'} and {root / 'table.csv'}")
