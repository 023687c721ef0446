"""Figures for a paper: integer round ticks, markers (a 1-round run is not an empty plot), titles with the
dataset, partition, alpha and clients, a partition heatmap readable for 10 to 1000 clients, class-distribution
heatmaps anchored on the uniform share, and vector output chosen by the file's extension."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb

from fedistill import runner
from fedistill.cli import main
from fedistill.config import build_config
from fedistill.errors import ConfigError
from fedistill.report.plots import (
    accuracy_figure,
    class_distributions_figure,
    config_title,
    figure_title,
    partition_figure,
    partition_matrix,
    personal_accuracy_figure,
    plot_accuracy,
    plot_class_distributions,
    plot_partition,
)

FAST = ["--clients", "4", "--clients-per-round", "2", "--epochs", "1", "--no-progress", "--set", "run.threads=1"]

pytestmark = pytest.mark.draw_figures  # these tests are of the drawing itself (tests/conftest.py)


def _drawn(fig):
    FigureCanvasAgg(fig).draw()
    return fig


def _integer_ticks(ax) -> list[float]:
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    return ticks


def test_round_axis_has_integer_ticks_and_markers():
    curves = {"a": [(r, 10.0 + r) for r in range(1, 8)], "b": [(r, 9.0 + r) for r in range(1, 8)]}
    ax = accuracy_figure(curves).axes[0]
    _integer_ticks(ax)
    assert all(line.get_marker() not in (None, "None", "") for line in ax.get_lines()[:2])
    long = accuracy_figure({"a": [(r, float(r)) for r in range(1, 201)]}).axes[0]
    _integer_ticks(long)
    assert long.get_lines()[0].get_markevery() is not None  # a long run marks some points, not all 200


def test_a_one_round_run_shows_its_point():
    fig = _drawn(accuracy_figure({"fedavg": [(1, 17.1)]}, title="t"))
    ax = fig.axes[0]
    (line,) = ax.get_lines()
    assert line.get_marker() == "o" and line.get_markersize() > 0
    lo, hi = ax.get_xlim()
    assert lo < 1 < hi and hi - lo >= 1
    assert _integer_ticks(ax) == [1.0]
    y0, y1 = ax.get_ylim()
    assert y0 < 17.1 < y1 and y1 - y0 >= 5  # not a magnified sliver around one value
    history = [{"round": 1, "personal_accuracy": 10.0, "personal_min": 0.0, "personal_q1": 2.0, "personal_median": 8.0, "personal_q3": 16.0, "personal_max": 56.0}]
    ax = personal_accuracy_figure(history, "fedavg").axes[0]
    lo, hi = ax.get_xlim()
    assert lo < 1 < hi and _integer_ticks(ax) == [1.0]
    assert ax.collections  # the client bands are drawn (as bars) even over one round


def test_overlapping_curves_differ_in_colour_style_and_marker_and_the_legend_is_below_the_axes():
    curves = {f"run-{i}": [(r, 50.0) for r in range(1, 11)] for i in range(4)}
    fig = _drawn(accuracy_figure(curves, target=50.0))
    ax = fig.axes[0]
    lines = ax.get_lines()[:4]
    for attr in ("get_color", "get_linestyle", "get_marker"):
        assert len({getattr(line, attr)() for line in lines}) == 4, attr
    assert ax.get_legend() is None and len(fig.legends) == 1
    assert fig.legends[0].get_window_extent().y1 <= ax.get_window_extent().y0  # never over the curves
    assert len(fig.legends[0].get_texts()) == 5  # four runs and the target


def test_bands_are_filled_in_the_colour_of_their_line():
    curves = {"a": [(1, 10.0), (2, 20.0), (3, 30.0)], "b": [(1, 12.0), (2, 22.0), (3, 28.0)]}
    bands = {"b": ([1, 2, 3], [10.0, 20.0, 25.0], [14.0, 24.0, 31.0])}
    ax = accuracy_figure(curves, bands=bands).axes[0]
    (poly,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    line_b = [line for line in ax.get_lines() if line.get_label() == "b"][0]
    assert np.allclose(poly.get_facecolor()[0][:3], to_rgb(line_b.get_color()))
    assert 0.1 <= poly.get_alpha() <= 0.3


def test_figure_title_states_dataset_scheme_alpha_and_clients():
    assert figure_title("digits", "lda", 0.1, 20) == "digits · lda α=0.1 · 20 clients"
    assert figure_title("mnist", "client_dirichlet", 0.5, 100, "fedavg") == "fedavg · mnist · client_dirichlet α=0.5 · 100 clients"
    assert figure_title("digits", "iid", 0.5, 1) == "digits · iid · 1 client"  # alpha means nothing to iid
    assert figure_title("digits", "shards", 0.5, 10, shards_per_client=2) == "digits · shards (2 per client) · 10 clients"
    cfg = build_config({}, {"partition.alpha": 0.1, "partition.num_clients": 20, "run.threads": 1})
    assert config_title(cfg) == f"{cfg.dataset.name} · lda α=0.1 · 20 clients"


def test_partition_command_and_run_directory_carry_the_same_title(tmp_path, monkeypatch):
    titles: list[str] = []
    real = runner.plot_partition

    def spy(counts, path, title="", percent=False):
        titles.append(title)
        real(counts, path, title, percent)

    monkeypatch.setattr(runner, "plot_partition", spy)
    assert main(["partition", "--clients", "4", "--alpha", "0.3", "--out", str(tmp_path / "p.svg"), "--max-rows", "0"]) == 0
    assert main(["run", *FAST, "--rounds", "1", "--alpha", "0.3", "--out", str(tmp_path), "--name", "r", "-q"]) == 0
    assert titles[0] == titles[1] and "α=0.3" in titles[0] and "4 clients" in titles[0]
    assert "<svg" in (tmp_path / "p.svg").read_text()[:1000]
    for name in ("accuracy.png", "partition.png", "class_distributions.png"):
        assert (tmp_path / "r" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    # compare writes the format its --out names, and the class-distribution sibling keeps the extension
    assert main(["compare", str(tmp_path / "r"), "--out", str(tmp_path / "c.pdf")]) == 0
    assert (tmp_path / "c.pdf").read_bytes()[:4] == b"%PDF"
    assert (tmp_path / "c_class_distributions.pdf").read_bytes()[:4] == b"%PDF"


def test_run_figures_false_writes_the_results_without_a_figure_and_compare_draws_them_later(tmp_path):
    """run.figures (issue 62 item 9): the default draws the run's figures (the test above); false writes every
    result file but no figure, and `fedistill compare` still draws the curves from the metrics."""
    assert build_config({}, {}).run.figures is True
    assert main(["run", *FAST, "--rounds", "1", "--set", "run.figures=false", "--out", str(tmp_path), "--name", "r", "-q"]) == 0
    run = tmp_path / "r"
    assert sorted(p.name for p in run.glob("*.png")) == []
    for name in ("metrics.jsonl", "metrics.csv", "summary.json", "partition_counts.csv", "config.yaml"):
        assert (run / name).stat().st_size > 0, name
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_partition_percent_rows_sum_to_100_and_zero_cells_are_masked():
    counts = np.array([[5, 0, 15], [0, 0, 7], [1, 1, 1]])
    pct = partition_matrix(counts, percent=True)
    assert np.allclose(pct.filled(0).sum(axis=1), 100.0)
    assert pct.mask.tolist() == (counts == 0).tolist()
    raw = partition_matrix(counts)
    assert raw.mask.tolist() == (counts == 0).tolist() and raw[0, 2] == 15
    fig = partition_figure(counts, "t", percent=True)
    (im,) = fig.axes[1].get_images()
    assert np.ma.is_masked(im.get_array()) and im.get_array().mask.sum() == 3
    assert np.allclose(im.get_cmap().get_bad()[:3], 1.0)  # white, never a colour of the scale
    assert im.norm.vmax == 100.0 and "%" in fig.axes[2].get_ylabel()


@pytest.mark.parametrize("clients", [10, 100, 1000])
def test_partition_heatmap_puts_clients_along_x_in_a_bounded_figure(clients):
    rng = np.random.default_rng(0)
    counts = rng.poisson(rng.dirichlet(np.full(10, 0.1), size=clients) * 50)
    counts[:, 0] += 1  # no empty client
    fig = partition_figure(counts, "t")
    ax = fig.axes[1]
    (im,) = ax.get_images()
    assert im.get_array().shape == (10, clients) and ax.get_xlabel() == "client"
    assert im.norm.vmin == 1.0  # a log scale from a single sample up
    width, height = fig.get_size_inches()
    assert 6 <= width <= 12 and height <= 8
    _integer_ticks(ax)


def test_class_distributions_are_anchored_on_the_uniform_share():
    history = [
        {"round": r, "train_label_counts": [10, 10, 10, 10], "prediction_counts": [40, 0, 0, 0] if r == 1 else [20, 10, 5, 5]}
        for r in (1, 2, 3)
    ]
    fig = _drawn(class_distributions_figure({"fedavg-digits-20260101": history}, title="digits · iid · 4 clients"))
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert len(panels) == 2
    im = panels[0].get_images()[0]
    assert np.isclose(im.norm(25.0), 0.5)  # the uniform share 100/C sits in the middle of the scale (white)
    assert np.allclose(im.get_array().filled(0)[0], 25.0)  # shares in percent
    assert panels[0].get_title().startswith("fedavg-digits-20260101\n")  # the run name on its own line
    bar = [ax for ax in fig.axes if not ax.get_images()][0]
    assert "uniform" in bar.get_ylabel() and any("uniform" in t.get_text() for t in bar.get_yticklabels())
    lo, hi = panels[0].get_ylim()
    ticks = [t for t in panels[0].get_yticks() if min(lo, hi) <= t <= max(lo, hi)]
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_vector_formats_follow_the_extension(tmp_path):
    counts = np.array([[3, 0], [1, 4]])
    curves = {"a": [(1, 10.0), (2, 20.0)]}
    history = [{"round": 1, "train_label_counts": [1, 3], "prediction_counts": [2, 2]}]
    for suffix in ("pdf", "svg"):
        plot_partition(counts, tmp_path / f"p.{suffix}", "t")
        plot_accuracy(curves, tmp_path / f"a.{suffix}")
        assert plot_class_distributions({"r": history}, tmp_path / f"c.{suffix}")
    for name in ("p", "a", "c"):
        assert (tmp_path / f"{name}.pdf").read_bytes()[:4] == b"%PDF"
        assert "<svg" in (tmp_path / f"{name}.svg").read_text()[:1000]
    with pytest.raises(ConfigError, match=r"\.xyz"):
        plot_accuracy(curves, tmp_path / "a.xyz")
    assert not (tmp_path / "a.xyz").exists()


def test_label_widths_are_measured_not_counted():
    """Issue 62: the legend's columns and the leaderboard's point labels take the text's width as matplotlib sets it
    (report/plots.text_width_points), not a guessed width per character: six W are wider than six i, a label is
    wider at a larger size, and the legend fits fewer columns of wide labels than of narrow ones."""
    from matplotlib.figure import Figure

    from fedistill.report.plots import _legend_columns, text_width_points

    narrow, wide = text_width_points("iiiiii", 8.5), text_width_points("WWWWWW", 8.5)
    assert 0 < narrow < wide / 2
    assert text_width_points("FedAvg", 17.0) == pytest.approx(2 * text_width_points("FedAvg", 8.5), rel=0.05)
    # the same width as a text drawn on a figure and measured by its renderer (72 points an inch)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure(dpi=100)
    canvas = FigureCanvasAgg(fig)
    drawn = fig.text(0, 0, "FedLMD-Tf (50 clients)", fontsize=8.5)
    drawn_points = drawn.get_window_extent(canvas.get_renderer()).width * 72 / fig.dpi
    assert text_width_points("FedLMD-Tf (50 clients)", 8.5) == pytest.approx(drawn_points, rel=0.05)
    assert _legend_columns(["i" * 30] * 6, 6.4) > _legend_columns(["W" * 30] * 6, 6.4)
