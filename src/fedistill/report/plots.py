"""Figures: accuracy curves, the partition heatmap and the class-distribution heatmaps.

Matplotlib without pyplot (no global figure state, safe off a display). Every ``plot_*`` function saves to
the format its path's extension names (``.png``, ``.pdf``, ``.svg``, ...); the ``*_figure`` functions build
the :class:`~matplotlib.figure.Figure` without saving it, for tests and for callers that compose their own.

Length (over the ~500-line guide of ARCHITECTURE.md): every figure of the CLI shares one style, one legend and
one tick helper set; a figure type per file would repeat them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: Raster resolution of saved PNGs (vector formats ignore it).
DPI = 150

# Okabe-Ito colours (distinct under the common colour-vision deficiencies; yellow last, it is faint on
# white). Line style and marker shape change with them, so overlapping curves stay apart in greyscale too.
CURVE_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
CURVE_LINESTYLES = ("-", "--", "-.", ":")
CURVE_MARKERS = ("o", "s", "^", "D", "v", "P", "X")

DIRICHLET_SCHEMES = ("lda", "client_dirichlet")

Band = tuple[Sequence[int], Sequence[float], Sequence[float]]


# --- titles ---------------------------------------------------------------------------------------------


def figure_title(
    dataset: str,
    scheme: str,
    alpha: float | None = None,
    num_clients: int | None = None,
    extra: str | None = None,
    shards_per_client: int | None = None,
) -> str:
    """The title every figure of a run carries, e.g. ``"digits · lda α=0.1 · 20 clients"``.

    ``alpha`` is shown only for the Dirichlet schemes (``lda``, ``client_dirichlet``), the shard count only
    for ``shards``; ``extra`` (an algorithm name) goes first: ``"fedavg · digits · iid · 20 clients"``.
    """
    part = scheme
    if scheme in DIRICHLET_SCHEMES and alpha is not None:
        part = f"{scheme} α={alpha:g}"
    elif scheme == "shards" and shards_per_client is not None:
        part = f"shards ({shards_per_client} per client)"
    clients = None if num_clients is None else f"{num_clients} client{'' if num_clients == 1 else 's'}"
    return " · ".join(str(b) for b in (extra, dataset, part, clients) if b)


def config_title(cfg: Any, extra: str | None = None) -> str:
    """:func:`figure_title` for a :class:`fedistill.config.Config` (its dataset and partition settings)."""
    p = cfg.partition
    return figure_title(cfg.dataset.name, p.scheme, p.alpha, p.num_clients, extra, p.shards_per_client)


# --- common pieces --------------------------------------------------------------------------------------


def _new_figure(width: float, height: float) -> "Figure":
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def figure_format(path: Path | str) -> str:
    """The file format a figure path asks for (its extension; ``png`` without one). Raises
    :class:`~fedistill.errors.ConfigError` for an extension matplotlib cannot write."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(path)
    fmt = path.suffix[1:].lower() or "png"
    supported = FigureCanvasBase.get_supported_filetypes()
    if fmt not in supported:
        from ..errors import ConfigError

        others = ", ".join("." + f for f in sorted(supported) if f not in ("png", "pdf", "svg"))
        raise ConfigError(f"{path}: cannot save a figure as .{fmt}; the extension picks the format: .png, .pdf or .svg (also {others})")
    return fmt


def check_figure_path(flag: str, path: Path | str) -> Path:
    """Refuse, before any work, a figure file that cannot be written: a directory, a missing or unwritable
    parent directory, an extension matplotlib cannot write. Returns the path with ``.png`` added when it has no
    extension (so the curves and their companion heatmaps get the same one)."""
    import os

    from ..errors import ConfigError

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name such as {path / 'figure.png'}")
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    figure_format(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name such as {path / 'figure.png'}")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: directory {parent} is not writable; choose another path")
    return path


def save_figure(fig: "Figure", path: Path | str) -> None:
    """Write ``fig`` in the format of ``path``'s extension. PDF and PS embed TrueType (Type 42) fonts, as
    publishers ask, rather than Type 3."""
    import matplotlib

    fmt = figure_format(path)
    with matplotlib.rc_context({"pdf.fonttype": 42, "ps.fonttype": 42}):
        fig.savefig(path, format=fmt, dpi=DPI)


def accuracy_label(key: str) -> str:
    """The y-axis label of an accuracy curve read from the metric rows under ``key``."""
    return "personalised accuracy (%)" if key == "personal_accuracy" else "test accuracy (%)"


def curve_style(i: int) -> dict[str, Any]:
    """Colour, line style and marker of the i-th curve of a figure (all three change from one to the next)."""
    return {
        "color": CURVE_COLOURS[i % len(CURVE_COLOURS)],
        "linestyle": CURVE_LINESTYLES[i % len(CURVE_LINESTYLES)],
        "marker": CURVE_MARKERS[i % len(CURVE_MARKERS)],
    }


def _markevery(n: int, i: int = 0, of: int = 1) -> Any:
    """Every point of a short curve; about 15 evenly spaced ones of a long curve, staggered between the
    ``of`` curves of a figure so that their markers do not sit on top of each other."""
    if n <= 25:
        return None
    step = int(np.ceil(n / 15))
    return (min((i * step) // max(of, 1), n - 1), step)


def round_axis(ax: "Axes", rounds: Sequence[int]) -> None:
    """A round x axis: integer ticks, and limits half a round (or 2 %) beyond the first and last point, so a
    1-round run shows its point in the middle of the axes."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1, steps=[1, 2, 5, 10]))
    ax.set_xlabel("round")
    if len(rounds):
        lo, hi = min(rounds), max(rounds)
        pad = max(0.5, 0.02 * (hi - lo))
        ax.set_xlim(lo - pad, hi + pad)


def _open_flat_y(ax: "Axes", span: float = 10.0) -> None:
    """A y axis at least ``span`` wide: a 1-round run (one value) or a flat curve sits mid-height with
    round tick values around it, not on a magnified sliver of the axis."""
    y0, y1 = ax.dataLim.intervaly
    if np.isfinite(y0) and np.isfinite(y1) and y1 - y0 < span / 5:
        lo = (y0 + y1 - span) / 2
        if y0 >= 0:  # an accuracy near 0 % or 100 % keeps the axis within [0, 100] (and a little margin)
            lo = max(lo, -span / 20)
        if y1 <= 100:
            lo = min(lo, 100 + span / 20 - span)
        ax.set_ylim(lo, lo + span)


LEGEND_FONT_SIZE = 8.5  # points


def text_width_points(text: str, size: float) -> float:
    """The width of ``text`` set in matplotlib's default font at ``size`` points, in points, as matplotlib measures
    it (its text-to-path layout: no figure or renderer needed, the same at every dpi)."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    width, _, _ = TextToPath().get_text_width_height_descent(text, FontProperties(size=size), ismath=False)
    return float(width)


def _legend_columns(labels: Sequence[str], width: float) -> int:
    """How many legend entries fit side by side in ``width`` inches: each takes the handle and the gaps around it
    (0.75 in) and the widest label's measured text."""
    widest = max((text_width_points(s, LEGEND_FONT_SIZE) for s in labels), default=0.0)
    entry = 0.75 + widest / 72
    return max(1, min(len(labels), int(width // entry)))


def _legend_rows(labels: Sequence[str], width: float) -> int:
    """How many rows the legend under the axes takes (the figure is made that much taller)."""
    return int(np.ceil(len(labels) / _legend_columns(labels, width))) if labels else 0


def _legend_below(fig: "Figure", ax: "Axes") -> None:
    """The legend in its own row(s) under the axes, never over the curves."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ncols = _legend_columns(labels, fig.get_figwidth())
        fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=LEGEND_FONT_SIZE, frameon=False)


# --- accuracy per round ---------------------------------------------------------------------------------


def accuracy_figure(
    curves: Mapping[str, Sequence[tuple[int, float]]],
    target: float | None = None,
    ylabel: str = "test accuracy (%)",
    title: str | None = None,
    bands: Mapping[str, Band] | None = None,
) -> "Figure":
    """One line per run (accuracy against round), each with its own colour, line style and marker; an
    optional shaded band per label (``label -> (rounds, low, high)``, e.g. min-max or mean ± sd over seeds)
    in that line's colour; a dashed target line; the legend under the axes."""
    bands = dict(bands or {})
    labels = list(curves) + [b for b in bands if b not in curves]
    legend = [s for s in curves if curves[s]] + ([f"target {target:g}%"] if target is not None else [])
    width = 6.4
    fig = _new_figure(width, 4.0 + 0.22 * _legend_rows(legend, width) + (0.25 if title else 0))
    ax = fig.add_subplot()
    all_rounds: list[int] = []
    drawn = [s for s in curves if curves[s]]
    for label, (rounds, low, high) in bands.items():
        style = curve_style(labels.index(label))
        rounds = list(rounds)
        all_rounds += rounds
        if len(rounds) == 1:  # a band over one round has no width: draw it as an error bar
            ax.vlines(rounds, low, high, color=style["color"], alpha=0.35, linewidth=4, zorder=1.5)
        else:
            ax.fill_between(rounds, low, high, color=style["color"], alpha=0.2, linewidth=0, zorder=1.5)
    for label, points in curves.items():
        if not points:
            continue
        rounds, acc = zip(*points)
        all_rounds += rounds
        i = labels.index(label)
        ax.plot(
            rounds, acc, label=label, linewidth=1.5, markersize=4 if len(rounds) <= 25 else 4.5,
            markevery=_markevery(len(rounds), drawn.index(label), len(drawn)), zorder=2.5, **curve_style(i),
            markerfacecolor="none" if drawn.index(label) % 2 else None,  # open markers show a curve on top of another
        )  # fmt: skip
    if target is not None:
        ax.axhline(target, color="0.4", linestyle=(0, (5, 3)), linewidth=1, label=f"target {target:g}%", zorder=1)
    round_axis(ax, all_rounds)
    _open_flat_y(ax)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    _legend_below(fig, ax)
    return fig


def plot_accuracy(
    curves: dict[str, Sequence[tuple[int, float]]],
    path: Path,
    target: float | None = None,
    ylabel: str = "test accuracy (%)",
    title: str | None = None,
    bands: dict[str, Band] | None = None,
) -> None:
    """One line per run: accuracy (%) against round (the global model's, or the personalised mean); see
    :func:`accuracy_figure`. The format follows ``path``'s extension."""
    save_figure(accuracy_figure(curves, target, ylabel, title, bands), path)


def personal_accuracy_figure(history: Sequence[dict], label: str = "", title: str | None = None) -> "Figure | None":
    """Personalised accuracy against round: the clients' mean, median, quartile band and min-max band
    (None when the run has no personalised accuracy)."""
    rows = [r for r in history if r.get("personal_accuracy") is not None]
    if not rows:
        return None
    width = 6.4
    legend = ["min-max over clients", "quartiles", "median", f"{label} mean over clients"]
    fig = _new_figure(width, 4.0 + 0.22 * _legend_rows(legend, width) + (0.25 if title else 0))
    ax = fig.add_subplot()
    rounds = [r["round"] for r in rows]
    colour = CURVE_COLOURS[0]
    n = len(rounds)
    spans = ((("personal_min", "personal_max"), 0.13, legend[0]), (("personal_q1", "personal_q3"), 0.3, legend[1]))
    for (low, high), alpha, name in spans:
        lows, highs = [r[low] for r in rows], [r[high] for r in rows]
        if n == 1:  # a band over one round has no width: a bar instead
            ax.vlines(rounds, lows, highs, color=colour, alpha=alpha + 0.1, linewidth=8, label=name)
        else:
            ax.fill_between(rounds, lows, highs, color=colour, alpha=alpha, linewidth=0, label=name)
    ax.plot(
        rounds, [r["personal_median"] for r in rows], color="0.25", linewidth=1, linestyle=":", marker="_",
        markersize=6, markevery=_markevery(n), label="median",
    )  # fmt: skip
    ax.plot(
        rounds, [r["personal_accuracy"] for r in rows], color=colour, linewidth=1.6, marker="o", markersize=4,
        markevery=_markevery(n), label=f"{label} mean over clients".strip(),
    )  # fmt: skip
    round_axis(ax, rounds)
    _open_flat_y(ax)
    ax.set_ylabel("personalised accuracy (%)")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    _legend_below(fig, ax)
    return fig


def plot_personal_accuracy(history: Sequence[dict], path: Path, label: str = "", title: str | None = None) -> bool:
    """Personalised accuracy against round: the clients' mean, their quartile band and min-max band.

    Returns False (and writes nothing) when the run has no personalised accuracy.
    """
    fig = personal_accuracy_figure(history, label, title)
    if fig is None:
        return False
    save_figure(fig, path)
    return True


# --- the partition ----------------------------------------------------------------------------------------


def partition_matrix(counts: np.ndarray, percent: bool = False) -> np.ma.MaskedArray:
    """The clients x classes values a partition heatmap shows: sample counts, or with ``percent`` each
    client's row as a percentage of that client's samples (rows sum to 100). Zero cells are masked, so
    they are drawn in the "bad" colour (white) and never confused with a small count."""
    counts = np.asarray(counts, dtype=float)
    values = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1) * 100.0 if percent else counts
    return np.ma.masked_where(counts <= 0, values)


def _log_norm(values: np.ma.MaskedArray, percent: bool):
    from matplotlib.colors import LogNorm

    positive = values.compressed()
    if percent:
        low = float(positive.min()) if positive.size else 1.0
        decade = 10 ** np.floor(np.log10(low))
        nice = max(m * decade for m in (1, 2, 5) if m * decade <= low)  # 7.1 % -> 5 %
        return LogNorm(vmin=min(nice, 50.0), vmax=100.0)
    high = float(positive.max()) if positive.size else 10.0
    return LogNorm(vmin=1.0, vmax=max(high, 2.0))  # 1: the smallest count a cell can hold


def partition_figure(counts: np.ndarray, title: str = "", percent: bool = False) -> "Figure":
    """The partition as a heatmap, clients along the x axis and classes down the y axis, with each client's
    number of samples as bars above it. The colour scale is logarithmic so that a class with 3 samples is
    as visible as one with 300, zero cells are white, and ``percent`` colours each client's row as a
    percentage of its samples. Small matrices (at most 20 x 20) print the value in each cell. The figure
    grows with the number of clients and classes up to 12 x 7.9 inches."""
    from matplotlib import colormaps
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator

    counts = np.asarray(counts)
    k, c = counts.shape
    values = partition_matrix(counts, percent)
    heat_h = float(np.clip(0.26 * c, 1.6, 5.5))
    width = float(np.clip(3.0 + 0.075 * k, 6.4, 12.0))
    sizes = counts.sum(axis=1)
    equal = k > 1 and sizes.min() == sizes.max()  # a solid block of equal bars says less than one line
    bar_h = 0.3 if equal else 1.1
    fig = _new_figure(width, heat_h + bar_h + 1.3)
    grid = fig.add_gridspec(2, 2, height_ratios=(bar_h, heat_h), width_ratios=(1, 0.025))
    ax_bar = fig.add_subplot(grid[0, 0])
    ax = fig.add_subplot(grid[1, 0], sharex=ax_bar)
    cax = fig.add_subplot(grid[1, 1])

    cmap = colormaps["viridis"].with_extremes(bad="white")
    norm = _log_norm(values, percent)
    im = ax.imshow(values.T, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    ax_bar.set_xlim(-0.5, k - 0.5)
    if equal:
        ax_bar.text(
            0.5, 0.5, f"every client: {int(sizes[0])} samples", transform=ax_bar.transAxes, ha="center", va="center", fontsize=9
        )  # fmt: skip
        ax_bar.tick_params(left=False, labelleft=False, bottom=False, labelbottom=False)
        for side in ("left", "bottom"):
            ax_bar.spines[side].set_visible(False)
    else:
        if k <= 300:
            ax_bar.bar(np.arange(k), sizes, width=0.8, color="0.45", linewidth=0)
        else:  # one step outline instead of k bar patches: 10,000 bars took 6 s to draw
            ax_bar.fill_between(np.arange(k), sizes, step="mid", color="0.45", linewidth=0)
        ax_bar.set_ylabel("samples")
        ax_bar.tick_params(labelbottom=False)
        ax_bar.yaxis.set_major_locator(MaxNLocator(nbins=3, integer=True))
        ax_bar.grid(axis="y", alpha=0.3)
    ax_bar.set_title(title or f"{k} clients × {c} classes", fontsize=10)
    for side in ("top", "right"):
        ax_bar.spines[side].set_visible(False)

    ax.set_xlabel("client")
    ax.set_ylabel("class")
    if k <= 30:
        ax.set_xticks(range(k))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=min(12, int(width * 1.6)), integer=True))
    if c <= 20:
        ax.set_yticks(range(c))
    else:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=8)
    if k <= 20 and c <= 20:
        for (i, j), v in np.ndenumerate(values.filled(0)):
            if v > 0:
                r, g, b, _ = cmap(norm(v))
                ink = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
                ax.text(i, j, f"{v:.0f}" if v >= 1 else f"{v:.1f}", ha="center", va="center", fontsize=6.5 if k > 12 else 7, color=ink)

    unit = "%" if percent else ""
    bar = fig.colorbar(im, cax=cax)
    bar.ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 1, 2, 5, 10, 20, 50, ...
    bar.ax.yaxis.set_minor_locator(NullLocator())
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}{unit}"))
    bar.ax.tick_params(labelsize=8)
    what = "% of the client's samples" if percent else "samples"
    bar.set_label(f"{what} (log scale; white: none)", fontsize=9)
    return fig


def plot_partition(counts: np.ndarray, path: Path, title: str = "", percent: bool = False) -> None:
    """Client x class sample counts as a heatmap (see :func:`partition_figure`); the format follows
    ``path``'s extension."""
    save_figure(partition_figure(counts, title, percent), path)


# --- class distributions per round ---------------------------------------------------------------------


def class_distribution_matrices(history: Sequence[dict]) -> dict[str, tuple[list[int], np.ndarray]]:
    """Per kind (training labels of the round's clients, test predictions of the global model): the rounds
    that have it and a rounds x classes matrix of proportions (each row sums to 1)."""
    out = {}
    for kind, key in (("training labels of the round's clients", "train_label_counts"), ("global model's test predictions", "prediction_counts")):
        rows = [(r["round"], r[key]) for r in history if r.get(key) is not None]
        if rows:
            counts = np.array([c for _, c in rows], dtype=float)
            out[kind] = ([rnd for rnd, _ in rows], counts / np.maximum(counts.sum(axis=1, keepdims=True), 1))
    return out


def _share_norm(num_classes: int):
    """The colour scale of class shares (%): logarithmic and symmetric about the uniform share u = 100/C,
    from u/C to 100 %, so that "twice uniform" and "half uniform" are equally strong red and blue."""
    from matplotlib.colors import LogNorm

    uniform = 100.0 / num_classes
    return LogNorm(vmin=uniform / num_classes, vmax=100.0) if num_classes > 1 else LogNorm(vmin=10.0, vmax=100.0)


def _share_ticks(num_classes: int) -> list[float]:
    uniform = 100.0 / num_classes
    low = uniform / num_classes if num_classes > 1 else 10.0
    decades = [10.0**e for e in range(int(np.floor(np.log10(low))), 3) if low <= 10.0**e <= 100.0]
    return sorted({round(v, 10) for v in (*decades, low, uniform / 2, uniform, 2 * uniform, 100.0) if low <= v <= 100.0})


def class_distributions_figure(runs: Mapping[str, Sequence[dict]], title: str | None = None) -> "Figure | None":
    """FedLMD Fig. 2: for each run, two heatmaps (rounds x classes) of the class distribution of the round's
    training labels and of the global model's test predictions, as % of the round. One diverging colour
    scale for all panels (:func:`_share_norm`): white at the uniform share 100/C %, red above it, blue
    below it, darkest blue for a class the round does not have at all. None when no run has the data."""
    from matplotlib import colormaps
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

    panels = {name: class_distribution_matrices(history) for name, history in runs.items()}
    panels = {name: p for name, p in panels.items() if p}
    if not panels:
        return None
    kinds = sorted({k for p in panels.values() for k in p}, reverse=True)  # training labels first
    num_classes = max(share.shape[1] for p in panels.values() for _, share in p.values())
    most_rounds = max(len(rounds) for p in panels.values() for rounds, _ in p.values())
    uniform = 100.0 / num_classes
    norm = _share_norm(num_classes)
    base = colormaps["RdBu_r"]
    cmap = base.with_extremes(bad=base(0.0), under=base(0.0), over=base(1.0))  # 0 % is "as rare as can be"

    panel_h = float(np.clip(1.3 + 0.03 * most_rounds, 2.0, 4.0))
    fig = _new_figure(3.9 * len(kinds) + 1.4, 0.3 + (panel_h + 0.6) * len(panels) + (0.3 if title else 0))
    axes = fig.subplots(len(panels), len(kinds), squeeze=False)
    im = None
    for i, (name, matrices) in enumerate(panels.items()):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            if kind not in matrices:
                ax.set_axis_off()
                continue
            rounds, share = matrices[kind]
            im = ax.imshow(
                np.ma.masked_less_equal(share * 100, 0), aspect="auto", cmap=cmap, norm=norm, interpolation="nearest",
                extent=(-0.5, share.shape[1] - 0.5, rounds[-1] + 0.5, rounds[0] - 0.5),
            )  # fmt: skip
            ax.set_title(f"{name}\n{kind}", fontsize=9)
            ax.set_xlabel("class")
            ax.set_ylabel("round")
            ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
            if share.shape[1] <= 20:
                ax.set_xticks(range(share.shape[1]))
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.tick_params(labelsize=8)
    assert im is not None
    bar = fig.colorbar(im, ax=axes, aspect=max(12, 20 * len(panels)), extend="neither")
    bar.ax.yaxis.set_major_locator(FixedLocator(_share_ticks(num_classes)))
    bar.ax.yaxis.set_minor_locator(NullLocator())

    def tick(v: float, _: Any) -> str:
        return ("≤ " if np.isclose(v, norm.vmin) else "") + f"{v:.3g}%" + (" uniform" if np.isclose(v, uniform) else "")

    bar.ax.yaxis.set_major_formatter(FuncFormatter(tick))
    bar.ax.tick_params(labelsize=8)
    bar.set_label(f"share of the round (log scale; uniform = 1/{num_classes})", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_class_distributions(runs: dict[str, Sequence[dict]], path: Path, title: str | None = None) -> bool:
    """FedLMD Fig. 2 (see :func:`class_distributions_figure`); the format follows ``path``'s extension.
    Returns False (and writes nothing) if no run has the data."""
    fig = class_distributions_figure(runs, title)
    if fig is None:
        return False
    save_figure(fig, path)
    return True
