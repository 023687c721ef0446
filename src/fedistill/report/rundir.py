"""The run directory (DESIGN.md "What the user sees").

``config.yaml`` (resolved), ``metrics.jsonl`` (one line per round, appended and flushed as rounds finish,
so nothing is lost if a run dies), ``metrics.csv``, ``summary.json``, ``partition_counts.csv``,
``accuracy.png``, ``partition.png`` and ``checkpoint.pt``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import yaml

from ..errors import ConfigError

METRIC_COLUMNS = [
    "round", "lr", "clients", "train_loss", "test_accuracy", "test_loss", "bytes_down", "bytes_up",
    "train_seconds", "eval_seconds", "seconds",
]


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDirectory:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, out_dir: str | Path, name: str | None, default_name: str) -> "RunDirectory":
        name = name or f"{default_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        path = Path(out_dir) / name
        if path.exists() and any(path.iterdir()):
            raise ConfigError(
                f"run.name: run directory {path} already exists; choose another --name, or continue it with --resume {path}"
            )
        path.mkdir(parents=True, exist_ok=True)
        return cls(path)

    # ------------------------------------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> None:
        _atomic_write(self.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))

    def read_config(self) -> dict[str, Any]:
        path = self.path / "config.yaml"
        if not path.is_file():
            raise ConfigError(f"--resume: {self.path} is not a run directory (no config.yaml)")
        return yaml.safe_load(path.read_text()) or {}

    def append_metrics(self, row: dict[str, Any]) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
            f.flush()

    def rewrite_metrics(self, history: Iterable[dict[str, Any]]) -> None:
        lines = "".join(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n" for row in history)
        _atomic_write(self.path / "metrics.jsonl", lines)

    def write_csv(self, history: list[dict[str, Any]]) -> None:
        # Per-class lists (the class-distribution diagnostic) go to class_distributions.csv instead.
        extra = sorted({k for row in history for k, v in row.items() if not isinstance(v, list)} - set(METRIC_COLUMNS))
        columns = METRIC_COLUMNS + extra
        tmp = self.path / "metrics.csv.tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            for row in history:
                writer.writerow({k: ("" if row.get(k) is None else _clean(row.get(k))) for k in columns})
        os.replace(tmp, self.path / "metrics.csv")
        self.write_class_distributions(history)

    def write_class_distributions(self, history: list[dict[str, Any]]) -> None:
        """``class_distributions.csv``: per round, the training labels of the round's clients and the global
        model's test predictions, one row each, as counts per class (FedLMD Fig. 2)."""
        rows = [
            (r["round"], kind, r[key])
            for r in history
            for kind, key in (("train_labels", "train_label_counts"), ("predictions", "prediction_counts"))
            if r.get(key) is not None
        ]
        if not rows:
            return
        classes = len(rows[0][2])
        header = "round,kind," + ",".join(f"class_{c}" for c in range(classes)) + "\n"
        body = "".join(f"{rnd},{kind}," + ",".join(str(int(v)) for v in counts) + "\n" for rnd, kind, counts in rows)
        _atomic_write(self.path / "class_distributions.csv", header + body)

    def write_summary(self, summary: dict[str, Any]) -> None:
        _atomic_write(self.path / "summary.json", json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2) + "\n")

    def write_partition(self, counts: np.ndarray) -> None:
        header = "client," + ",".join(f"class_{c}" for c in range(counts.shape[1])) + ",total\n"
        body = "".join(f"{k}," + ",".join(str(int(v)) for v in row) + f",{int(row.sum())}\n" for k, row in enumerate(counts))
        _atomic_write(self.path / "partition_counts.csv", header + body)


def read_run(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """(config, metric rows, summary) of a finished or interrupted run directory."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"{path} is not a run directory: metrics.jsonl is missing")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    config = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else {}
    summary_path = path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return config or {}, rows, summary
