"""The run directory (DESIGN.md "What the user sees").

``config.yaml`` (resolved), ``metrics.jsonl`` (one line per round, appended and flushed as rounds finish,
so nothing is lost if a run dies), ``metrics.csv``, ``summary.json``, ``partition_counts.csv``,
``accuracy.png``, ``partition.png`` and ``checkpoint.pt``.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import yaml

from ..errors import ConfigError
from ..fileio import atomic_open, atomic_write, remove_temporaries

METRIC_COLUMNS = [
    "round", "lr", "clients", "train_loss", "test_accuracy", "test_loss", "personal_accuracy", "personal_min",
    "personal_q1", "personal_median", "personal_q3", "personal_max", "personal_pooled_accuracy", "bytes_down", "bytes_up",
    "bytes_weight_exchange", "train_seconds", "server_seconds", "eval_seconds", "seconds",
]


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunDirectory:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @staticmethod
    def location(out_dir: str | Path, name: str | None, default_name: str) -> Path:
        """Where ``create`` would put the run, checked without writing anything (one-line errors)."""
        name = name or f"{default_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        check_run_name(name)
        parent = Path(out_dir)
        for ancestor in (parent, *parent.parents):
            if ancestor.exists():
                if not ancestor.is_dir():
                    raise ConfigError(f"run.out_dir: {ancestor} is a file, not a directory; choose another --out")
                break
        path = parent / name
        if path.exists() and not path.is_dir():
            raise ConfigError(f"run.name: {path} is a file, not a run directory; choose another --name")
        return path

    @classmethod
    def create(
        cls, out_dir: str | Path, name: str | None, default_name: str, continue_hint: str | None = None
    ) -> "RunDirectory":
        """A new run directory ``out_dir/name``; an existing non-empty one is refused.

        ``continue_hint`` is what to type to continue the existing run where the message is shown (the
        CLI's ``--resume DIR``, or Flower's run-config keys).
        """
        path = cls.location(out_dir, name, default_name)
        if path.exists() and any(path.iterdir()):
            hint = continue_hint or f"fedistill run --resume {path}"
            raise ConfigError(f"run.name: run directory {path} already exists; choose another name, or continue it with {hint}")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"run.out_dir: cannot create {path} ({exc.strerror}); choose another --out") from None
        return cls(path)

    # ------------------------------------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write(self.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))

    def read_config(self) -> dict[str, Any]:
        """The run's saved configuration (a mapping); one-line errors naming the file otherwise."""
        if not self.path.is_dir():
            raise ConfigError(f"resume: {self.path} is not a directory (give a run directory made by fedistill run)")
        path = self.path / "config.yaml"
        if not path.is_file():
            raise ConfigError(f"resume: {self.path} is not a run directory (no config.yaml)")
        from ..config import parse_yaml_text, with_saved_defaults

        return with_saved_defaults(parse_yaml_text(path, _read_text(path), what=f"{path}"))

    def begin_resume(self, history: list[dict[str, Any]], restored: bool, rounds: int, changes: list[str]) -> str:
        """Make the directory match the restored state before a resumed run goes on; returns a note to print.

        Rows written after the checkpoint belong to rounds that run again (all rows, without a checkpoint);
        the previous attempt's ``summary.json`` goes, since this attempt writes its own (a missing summary
        means the run is not finished); allowed result-changing settings are recorded. Temporary files of writes
        the previous attempt was killed in the middle of (checkpoint, metrics; :mod:`fedistill.fileio`) go too.
        """
        remove_temporaries(self.path)
        done = len(history) and int(history[-1]["round"])
        if changes:
            self.record_resume(done, changes)
        self.rewrite_metrics(history)
        (self.path / "summary.json").unlink(missing_ok=True)
        if not restored:
            return " (it has no checkpoint yet: starting it from round 1 with its saved configuration)"
        if done == rounds:
            return f" (all {done} rounds are done: only its summary is written again)"
        return f" (resuming after round {done})"

    def record_resume(self, round_: int, changes: list[str]) -> None:
        """``resumes.jsonl``: each resume that was allowed to change a result-changing setting."""
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "after_round": round_, "changed": changes}
        with open(self.path / "resumes.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def append_metrics(self, row: dict[str, Any]) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
            f.flush()

    def rewrite_metrics(self, history: Iterable[dict[str, Any]]) -> None:
        lines = "".join(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n" for row in history)
        atomic_write(self.path / "metrics.jsonl", lines)

    def write_csv(self, history: list[dict[str, Any]]) -> None:
        # Per-class lists (the class-distribution diagnostic) go to class_distributions.csv instead.
        extra = sorted({k for row in history for k, v in row.items() if not isinstance(v, list)} - set(METRIC_COLUMNS))
        columns = METRIC_COLUMNS + extra
        with atomic_open(self.path / "metrics.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            for row in history:
                writer.writerow({k: ("" if row.get(k) is None else _clean(row.get(k))) for k in columns})
        self.write_class_distributions(history)
        self.write_personal_accuracies(history)

    def write_personal_accuracies(self, history: list[dict[str, Any]]) -> None:
        """``personal_accuracy.csv``: every client's own accuracy (%) in every evaluated round (long format)."""
        body = "".join(
            f"{r['round']},{cid},{acc!r}\n"
            for r in history
            if r.get("personal_clients") is not None
            for cid, acc in zip(r["personal_clients"], r["personal_accuracies"])
        )
        if body:
            atomic_write(self.path / "personal_accuracy.csv", "round,client,accuracy\n" + body)

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
        atomic_write(self.path / "class_distributions.csv", header + body)

    def write_environment(self, info: dict[str, Any]) -> None:
        atomic_write(self.path / "environment.json", json.dumps({k: _clean(v) for k, v in info.items()}, indent=2) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.path / "summary.json", json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2) + "\n")

    def write_partition(self, counts: np.ndarray) -> None:
        header = "client," + ",".join(f"class_{c}" for c in range(counts.shape[1])) + ",total\n"
        body = "".join(f"{k}," + ",".join(str(int(v)) for v in row) + f",{int(row.sum())}\n" for k, row in enumerate(counts))
        atomic_write(self.path / "partition_counts.csv", header + body)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file (it holds binary data)") from None


def check_run_name(name: str) -> None:
    from ..config import check_run_name as check

    try:
        check(name)
    except ValueError as exc:
        raise ConfigError(f"run.name: {exc}") from None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``; a last line cut short by a killed run is skipped (a damaged line
    elsewhere is an error naming the file and line)."""
    lines = _read_text(path).splitlines()
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # half-written by a process that died mid-write: not a result
                break
            raise ConfigError(f"{path}: line {number} is not valid JSON; the file is damaged") from None
        if not isinstance(row, dict) or "round" not in row:
            raise ConfigError(f"{path}: line {number} is not a metrics row; the file is damaged")
        rows.append(row)
    return rows


def read_run(path: str | Path, require_metrics: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """(config, metric rows, summary) of a finished or interrupted run directory."""
    from ..config import parse_yaml_text

    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file() and require_metrics:
        raise ConfigError(f"{path} is not a run directory: metrics.jsonl is missing")
    rows = read_metrics(metrics) if metrics.is_file() else []
    config_path = path / "config.yaml"
    config = parse_yaml_text(config_path, _read_text(config_path), what=str(config_path)) if config_path.is_file() else {}
    summary_path = path / "summary.json"
    summary: dict[str, Any] = {}
    if summary_path.is_file():
        try:
            summary = json.loads(_read_text(summary_path))
        except json.JSONDecodeError:
            summary = {}  # rewritten atomically, so only a foreign edit damages it: treat as unfinished
    return config, rows, summary if isinstance(summary, dict) else {}
