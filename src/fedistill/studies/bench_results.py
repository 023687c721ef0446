"""The numbers of a ``fedistill bench`` leaderboard (issue 28), computed from a suite's cells.

Per setting, the methods ranked by final accuracy (mean ± std over the seeds that finished), with best accuracy,
rounds to the suite's target, MB and seconds per round, FLOPs per round and the achieved rate against this
machine's bf16 peak; and the suite's claims tested on the same cells (report/claims.py). ``suite`` is a
fedistill.bench.Suite and ``cells`` its fedistill.bench.Cell list (typed Any here: this module is below bench).
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from .bench_rank import FLOPS_FILE, cell_environment, competition_ranks, write_cells
from ..fileio import atomic_open, atomic_write
from ..report.groups import stat
from .reproduce import method_dir_name

__all__ = ["FLOPS_FILE", "UNRECORDED_CPU", "cell_cpu", "leaderboard_rows", "suite_claim_rows", "write_leaderboard"]



def _flops(cells: list[Any]) -> float | None:
    for cell in cells:
        record = getattr(cell, "published", None)
        if record is not None:  # a published cell (bench --update-published): its record has the count
            if record.get("gflops_per_round") is not None:
                return record["gflops_per_round"] * 1e9
            continue
        path = cell.path / FLOPS_FILE
        if path.is_file():
            try:
                return json.loads(path.read_text()).get("flops_per_round")
            except (OSError, ValueError):
                return None
    return None


UNRECORDED_CPU = "unrecorded"
"""The CPU of a cell whose environment.json predates ``cpu_id`` (report/environment.py), or has none."""


def cell_cpu(cell: Any) -> str:
    """The ``cpu_id`` a cell ran on (its environment.json, or a published cell's environment), else
    ``UNRECORDED_CPU``: a cell's seconds are comparable only with those of cells on the same CPU."""
    if getattr(cell, "published", None) is not None:
        env = getattr(cell, "published_environment", None) or {}
    else:
        env = cell_environment(cell.path)  # what cells.json records of it, read the same way
    return env.get("cpu_id") or UNRECORDED_CPU


def leaderboard_rows(
    suite: Any, cells: list[Any], peak_gflops: float | None = None, peak_threads: int = 1
) -> list[dict[str, Any]]:
    """Per setting, one row per method, ranked by final accuracy (mean over the finished seeds; equal means
    share the best rank, 1, 2, 2, 4); n/a and unfinished methods last, unranked. ``peak_gflops``: this machine's
    bf16 matmul rate on ``peak_threads`` threads (the threads each cell has), measured by this bench, against
    which each method's achieved rate (FLOPs of a round / seconds per round) is set."""
    rows = []
    for setting, spec in suite.settings.items():
        part = []
        for method in suite.method_specs():
            mine = [c for c in cells if c.setting == setting and c.method == method]
            if not mine:  # not among these cells (a method registered after the published cells were made)
                continue
            row: dict[str, Any] = {"setting": setting, "label": spec.label, "method": method, "seeds": len(mine)}
            if any(c.state() == "n/a" for c in mine):
                part.append({**row, "status": "n/a", "why": next(c.why_not for c in mine if c.why_not)})
                continue
            results = [r for r in (c.result() for c in mine) if r is not None]
            ok = [r for r in results if r.diverged_after is None]
            final, best = stat(r.final for r in ok), stat(r.best for r in ok)
            reach = []
            if suite.target_accuracy is not None:
                reach = [r.first_round_reaching(suite.target_accuracy) for r in ok]
            reached = [x for x in reach if x is not None]
            row.update(
                metric=mine[0].config.accuracy_metric(),
                status="done" if len(results) == len(mine) else f"{len(results)}/{len(mine)} seeds",
                finished=len(results), diverged=sum(r.diverged_after is not None for r in results),
                final_accuracy=final["mean"], final_accuracy_std=final["std"], best_accuracy=best["mean"], best_accuracy_std=best["std"],
                rounds_to_target=statistics.fmean(reached) if reached else None, reached_target=f"{len(reached)}/{len(reach)}" if reach else None,
                mb_per_round=stat(r.bytes_per_round / 1e6 for r in results if r.bytes_per_round is not None)["mean"],
                seconds_per_round=stat(r.seconds_per_round for r in results if r.seconds_per_round)["mean"],
                why=None,
                # the CPUs its seconds were measured on, with how many cells each: a board whose cells ran on more
                # than one says so (report/leaderboard.py timing_note)
                cpus=dict(sorted(Counter(cell_cpu(c) for c in mine if c.result() is not None).items())),
            )  # fmt: skip
            flops = _flops(mine)
            achieved = flops / row["seconds_per_round"] / 1e9 if flops and row["seconds_per_round"] else None
            row.update(
                gflops_per_round=flops / 1e9 if flops else None, achieved_gflops_per_s=achieved,
                percent_of_bf16_peak=100 * achieved / peak_gflops if achieved and peak_gflops else None,
                bf16_peak_gflops_per_s=peak_gflops, bf16_peak_threads=peak_threads if peak_gflops else None,
            )  # fmt: skip
            part.append(row)
        # competition ranks (bench_rank.competition_ranks): equal final accuracies share the best rank; the
        # name only orders tied rows on the page
        ranked = sorted(
            (r for r in part if r.get("final_accuracy") is not None), key=lambda r: (-r["final_accuracy"], r["method"])
        )
        ranks = competition_ranks({r["method"]: r["final_accuracy"] for r in ranked})
        for row in ranked:
            row["rank"] = ranks[row["method"]]
        rows += ranked + [r for r in part if r.get("final_accuracy") is None]
    return rows


def suite_claim_rows(suite: Any, cells: list[Any]) -> list[dict[str, Any]]:
    """The suite's claims evaluated on its finished cells (report/claims.py: paired differences over seeds, 95 %
    intervals, verdicts); a claim whose methods have unfinished or n/a cells on a setting is listed as not run."""
    from ..report.claims import evaluate_claims, run_value

    by_key = {(c.setting, c.method, c.seed): c for c in cells}

    def why(setting: str, method: str, seed: int) -> str | None:
        result = by_key[(setting, method, seed)].result()
        return None if result is None or result.diverged_after is None else f"diverged after round {result.diverged_after}"

    return evaluate_claims(
        suite.parsed_claims(), list(suite.settings), {s: spec.label for s, spec in suite.settings.items()}, suite.seeds,
        value=lambda c, m, s, metric: run_value(by_key[(c, m, s)].result(), metric),
        available=lambda c, m: all(by_key[(c, m, s)].state() != "n/a" and by_key[(c, m, s)].result() is not None for s in suite.seeds),
        why_missing=why,
        not_run=lambda methods, setting: "; ".join(_unfinished(by_key, setting, m, suite.seeds) for m in methods),
    )  # fmt: skip


def _unfinished(by_key: dict[tuple[str, str, int], Any], setting: str, method: str, seeds: list[int]) -> str:
    """Why a method's cells on a setting cannot enter a claim: n/a there, or not every seed finished."""
    cells = [by_key[(setting, method, s)] for s in seeds]
    if any(c.state() == "n/a" for c in cells):
        return f"{method} is n/a on {setting}"
    return f"{method} has {sum(c.result() is not None for c in cells)}/{len(cells)} seeds finished on {setting}"


def write_leaderboard(
    suite: Any, rows: list[dict[str, Any]], root: Path, cells: list[Any] | None = None, claims: list[dict[str, Any]] | None = None,
    published: dict[str, Any] | None = None,
) -> None:
    """leaderboard.md, .csv, .json and, given the cells (for the curves), one figure per setting and the
    self-contained leaderboard.html (report/leaderboard.py); given the suite's evaluated claims, their verdicts
    beside the tables (and claims.json)."""
    from ..report.leaderboard import leaderboard_markdown

    root.mkdir(parents=True, exist_ok=True)
    if cells is not None:
        from ..report.leaderboard import plot_setting, write_html

        figures = {}
        for setting, spec in suite.settings.items():
            curves: dict[str, list[list[tuple[int, float]]]] = {}
            for cell in (c for c in cells if c.setting == setting):
                result = cell.result()
                if result is not None and result.diverged_after is None and result.accuracies:
                    curves.setdefault(cell.method, []).append(result.accuracies)
            part = [r for r in rows if r["setting"] == setting]
            figures[setting] = plot_setting(spec.label, part, curves, root / f"leaderboard_{method_dir_name(setting)}.png")
        labels = {setting: spec.label for setting, spec in suite.settings.items()}
        from ..report.leaderboard import timing_note

        notes = suite.all_notes() + [note for note in (timing_note(rows),) if note]
        write_html(suite.title, suite.description, notes, labels, rows, figures, suite.target_accuracy,
                   root / "leaderboard.html", claims)  # fmt: skip
    atomic_write(root / "leaderboard.md", leaderboard_markdown(suite, rows, claims))
    if claims:
        from ..report.claims import claims_records

        atomic_write(root / "claims.json", json.dumps(claims_records(claims), indent=1))
    atomic_write(root / "leaderboard.json", json.dumps(rows, indent=1))
    if cells is not None:  # every cell, for `bench --methods` to rank a new method against (bench_rank.py)
        write_cells(suite, cells, root, published)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with atomic_open(root / "leaderboard.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
