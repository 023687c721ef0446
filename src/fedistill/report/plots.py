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


def plot_accuracy(curves: dict[str, Sequence[tuple[int, float]]], path: Path, target: float | None = None) -> None:
    """One line per run: test accuracy (%) against round."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for label, points in curves.items():
        if points:
            rounds, acc = zip(*points)
            ax.plot(rounds, acc, label=label, linewidth=1.5)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}%")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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
