"""The figures and the self-contained HTML page of a ``fedistill bench`` leaderboard (issue 28).

Per setting: the accuracy curves of every method (mean over its seeds, with a ±1 std band), and final
accuracy against MB per round and against seconds per round (the Pareto view: up and to the left is better);
the five best methods, the papers' systems and FedAvg in colour and named, the others a grey backdrop (issue 43).
``leaderboard.html`` holds the tables and the figures (as embedded PNG), so it opens without a network or
the files beside it; its tables sort by a click on a column header (an inline script).
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Any

from .groups import format_stat, mean_curve
from .plots import text_width_points
from ..fileio import atomic_write
from .tables import Cell, Column, html_header, html_table, markdown_table

__all__ = [
    "PAPER_SYSTEMS", "board_baseline", "highlighted_methods", "leaderboard_figure", "leaderboard_markdown", "plot_setting",
    "sortable_header", "timing_note", "write_html", "zero_traffic_position",
]  # fmt: skip


PAPER_SYSTEMS = ("fedlmd", "fedftg", "fedict", "dafkd")
"""The four papers' systems this library reproduces; a method whose name contains one of these is that system
(``fedlmd_tf`` is FedLMD's teacher-free variant, a suite may name ``FedAvg+FedFTG``)."""
BASELINE = "fedavg"
"""The method every other is read against, matched by its whole name (``fedavg_kd`` and ``fedavgm`` are others)."""
LOCAL_BASELINE = "local_only"
"""The baseline of a board without FedAvg (the heterogeneous-model boards, where no model can be averaged): each
client training alone, the reference those methods are read against (HtFLlib's Local)."""
TOP_METHODS = 5


def board_baseline(rows: list[dict[str, Any]]) -> str:
    """The baseline a board's figure draws in black and always names: FedAvg where the board has it, else Local."""
    names = {r["method"].lower() for r in rows if r.get("final_accuracy") is not None}
    return LOCAL_BASELINE if BASELINE not in names and LOCAL_BASELINE in names else BASELINE


def highlighted_methods(rows: list[dict[str, Any]], top: int = TOP_METHODS, systems: tuple[str, ...] = PAPER_SYSTEMS,
                        baseline: str = BASELINE) -> list[str]:  # fmt: skip
    """The methods of one setting's leaderboard rows that its figure draws in colour and names: the ``top`` best by
    rank, the papers' ``systems`` and the ``baseline``, in rank order; the rest are drawn in grey, unnamed.

    Only ranked rows count (a method without a final accuracy, n/a or unfinished, is not drawn at all). A method
    with the same final accuracy as the last of the ``top`` is kept too: equal methods share a rank (1, 2, 2, 4),
    and which of them is named should not depend on the alphabetical order the table lists them in. Names are
    matched case-insensitively.
    """
    ranked = sorted(
        (r for r in rows if r.get("final_accuracy") is not None),
        key=lambda r: (r.get("rank") or math.inf, -r["final_accuracy"], r["method"]),
    )
    cut = ranked[top - 1]["final_accuracy"] if len(ranked) >= top else -math.inf
    chosen = []
    for place, row in enumerate(ranked):
        name = row["method"].lower()
        in_top = place < top or row["final_accuracy"] >= cut
        if in_top or name == baseline.lower() or any(system in name for system in systems):
            chosen.append(row["method"])
    return chosen


# Why these styles: the reader looks for the best methods, the papers' systems and FedAvg; the other methods stay
# as a grey backdrop (thin, no seed band, no label), so 25 curves and names no longer cover each other.
OTHER_COLOUR = "#c4c4c4"
BASELINE_COLOUR = "black"
# tab10 without its grey (which would read as one of the unnamed methods), and one more for a tenth named method
NAMED_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#393b79")
LABEL_SIZE = 8  # points, beside the points of the two scatter panels
LEGEND_ROWS = 2  # below the panels: up to a dozen entries fit the figure's width in two rows


def _spread_labels(axis, points: list[tuple[str, float, float, Any]], dpi: float) -> None:
    """Name each (method, x, y, colour) point beside it, moving a label down where it would overlap one already
    placed (methods often share a traffic or a time to within a few pixels), with a thin leader line when moved."""
    pixels_per_point = dpi / 72
    gap = 1.25 * LABEL_SIZE * pixels_per_point  # one line of text
    placed: list[tuple[float, float, float]] = []  # left, right, baseline of each label, in pixels
    axis.get_xlim(), axis.get_ylim()  # settles the autoscaled limits, which transData reads
    on_screen = [(method, *axis.transData.transform((x, y)), x, y, colour) for method, x, y, colour in points]
    for method, px, py, x, y, colour in sorted(on_screen, key=lambda p: -p[2]):
        left = px + 4 * pixels_per_point
        right = left + text_width_points(method, LABEL_SIZE) * pixels_per_point  # the label's measured width
        label_y = py + 3 * pixels_per_point
        moved = True
        while moved:
            moved = False
            for other_left, other_right, other_y in placed:
                if left < other_right and other_left < right and abs(label_y - other_y) < gap:
                    label_y, moved = other_y - gap, True
        placed.append((left, right, label_y))
        shift = (label_y - py) / pixels_per_point
        leader = {"arrowstyle": "-", "color": colour, "linewidth": 0.5} if shift < 0 else None
        axis.annotate(method, (x, y), xytext=(4, shift), textcoords="offset points", fontsize=LABEL_SIZE, color=colour,
                      va="bottom" if shift >= 0 else "center", arrowprops=leader, zorder=4,
                      bbox={"boxstyle": "square,pad=0.05", "facecolor": "white", "edgecolor": "none", "alpha": 0.7})  # fmt: skip


ZERO_MB_LABEL = "0"


def zero_traffic_position(rows: list[dict[str, Any]]) -> float | None:
    """Where the traffic panel's log axis draws the methods that send nothing (Local: 0 MB a round), or None when
    no ranked row sends nothing: a quarter of the smallest traffic sent (0.6 of a decade to its left), with a tick
    labelled "0" there, so that the method is drawn and read as sending nothing rather than left off the panel
    (log(0) has no place on the axis). 1 MB when every ranked row sends nothing."""
    sent = [r.get("mb_per_round") for r in rows if r.get("final_accuracy") is not None and r.get("mb_per_round") is not None]
    if not any(value == 0 for value in sent):
        return None
    positive = [value for value in sent if value > 0]
    return min(positive) / 4 if positive else 1.0


def leaderboard_figure(label: str, rows: list[dict[str, Any]], curves: dict[str, list[list[tuple[int, float]]]]):
    """The matplotlib Figure of one setting (see ``plot_setting``): the ``highlighted_methods`` in colour with
    their seed bands, named in the legend below the panels and beside their points; every other method in thin
    grey, unnamed (the legend counts them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 3, figsize=(17, 6))
    ranked = [r for r in rows if r.get("final_accuracy") is not None]
    baseline = board_baseline(ranked)
    named = highlighted_methods(rows, baseline=baseline)
    coloured = [m for m in named if m.lower() != baseline]
    colours = {m: NAMED_COLOURS[i % len(NAMED_COLOURS)] for i, m in enumerate(coloured)}
    colours.update({m: BASELINE_COLOUR for m in named if m.lower() == baseline})
    top = set(highlighted_methods(rows, systems=(), baseline=""))
    to_name: dict[Any, list[tuple[str, float, float, Any]]] = {axes[1]: [], axes[2]: []}
    zero_mb = zero_traffic_position(ranked)

    def x_of(row: dict[str, Any], key: str) -> float | None:
        """The row's point on a scatter panel's log axis: nothing sent is drawn at the "0" tick, not dropped."""
        value = row.get(key)
        if value == 0 and key == "mb_per_round":
            return zero_mb
        return value if value else None

    # grey first, so that the named methods are drawn over them
    for row in sorted(ranked, key=lambda r: r["method"] in colours):
        method = row["method"]
        rounds, mean, std = mean_curve(curves.get(method, []))
        if method not in colours:
            if rounds:
                axes[0].plot(rounds, mean, color=OTHER_COLOUR, linewidth=0.8, zorder=1)
            for axis, key in ((axes[1], "mb_per_round"), (axes[2], "seconds_per_round")):
                if (x := x_of(row, key)) is not None:
                    axis.plot(x, row["final_accuracy"], "o", color=OTHER_COLOUR, markersize=4, zorder=1)
            continue
        colour = colours[method]
        # the best methods solid, the papers' systems outside the best dashed, FedAvg dash-dotted in black
        style = "-" if method in top else ("-." if method.lower() == baseline else "--")
        text = f"#{row['rank']} {method}" if row.get("rank") is not None else method
        if rounds:
            axes[0].plot(rounds, mean, color=colour, linestyle=style, linewidth=1.8, label=text, zorder=3)
            if std is not None:  # one seed: no band
                axes[0].fill_between(rounds, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                                     color=colour, alpha=0.12, linewidth=0, zorder=2)  # fmt: skip
        else:  # no curve to draw, yet the method is named in the legend as it is beside its points
            axes[0].plot([], [], color=colour, linestyle=style, linewidth=1.8, label=text)
        for axis, key in ((axes[1], "mb_per_round"), (axes[2], "seconds_per_round")):
            if (x := x_of(row, key)) is not None:
                axis.errorbar(x, row["final_accuracy"], yerr=row.get("final_accuracy_std") or 0, fmt="o",
                              color=colour, capsize=2, markersize=6, zorder=3)  # fmt: skip
                to_name[axis].append((method, x, row["final_accuracy"], colour))
    axes[0].set(title=f"{label}: accuracy (mean ± std over seeds)", xlabel="round", ylabel="accuracy %")
    axes[1].set(title="final accuracy against traffic", xlabel="MB per round (down + up)", ylabel="final accuracy %", xscale="log")
    axes[2].set(title="final accuracy against time", xlabel="seconds per round", ylabel="final accuracy %", xscale="log")
    for axis in axes[1:]:
        # ticks at 1, 2, 5 of each decade written as plain numbers (matplotlib's 2×10^1 labels collide on a short
        # range); over more than three decades (kilobytes to a hundred MB) one tick a decade, or the labels touch
        xs = [x for _, x, _, _ in to_name[axis]] + [x for line in axis.get_lines() for x in line.get_xdata()]
        wide = bool(xs) and min(xs) > 0 and math.log10(max(xs) / min(xs)) > 3
        axis.xaxis.set_major_locator(LogLocator(subs=(1,) if wide else (1, 2, 5)))
        axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.margins(x=0.15)  # room on the right for the names of the rightmost points
    if zero_mb is not None:  # the "0" tick of the methods that send nothing, as a minor tick the log ticks leave alone
        axes[1].xaxis.set_minor_locator(FixedLocator([zero_mb]))
        axes[1].xaxis.set_minor_formatter(FuncFormatter(lambda value, _: ZERO_MB_LABEL))
        axes[1].tick_params(axis="x", which="minor", length=plt.rcParams["xtick.major.size"])  # its label level with the others
        # no number written over the 0: major labels within a factor 2.5 of it (or left of it) stay blank
        axes[1].xaxis.set_major_formatter(FuncFormatter(lambda value, _: "" if value < 2.5 * zero_mb else f"{value:g}"))
    for axis in axes:
        axis.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # the legend goes below the panels, where it covers no curve
    for axis, points in to_name.items():
        _spread_labels(axis, points, fig.dpi)
    if ranked:
        handles, texts = axes[0].get_legend_handles_labels()
        others = len(ranked) - len(named)
        if others:
            handles.append(Line2D([], [], color=OTHER_COLOUR, linewidth=0.8))
            texts.append(f"{others} other method{'s' if others != 1 else ''} (grey)")
        fig.legend(handles, texts, loc="lower center", ncol=max(1, math.ceil(len(texts) / LEGEND_ROWS)), fontsize=9,
                   frameon=False)  # fmt: skip
    return fig


def plot_setting(label: str, rows: list[dict[str, Any]], curves: dict[str, list[list[tuple[int, float]]]], path: Path) -> Path:
    """One figure of three panels for one setting, written to ``path``: the accuracy curves with seed bands, final
    accuracy against MB per round and against seconds per round; the five best methods, the papers' systems and
    FedAvg named and in colour, the others in grey (``highlighted_methods``)."""
    import matplotlib.pyplot as plt

    fig = leaderboard_figure(label, rows, curves)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# Sorts a table of the page by a click on a column header, inline so that the page still opens without a network.
# A numeric column sorts by the number a cell starts with ("85.04 ± 3.79" by 85.04, "12.5 (3/3)" by 12.5); cells
# without one ("n/r (0/3)", "-", an n/a row's missing cells) go last whichever the direction. The first click sorts
# ascending, a second click on the same header reverses; rows that compare equal keep their order.
SORT_SCRIPT = """<script>
function lbKey(text, numeric) {
  var t = (text || '').trim();
  if (numeric) {
    var m = /^[-+]?(\\d+\\.?\\d*|\\.\\d+)(e[-+]?\\d+)?/i.exec(t);
    return m ? parseFloat(m[0]) : null;
  }
  return t === '' || t === '-' ? null : t.toLowerCase();
}
function lbCompare(a, b, descending) {
  if (a === null || b === null) return (a === null) - (b === null);
  var order = typeof a === 'string' ? a.localeCompare(b) : a - b;
  return descending ? -order : order;
}
function lbSort(th) {
  var table = th.closest('table'), column = th.cellIndex, numeric = th.getAttribute('data-type') === 'num';
  var descending = th.getAttribute('data-dir') === 'asc';
  var headers = th.parentNode.cells;
  for (var h = 0; h < headers.length; h++) headers[h].removeAttribute('data-dir');
  th.setAttribute('data-dir', descending ? 'desc' : 'asc');
  var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
  var keyed = rows.map(function (row, i) {
    var cell = row.cells[column];
    return {row: row, key: lbKey(cell ? cell.textContent : '', numeric), i: i};
  });
  keyed.sort(function (x, y) { return lbCompare(x.key, y.key, descending) || x.i - y.i; });
  keyed.forEach(function (k) { body.appendChild(k.row); });
}
</script>"""


def sortable_header(text: str, numeric: bool = False, classes: str = "") -> str:
    """A ``<th>`` that sorts its table by its column when clicked (``SORT_SCRIPT``), numerically or as text."""
    return html_header(Column(text, numeric=numeric, cls=classes), sortable=True)


def _setting_table(rows: list[dict[str, Any]], setting: str, target_head: str) -> tuple[list[Column], list[list[Any]], list[str | None]]:
    """One setting's leaderboard as (columns, cells, row classes), which the Markdown and the HTML page both write
    (report/tables.py): an n/a method's reason spans the columns after its name."""
    columns = [Column("rank", numeric=True), Column("method", cls="m"), Column("final acc %", numeric=True),
               Column("best acc %", numeric=True), Column("metric"), Column(target_head, numeric=True),
               Column("MB/round", numeric=True), Column("s/round", numeric=True), Column("GFLOP/round", numeric=True),
               Column("% of bf16 peak", numeric=True), Column("seeds", numeric=True)]  # fmt: skip
    cells: list[list[Any]] = []
    classes: list[str | None] = []
    for r in (r for r in rows if r["setting"] == setting):
        if r["status"] == "n/a":
            cells.append(["-", r["method"], Cell(f"n/a: {r['why']}", cls="m", span=len(columns) - 2)])
            classes.append("na")
            continue
        reach = "-" if r.get("reached_target") is None else (f"{r['rounds_to_target']:.1f} ({r['reached_target']})" if r.get("rounds_to_target") is not None else f"n/r ({r['reached_target']})")
        cells.append([
            r.get("rank", "-"), r["method"], format_stat({"mean": r["final_accuracy"], "std": r["final_accuracy_std"]}),
            format_stat({"mean": r["best_accuracy"], "std": r["best_accuracy_std"]}), _num(r.get("metric"), ""), reach,
            _num(r.get("mb_per_round"), ".3f"), _num(r.get("seconds_per_round"), ".2f"),
            _num(r.get("gflops_per_round"), ".2f"), _num(r.get("percent_of_bf16_peak"), ".1f"), seeds_text(r),
        ])  # fmt: skip
        classes.append(None)
    return columns, cells, classes


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
        "th{background:#f0f0f0;cursor:pointer;user-select:none}th:hover{background:#e2e2e2}"
        "th[data-dir=asc]::after{content:' \\25B2'}th[data-dir=desc]::after{content:' \\25BC'}"
        "td.m,th.m{text-align:left}tr.na td{color:#888}img{max-width:100%}</style>",
        SORT_SCRIPT,
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if description:
        parts.append(f"<p>{html.escape(description)}</p>")
    if notes:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    parts.append("<p><i>Click a column header to sort its table by that column; click it again to reverse.</i></p>")
    for setting, label in settings.items():
        parts.append(f"<h2 id='{html.escape(setting)}'>{html.escape(label)}</h2>")
        columns, cells, classes = _setting_table(rows, setting, target_head)
        parts.append(html_table(columns, cells, sortable=True, row_classes=classes))
        figure = figures.get(setting)
        if figure is not None and figure.is_file():
            data = base64.b64encode(figure.read_bytes()).decode("ascii")
            parts.append(f"<img alt='{html.escape(label)}: curves and Pareto views' src='data:image/png;base64,{data}'>")
    if claims:
        from .claims import METRICS, claim_cells

        parts.append(f"<h2 id='claims'>{CLAIMS_HEADING}</h2><p>{html.escape(CLAIMS_INTRO)}</p>")
        claim_columns = ("claim", "setting", "metric", "mean ± std", "paired difference [95 %]", "seeds", "verdict")
        claim_rows = []
        for row in claims:
            cells = claim_cells(row)
            claim_rows.append([row["claim"], row["setting"], METRICS[row["metric"]][0], cells["values"], cells["difference"],
                               cells["seeds"], Cell(cells["verdict"], bold=True)])  # fmt: skip
        parts.append(html_table([Column(c, cls="m") for c in claim_columns], claim_rows, sortable=True))
    parts.append("</body></html>")
    atomic_write(path, "\n".join(parts))
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


def timing_note(rows: list[dict[str, Any]]) -> str | None:
    """A note for the board when its rows' seconds come from more than one CPU (each row's ``cpus``: cpu_id ->
    cells), which the s/round and % of peak columns do not show: which CPUs, how many cells each, and that
    times compare only within one. None when one CPU (or none recorded) ran every cell."""
    counts: dict[str, int] = {}
    for row in rows:
        for cpu, n in (row.get("cpus") or {}).items():
            counts[cpu] = counts.get(cpu, 0) + n
    if len(counts) < 2:
        return None
    parts = ", ".join(f"{n} on {cpu}" for cpu, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])))
    return (
        f"Timings from {len(counts)} CPUs: {sum(counts.values())} cells, {parts}. s/round and % of peak compare only "
        "between rows on the same CPU (each row's cpus in leaderboard.json and .csv)."
    )


def leaderboard_markdown(suite, rows: list[dict[str, Any]], claims: list[dict[str, Any]] | None = None) -> str:
    """leaderboard.md: per setting, the ranked table (fedistill.studies.bench.Suite ``suite``), then the verdicts of
    the suite's claims (report/claims.py rows)."""
    lines = [f"# {suite.title}", ""]
    if suite.description:
        lines += [suite.description.strip(), ""]
    peak_row = next((r for r in rows if r.get("bf16_peak_gflops_per_s")), None)
    if peak_row is None and any(r.get("gflops_per_round") for r in rows):
        rate = (": none here (measure_bf16_peak: this machine's bf16 matmuls are slower than its fp32 ones, so bf16 is"
                " not in its hardware and no % is given)."  # fmt: skip
        )
    elif peak_row is None:
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
    notes = suite.all_notes() + [note for note in (timing_note(rows),) if note]
    lines += [f"- {note}" for note in notes] + ([""] if notes else [])
    target = f"rounds to {suite.target_accuracy:g} %" if suite.target_accuracy is not None else "rounds to target"
    for setting, spec in suite.settings.items():
        columns, cells, _ = _setting_table(rows, setting, target)
        lines += [f"## {spec.label}", "", markdown_table(columns, cells)]
        lines.append("")
    if claims:
        from .claims import claims_markdown

        lines += [f"## {CLAIMS_HEADING}", "", CLAIMS_INTRO, "", claims_markdown(claims)]
    return "\n".join(lines)
