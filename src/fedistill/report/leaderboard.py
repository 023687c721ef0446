"""The figures and the self-contained HTML page of a ``fedistill bench`` leaderboard (issue 28).

Per setting: the accuracy curves of every method (mean over its seeds, with a ±1 std band), and final
accuracy against MB per round and against seconds per round (the Pareto view: up and to the left is better).
``leaderboard.html`` holds the tables and the figures (as embedded PNG), so it opens without a network or
the files beside it.
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Any

from .groups import format_stat, mean_curve

__all__ = ["leaderboard_markdown", "plot_setting", "write_html"]


def plot_setting(label: str, rows: list[dict[str, Any]], curves: dict[str, list[list[tuple[int, float]]]], path: Path) -> Path:
    """One figure of three panels for one setting: curves with seed bands, accuracy vs MB, accuracy vs s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    colours = plt.get_cmap("tab20")
    ranked = [r for r in rows if r.get("final_accuracy") is not None]
    for i, row in enumerate(ranked):
        colour = colours(i % 20)
        rounds, mean, std = mean_curve(curves.get(row["method"], []))
        if rounds:
            axes[0].plot(rounds, mean, color=colour, label=row["method"], linestyle="-" if i < 10 else "--", linewidth=1.3)
            axes[0].fill_between(rounds, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)], color=colour, alpha=0.12)
        for axis, key in ((axes[1], "mb_per_round"), (axes[2], "seconds_per_round")):
            if row.get(key):
                axis.errorbar(row[key], row["final_accuracy"], yerr=row.get("final_accuracy_std") or 0, fmt="o", color=colour, capsize=2)
                axis.annotate(row["method"], (row[key], row["final_accuracy"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[0].set(title=f"{label}: accuracy (mean ± std over seeds)", xlabel="round", ylabel="accuracy %")
    axes[1].set(title="final accuracy against traffic", xlabel="MB per round (down + up)", ylabel="final accuracy %", xscale="log")
    axes[2].set(title="final accuracy against time", xlabel="seconds per round", ylabel="final accuracy %", xscale="log")
    if ranked:
        axes[0].legend(fontsize=7, ncol=2, loc="lower right")
    for axis in axes:
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cell(value: Any, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec) if isinstance(value, (int, float)) else html.escape(str(value))


def write_html(title: str, description: str, notes: list[str], settings: dict[str, str], rows: list[dict[str, Any]],
               figures: dict[str, Path], target: float | None, path: Path, claims: list[dict[str, Any]] | None = None) -> Path:  # fmt: skip
    """leaderboard.html: every setting's ranked table and its figure, and the papers' claims tested on the
    suite (report/claims.py rows), with nothing fetched from anywhere."""
    target_head = f"rounds to {target:g} %" if target is not None else "rounds to target"
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:1500px;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "th{background:#f0f0f0}td.m,th.m{text-align:left}tr.na td{color:#888}img{max-width:100%}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if description:
        parts.append(f"<p>{html.escape(description)}</p>")
    if notes:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    for setting, label in settings.items():
        parts.append(f"<h2 id='{html.escape(setting)}'>{html.escape(label)}</h2>")
        parts.append(
            "<table><tr><th>rank</th><th class='m'>method</th><th>final acc %</th><th>best acc %</th><th>metric</th>"
            f"<th>{html.escape(target_head)}</th><th>MB/round</th><th>s/round</th><th>GFLOP/round</th><th>% of bf16 peak</th><th>seeds</th></tr>"
        )
        for r in (r for r in rows if r["setting"] == setting):
            if r["status"] == "n/a":
                parts.append(f"<tr class='na'><td>-</td><td class='m'>{html.escape(r['method'])}</td><td colspan='9' class='m'>n/a: {html.escape(r['why'])}</td></tr>")
                continue
            final = format_stat({"mean": r["final_accuracy"], "std": r["final_accuracy_std"]})
            best = format_stat({"mean": r["best_accuracy"], "std": r["best_accuracy_std"]})
            reach = "-" if r.get("reached_target") is None else (f"{r['rounds_to_target']:.1f} ({r['reached_target']})" if r.get("rounds_to_target") is not None else f"n/r ({r['reached_target']})")
            parts.append(
                f"<tr><td>{r.get('rank', '-')}</td><td class='m'>{html.escape(r['method'])}</td><td>{final}</td><td>{best}</td>"
                f"<td>{_cell(r.get('metric'))}</td><td>{html.escape(reach)}</td><td>{_cell(r.get('mb_per_round'), '.3f')}</td>"
                f"<td>{_cell(r.get('seconds_per_round'))}</td><td>{_cell(r.get('gflops_per_round'))}</td>"
                f"<td>{_cell(r.get('percent_of_bf16_peak'), '.1f')}</td><td>{seeds_text(r)}</td></tr>"
            )
        parts.append("</table>")
        figure = figures.get(setting)
        if figure is not None and figure.is_file():
            data = base64.b64encode(figure.read_bytes()).decode("ascii")
            parts.append(f"<img alt='{html.escape(label)}: curves and Pareto views' src='data:image/png;base64,{data}'>")
    if claims:
        from .claims import METRICS, claim_cells

        parts.append(f"<h2 id='claims'>{CLAIMS_HEADING}</h2><p>{html.escape(CLAIMS_INTRO)}</p>")
        parts.append(
            "<table><tr><th class='m'>claim</th><th class='m'>setting</th><th class='m'>metric</th><th class='m'>mean ± std</th>"
            "<th class='m'>paired difference [95 %]</th><th class='m'>seeds</th><th class='m'>verdict</th></tr>"
        )
        for row in claims:
            cells = claim_cells(row)
            parts.append(
                "<tr>" + "".join(f"<td class='m'>{html.escape(str(v))}</td>" for v in (
                    row["claim"], row["setting"], METRICS[row["metric"]][0], cells["values"], cells["difference"], cells["seeds"]
                )) + f"<td class='m'><b>{html.escape(cells['verdict'])}</b></td></tr>"
            )  # fmt: skip
        parts.append("</table>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


CLAIMS_HEADING = "The papers' claims on this suite"
CLAIMS_INTRO = (
    "Each claim is tested on this suite's cells: the paired difference over seeds with its 95 % t-interval; holds "
    "when the interval is on the claimed side (inside the margin for ~), does not hold when it is on the other, inconclusive otherwise. The "
    "claims table in the README tests the same claims on each paper's own (reduced) protocol."
)


def seeds_text(row: dict[str, Any]) -> str:
    """The seeds column: finished of the suite's, and how many of the finished diverged (their accuracy is not
    in the mean), as the Markdown and the HTML both show it."""
    diverged = row.get("diverged") or 0
    return f"{row.get('finished', 0)}/{row['seeds']}" + (f", {diverged} diverged" if diverged else "")


def leaderboard_markdown(suite, rows: list[dict[str, Any]], claims: list[dict[str, Any]] | None = None) -> str:
    """leaderboard.md: per setting, the ranked table (fedistill.bench.Suite ``suite``), then the verdicts of
    the suite's claims (report/claims.py rows)."""
    lines = [f"# {suite.title}", ""]
    if suite.description:
        lines += [suite.description.strip(), ""]
    peak_row = next((r for r in rows if r.get("bf16_peak_gflops_per_s")), None)
    if peak_row is None:
        rate = "."
    elif peak_row.get("bf16_peak_threads") is None:  # a leaderboard.json written before the per-thread peak
        rate = f" on all cores ({peak_row['bf16_peak_gflops_per_s']:.0f} GFLOP/s, measured by this bench)."
    else:
        threads = peak_row["bf16_peak_threads"]
        rate = (
            f" on {threads} thread{'s' if threads != 1 else ''}, as each cell runs "
            f"({peak_row['bf16_peak_gflops_per_s']:.0f} GFLOP/s, measured by this bench)."
        )
    lines += [
        f"Seeds {suite.seeds}; ranked by final accuracy (mean ± std over the seeds that finished). GFLOP/round: one "
        "round's operations counted by torch.utils.flop_counter (first seed); % of bf16 peak: GFLOP/round over s/round "
        "against this machine's bf16 matmul rate" + rate,
        "",
    ]  # fmt: skip
    notes = suite.all_notes()
    lines += [f"- {note}" for note in notes] + ([""] if notes else [])
    target = f"rounds to {suite.target_accuracy:g} %" if suite.target_accuracy is not None else "rounds to target"
    for setting, spec in suite.settings.items():
        lines += [
            f"## {spec.label}", "",
            f"| rank | method | final acc % | best acc % | metric | {target} | MB/round | s/round | GFLOP/round | % of bf16 peak | seeds |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for r in (r for r in rows if r["setting"] == setting):
            if r["status"] == "n/a":
                lines.append(f"| - | {r['method']} | n/a: {r['why'].replace('|', '/')} | | | | | | | | |")
                continue
            reach = "-" if r["reached_target"] is None else (f"{r['rounds_to_target']:.1f} ({r['reached_target']})" if r["rounds_to_target"] is not None else f"n/r ({r['reached_target']})")
            seeds = seeds_text(r)
            lines.append(
                f"| {r.get('rank', '-')} | {r['method']} | {format_stat({'mean': r['final_accuracy'], 'std': r['final_accuracy_std']})} | "
                f"{format_stat({'mean': r['best_accuracy'], 'std': r['best_accuracy_std']})} | {r['metric']} | {reach} | {_num(r['mb_per_round'], '.3f')} | "
                f"{_num(r['seconds_per_round'], '.2f')} | {_num(r['gflops_per_round'], '.2f')} | {_num(r['percent_of_bf16_peak'], '.1f')} | {seeds} |"
            )
        lines.append("")
    if claims:
        from .claims import claims_markdown

        lines += [f"## {CLAIMS_HEADING}", "", CLAIMS_INTRO, "", claims_markdown(claims)]
    return "\n".join(lines)
