"""The leaderboard's figure and page as people read them (issue 43, item 3): the figure names only the five best
methods, the papers' systems and FedAvg, the rest grey; the HTML tables sort by a click on a column header."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fedistill.report.leaderboard import (
    OTHER_COLOUR,
    board_baseline,
    SORT_SCRIPT,
    highlighted_methods,
    leaderboard_figure,
    plot_setting,
    write_html,
    zero_traffic_position,
)


def _row(method: str, final: float | None, rank: int | None = None, **more) -> dict:
    """One leaderboard row as bench_results.leaderboard_rows writes it, with only what the figure and page read."""
    row = {
        "setting": "lda", "label": "digits LDA", "method": method, "seeds": 2, "metric": "global", "status": "done",
        "finished": 2, "diverged": 0, "final_accuracy": final, "final_accuracy_std": 1.0 if final is not None else None,
        "best_accuracy": final, "best_accuracy_std": None, "rounds_to_target": None, "reached_target": None,
        "mb_per_round": 10.0, "seconds_per_round": 2.0, "gflops_per_round": None, "percent_of_bf16_peak": None,
        "why": None,
    }  # fmt: skip
    if rank is not None:
        row["rank"] = rank
    return {**row, **more}


def _ranked(*methods_and_finals: tuple[str, float]) -> list[dict]:
    """Rows ranked as the leaderboard ranks them: by final accuracy, ties by name."""
    order = sorted(methods_and_finals, key=lambda mf: (-mf[1], mf[0]))
    return [_row(m, f, rank) for rank, (m, f) in enumerate(order, 1)]


# fd-mnist's shape: more than five methods that are neither systems nor FedAvg, some of them near FedAvg's name
MANY = _ranked(
    ("demlearn", 97.0), ("pfedme", 94.0), ("feddkc", 90.0), ("fedavgm", 88.5), ("fedgkt", 88.2), ("fedlmd_tf", 87.2),
    ("fedlmd", 87.1), ("fedntd", 86.9), ("fedict", 85.9), ("fedadam", 85.8), ("fedavg_kd", 81.0), ("fedavg", 71.3),
    ("feddf", 70.6), ("scaffold", 70.2), ("fedftg", 62.6), ("dafkd", 29.8),
)  # fmt: skip


def test_the_five_best_the_papers_systems_and_fedavg_are_named_in_rank_order():
    assert highlighted_methods(MANY) == [
        "demlearn", "pfedme", "feddkc", "fedavgm", "fedgkt",  # the five best
        "fedlmd_tf", "fedlmd", "fedict", "fedavg", "fedftg", "dafkd",  # FedLMD (both variants), FedICT, FedAvg, FedFTG, DaFKD
    ]  # fmt: skip
    # fedavgm and fedavg_kd are not FedAvg: fedavg_kd (rank 11) stays grey
    assert "fedavg_kd" not in highlighted_methods(MANY) and "fedntd" not in highlighted_methods(MANY)


def test_a_tie_at_the_fifth_place_names_both_methods():
    rows = _ranked(("a", 90.0), ("b", 89.0), ("c", 88.0), ("d", 87.0), ("e", 86.0), ("f", 86.0), ("g", 85.0))
    assert highlighted_methods(rows) == ["a", "b", "c", "d", "e", "f"]
    # a tie above the cut changes nothing: still the five best
    rows = _ranked(("a", 90.0), ("b", 90.0), ("c", 88.0), ("d", 87.0), ("e", 86.0), ("f", 85.0))
    assert highlighted_methods(rows) == ["a", "b", "c", "d", "e"]


def test_a_setting_with_fewer_methods_than_five_names_every_ranked_one():
    rows = _ranked(("b", 80.0), ("a", 85.0), ("fedavg", 70.0)) + [_row("c", None, status="n/a", why="needs a split model")]
    assert highlighted_methods(rows) == ["a", "b", "fedavg"]  # the n/a method is not drawn, so not named
    assert highlighted_methods([]) == []


def test_a_system_in_the_top_five_is_named_once():
    rows = _ranked(("fedlmd", 95.0), ("a", 94.0), ("b", 93.0), ("c", 92.0), ("d", 91.0), ("e", 90.0), ("fedict", 50.0))
    assert highlighted_methods(rows) == ["fedlmd", "a", "b", "c", "d", "fedict"]


def test_without_fedavg_nothing_stands_in_for_it():
    rows = _ranked(("a", 95.0), ("b", 94.0), ("c", 93.0), ("d", 92.0), ("e", 91.0), ("fedavgm", 60.0), ("dafkd", 40.0))
    assert highlighted_methods(rows) == ["a", "b", "c", "d", "e", "dafkd"]
    rows.append(_row("fedavg", None, status="n/a", why="refused"))  # FedAvg n/a on the setting: not drawn, not named
    assert "fedavg" not in highlighted_methods(rows)


def test_a_board_without_fedavg_reads_against_local_drawn_black_and_named():
    """The heterogeneous-model boards have no FedAvg (no model can be averaged): Local is their reference."""
    import matplotlib.pyplot as plt

    rows = _ranked(*[(f"m{i}", 99.0 - i) for i in range(6)], ("local_only", 90.0))
    assert board_baseline(rows) == "local_only" and board_baseline(MANY) == "fedavg"
    assert board_baseline(_ranked(("local_only", 90.0), ("fedavg", 80.0))) == "fedavg"  # FedAvg first where present
    fig = leaderboard_figure("digits LDA", rows, _curves(rows))
    try:
        black = [line.get_label() for line in fig.axes[0].get_lines() if line.get_color() == "black"]
        assert black == ["#7 local_only"]  # seventh, yet named and drawn dash-dotted in black
        assert "local_only" in [t.get_text() for t in fig.axes[1].texts]
    finally:
        plt.close(fig)


def test_a_suites_own_names_are_matched_whatever_their_case():
    rows = _ranked(*[(f"m{i}", 90.0 - i) for i in range(6)], ("FedAvg", 70.0), ("FedAvg+FedFTG", 72.0), ("FedAvg KD", 60.0))
    assert highlighted_methods(rows)[5:] == ["FedAvg+FedFTG", "FedAvg"]


def test_unranked_rows_are_ordered_by_their_final_accuracy():
    """Rows without a rank (a leaderboard.json from elsewhere) are read in final-accuracy order, not row order."""
    rows = [_row(m, f) for m, f in (("x", 50.0), ("y", 99.0), ("z", 70.0))]
    assert highlighted_methods(rows, top=1, systems=(), baseline="z") == ["y", "z"]


def _curves(rows: list[dict]) -> dict[str, list[list[tuple[int, float]]]]:
    """Two seeds of three rounds per method, rising to its final accuracy."""
    return {
        r["method"]: [[(t, r["final_accuracy"] * t / 3 + seed) for t in (1, 2, 3)] for seed in (0, 1)]
        for r in rows if r.get("final_accuracy") is not None
    }  # fmt: skip


def test_the_figure_names_exactly_the_highlighted_methods(tmp_path):
    import matplotlib.pyplot as plt

    rows = MANY + [_row("moon", None, status="n/a", why="refused")]
    named = highlighted_methods(rows)
    fig = leaderboard_figure("digits LDA", rows, _curves(rows))
    try:
        curves, traffic, time = fig.axes
        (legend,) = fig.legends
        texts = [t.get_text() for t in legend.get_texts()]
        # the legend: "#rank method" of each named method in rank order, then how many others are grey
        assert texts[:-1] == [f"#{r['rank']} {r['method']}" for r in rows if r["method"] in named]
        assert texts[-1] == f"{len(MANY) - len(named)} other methods (grey)"
        # beside the points of both scatter panels: the named methods' names and nothing else
        for axis in (traffic, time):
            assert sorted(a.get_text() for a in axis.texts) == sorted(named)
        # every method has a curve; the unnamed ones are grey and carry no label
        lines = [line for line in curves.get_lines() if len(line.get_xdata())]
        assert len(lines) == len(MANY)
        grey = [line for line in lines if line.get_color() == OTHER_COLOUR]
        assert len(grey) == len(MANY) - len(named) and all(line.get_label().startswith("_") for line in grey)
        # FedAvg's curve is the black dash-dotted one
        assert [line.get_label() for line in lines if line.get_color() == "black"] == ["#12 fedavg"]
    finally:
        plt.close(fig)
    path = plot_setting("digits LDA", rows, _curves(rows), tmp_path / "leaderboard_lda.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_figure_of_few_methods_has_no_grey_entry():
    import matplotlib.pyplot as plt

    rows = _ranked(("a", 80.0), ("fedavg", 70.0))
    fig = leaderboard_figure("digits LDA", rows, _curves(rows))
    try:
        assert [t.get_text() for t in fig.legends[0].get_texts()] == ["#1 a", "#2 fedavg"]
    finally:
        plt.close(fig)


def test_a_method_that_sends_nothing_is_drawn_at_the_zero_tick_of_the_traffic_panel():
    """Local sends 0 MB a round: the log axis has no place for 0, so it was left off the panel (fd-hetero-mnist).
    It is drawn a quarter of the smallest traffic to the left of every other point, under a tick labelled 0."""
    import matplotlib.pyplot as plt

    rows = _ranked(("fedtgp", 97.0), ("local_only", 96.0), ("fd", 95.0))
    sent = {"fedtgp": 0.5, "local_only": 0.0, "fd": 0.012}
    rows = [{**r, "mb_per_round": sent[r["method"]]} for r in rows]
    assert zero_traffic_position(rows) == pytest.approx(0.012 / 4)
    fig = leaderboard_figure("digits LDA", rows, _curves(rows))
    try:
        _, traffic, time = fig.axes
        placed = {a.get_text(): a.xy for a in traffic.texts}
        assert placed["local_only"] == (pytest.approx(0.003), 96.0)  # drawn, named, left of FD's 0.012
        assert placed["fd"][0] == pytest.approx(0.012) and placed["fedtgp"][0] == pytest.approx(0.5)
        fig.canvas.draw()  # tick labels are made on drawing
        zero_ticks = [t for t in traffic.xaxis.get_minorticklabels() if t.get_text() == "0"]
        assert [t.get_position()[0] for t in zero_ticks] == [pytest.approx(0.003)]
        assert traffic.get_xlim()[0] < 0.003  # inside the panel
        assert sorted(a.get_text() for a in time.texts) == ["fd", "fedtgp", "local_only"]  # the time panel as before
    finally:
        plt.close(fig)
    # nothing at 0: no zero tick; everything at 0: the point at 1 MB
    assert zero_traffic_position(_ranked(("a", 90.0), ("b", 80.0))) is None
    assert zero_traffic_position([{**r, "mb_per_round": 0.0} for r in _ranked(("a", 90.0))]) == 1.0
    unranked = [{**_row("c", None), "mb_per_round": 0.0}] + _ranked(("a", 90.0))
    assert zero_traffic_position(unranked) is None  # an unranked row is not drawn, so needs no tick


class _Tables(HTMLParser):
    """The page's tables as its reader's browser sees them: each header cell's attributes, each body row's cell
    texts; and every script and stylesheet reference."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[dict] = []
        self.references: list[tuple[str, dict]] = []
        self._cell: list[str] | None = None
        self._in_body = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = dict(attrs)
        if tag in ("script", "link", "img", "iframe"):
            self.references.append((tag, attrs))
        if tag == "table":
            self.tables.append({"headers": [], "rows": []})
        elif tag == "th":
            self.tables[-1]["headers"].append(attrs)
            self._cell = []
        elif tag == "tr" and self.tables and self.tables[-1]["headers"] and self._in_body:
            self.tables[-1]["rows"].append([])
        elif tag == "td":
            self._cell = []
        if tag == "tbody":
            self._in_body = True
        elif tag == "table":
            self._in_body = False

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.tables[-1]["rows"][-1].append("".join(self._cell))
        if tag in ("td", "th"):
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _page(tmp_path: Path) -> str:
    rows = [
        _row("A", 85.04, 2, final_accuracy_std=3.79, rounds_to_target=12.5, reached_target="3/3"),
        _row("b", 9.5, 3, rounds_to_target=None, reached_target="0/3", mb_per_round=None),
        _row("C", 100.0, 1, rounds_to_target=4.0, reached_target="1/3"),
        _row("D", None, status="n/a", why="needs a split model"),
    ]
    claims = [{"claim": "A > C", "setting": "digits LDA", "metric": "final", "verdict": "not run", "why": "D is n/a"}]
    return write_html("t", "", [], {"lda": "digits LDA"}, rows, {}, 90.0, tmp_path / "page.html", claims).read_text()


def test_the_page_sorts_by_a_header_click_with_nothing_fetched(tmp_path):
    page = _page(tmp_path)
    parsed = _Tables()
    parsed.feed(page)
    # one inline script, no script, stylesheet or frame from anywhere
    assert page.count("<script>") == 1 and SORT_SCRIPT in page
    assert all(not attrs.get("src") and not attrs.get("href") for tag, attrs in parsed.references if tag != "img")
    assert "http://" not in page and "https://" not in page
    leaderboard, claims = parsed.tables
    assert len(leaderboard["headers"]) == 11 and len(claims["headers"]) == 7
    for header in leaderboard["headers"] + claims["headers"]:
        assert header["onclick"] == "lbSort(this)" and header["data-type"] in ("num", "text")
    kinds = [h["data-type"] for h in leaderboard["headers"]]
    assert kinds == ["num", "text", "num", "num", "text", "num", "num", "num", "num", "num", "num"]
    assert {h["data-type"] for h in claims["headers"]} == {"text"}
    # the body rows are what the script sorts: the header row is outside them
    assert [r[1] for r in leaderboard["rows"]] == ["A", "b", "C", "D"]


NODE_HARNESS = """
// just what lbSort touches of the DOM: a header row's cells and a table body whose rows move on appendChild
var input = JSON.parse(require('fs').readFileSync(0, 'utf8'));
var table = {tBodies: []}, headRow = {cells: []};
input.types.forEach(function (type, i) {
  var attrs = {'data-type': type};
  headRow.cells.push({cellIndex: i, parentNode: headRow, closest: function () { return table; },
    getAttribute: function (k) { return k in attrs ? attrs[k] : null; },
    setAttribute: function (k, v) { attrs[k] = v; }, removeAttribute: function (k) { delete attrs[k]; }});
});
var body = {rows: input.rows.map(function (cells) {
  return {cells: cells.map(function (text) { return {textContent: text}; })};
})};
body.appendChild = function (row) { body.rows.splice(body.rows.indexOf(row), 1); body.rows.push(row); };
table.tBodies.push(body);
var orders = input.clicks.map(function (column) {
  lbSort(headRow.cells[column]);
  return body.rows.map(function (row) { return row.cells[1].textContent; });
});
var keys = input.keys.map(function (k) { return lbKey(k[0], k[1]); });
console.log(JSON.stringify({orders: orders, keys: keys}));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_sort_script_orders_numbers_by_value_and_puts_missing_cells_last(tmp_path):
    """The page's own script, run by node on its own table: numbers by the value before ±, not as text (9.5 below
    85.04 below 100.00); n/r, '-' and an n/a row's missing cells last in either direction; a second click reverses."""
    parsed = _Tables()
    parsed.feed(_page(tmp_path))
    table = parsed.tables[0]
    script = SORT_SCRIPT.removeprefix("<script>").removesuffix("</script>")
    final, to_target, mb, method = 2, 5, 6, 1
    keys = [["85.04 ± 3.79", True], ["n/r (0/3)", True], ["12.5 (3/3)", True], ["-", True], ["", True], ["-0.5", True],
            ["FedAvg", False], ["-", False]]  # fmt: skip
    request = {"types": [h["data-type"] for h in table["headers"]], "rows": table["rows"],
               "clicks": [final, final, final, to_target, to_target, mb, method, method, final], "keys": keys}  # fmt: skip
    done = subprocess.run(["node", "-e", script + NODE_HARNESS], input=json.dumps(request), capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    result = json.loads(done.stdout)
    assert result["keys"] == [85.04, None, 12.5, None, None, -0.5, "fedavg", None]
    assert result["orders"] == [
        ["b", "A", "C", "D"],  # final acc ascending: 9.5, 85.04, 100.00, then the n/a row
        ["C", "A", "b", "D"],  # the second click reverses; the n/a row stays last
        ["b", "A", "C", "D"],  # a third click ascends again
        ["C", "A", "b", "D"],  # rounds to target: 4.0 (1/3), 12.5 (3/3), then n/r and the n/a row in their order
        ["A", "C", "b", "D"],  # descending, the same two still last
        ["A", "C", "b", "D"],  # MB/round: A and C equal keep their order, b's '-' and D last
        ["A", "b", "C", "D"],  # method: as text, whatever the case
        ["D", "C", "b", "A"],
        ["b", "A", "C", "D"],  # another column starts ascending again
    ]
