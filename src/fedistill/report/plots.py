"""PNG plots: accuracy curves and the partition heatmap (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def accuracy_label(key: str) -> str:
    """The y-axis label of an accuracy curve read from the metric rows under ``key``."""
    return "personalised accuracy (%)" if key == "personal_accuracy" else "test accuracy (%)"


def _save_per_round(plt, fig, ax, path: Path, ylabel: str) -> None:
    """The common ending of the per-round plots: axes labels, grid, legend, file."""
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_accuracy(
    curves: dict[str, Sequence[tuple[int, float]]],
    path: Path,
    target: float | None = None,
    ylabel: str = "test accuracy (%)",
) -> None:
    """One line per run: accuracy (%) against round (the global model's, or the personalised mean)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for label, points in curves.items():
        if points:
            rounds, acc = zip(*points)
            ax.plot(rounds, acc, label=label, linewidth=1.5)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}%")
    _save_per_round(plt, fig, ax, path, ylabel)


def plot_personal_accuracy(history: Sequence[dict], path: Path, label: str = "") -> bool:
    """Personalised accuracy against round: the clients' mean, their quartile band and min-max band.

    Returns False (and writes nothing) when the run has no personalised accuracy.
    """
    rows = [r for r in history if r.get("personal_accuracy") is not None]
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    rounds = [r["round"] for r in rows]
    ax.fill_between(rounds, [r["personal_min"] for r in rows], [r["personal_max"] for r in rows], alpha=0.15, label="min-max")
    ax.fill_between(rounds, [r["personal_q1"] for r in rows], [r["personal_q3"] for r in rows], alpha=0.3, label="quartiles")
    ax.plot(rounds, [r["personal_median"] for r in rows], linewidth=1, linestyle=":", label="median")
    ax.plot(rounds, [r["personal_accuracy"] for r in rows], linewidth=1.5, label=f"{label} mean over clients".strip())
    _save_per_round(plt, fig, ax, path, "personalised accuracy (%)")
    return True


def plot_partition(counts: np.ndarray, path: Path, title: str = "") -> None:
    """Client x class sample counts as a heatmap (clients on the y axis)."""
    plt = _pyplot()
    k, c = counts.shape
    fig, ax = plt.subplots(figsize=(min(2 + 0.45 * c, 14), min(1.5 + 0.12 * k, 14)), dpi=120)
    im = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # client ids, never 2.5
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if c <= 20:
        ax.set_xticks(range(c))
    ax.set_title(title or f"{k} clients x {c} classes")
    fig.colorbar(im, ax=ax, label="samples")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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


def plot_class_distributions(runs: dict[str, Sequence[dict]], path: Path) -> bool:
    """FedLMD Fig. 2: for each run, two heatmaps (rounds x classes) of the class distribution of the round's
    training labels and of the global model's test predictions. Returns False if no run has the data."""
    panels = {name: class_distribution_matrices(history) for name, history in runs.items()}
    panels = {name: p for name, p in panels.items() if p}
    if not panels:
        return False
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    kinds = sorted({k for p in panels.values() for k in p}, reverse=True)  # training labels first
    fig, axes = plt.subplots(
        len(panels), len(kinds), figsize=(5.0 * len(kinds), 0.6 + 3.2 * len(panels)), dpi=110, squeeze=False
    )
    for i, (name, matrices) in enumerate(panels.items()):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            if kind not in matrices:
                ax.set_axis_off()
                continue
            rounds, share = matrices[kind]
            im = ax.imshow(
                share, aspect="auto", cmap="magma", vmin=0, vmax=1, interpolation="nearest",
                extent=(-0.5, share.shape[1] - 0.5, rounds[-1] + 0.5, rounds[0] - 0.5),
            )  # fmt: skip
            ax.set_title(f"{name}: {kind}", fontsize=8)
            ax.set_xlabel("class")
            ax.set_ylabel("round")
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            if share.shape[1] <= 20:
                ax.set_xticks(range(share.shape[1]))
            fig.colorbar(im, ax=ax, label="share of the round")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
