"""Seed groups: one run directory per seed under a group directory, and the group summary.

``fedistill run --seeds 0 1 2`` writes ``<run.out_dir>/<name>/seed0/``, ``seed1/``, ... (each an ordinary
run directory) and, after every finished seed, ``group.json`` and ``group.md`` in the group directory: each
seed's final and best accuracy, best round, rounds to target and seconds, and their mean and sample standard
deviation over the seeds (ddof=1; null with one seed). Rounds to target is averaged over the seeds that
reached the target, and ``reached`` says how many did ("2/3").

Everything here is a pure function of summaries (``summary.json`` dicts) or reads and writes files; the runs
themselves are made by :func:`fedistill.runner.run_seed_group`.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import ConfigError
from ..fileio import atomic_write
from .rundir import _clean
from .tables import Column, markdown_table

GROUP_JSON = "group.json"
GROUP_MD = "group.md"

# Per-seed fields copied from each run's summary into the group summary.
SEED_FIELDS = ("rounds", "final_accuracy", "best_accuracy", "best_round", "rounds_to_target", "seconds", "bytes_down", "bytes_up")
# Fields with a mean and standard deviation over the seeds.
STAT_FIELDS = ("final_accuracy", "best_accuracy", "best_round", "rounds_to_target", "seconds", "bytes_down", "bytes_up")


def check_seeds(seeds: Sequence[int]) -> list[int]:
    """The seeds of a group, in the order given; an empty list or a repeated seed is a one-line error."""
    seeds = list(seeds)
    if not seeds:
        raise ConfigError("--seeds: give at least one seed, e.g. --seeds 0 1 2")
    for s in seeds:
        if seeds.count(s) > 1:
            raise ConfigError(f"--seeds: seed {s} is given {seeds.count(s)} times; each seed runs once")
    return seeds


def seed_dir_name(seed: int) -> str:
    return f"seed{seed}"


def stat(values: Iterable[float | None]) -> dict[str, Any]:
    """Mean and sample standard deviation (ddof=1) of the values that are not None; ``n`` counts them. The
    standard deviation is None with fewer than two values, the mean with none."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return {
        "mean": statistics.fmean(xs) if xs else None,
        "std": statistics.stdev(xs) if len(xs) > 1 else None,
        "n": len(xs),
    }


def _counted(summary: dict[str, Any]) -> bool:
    """A seed enters the statistics unless its run diverged (a run without a status, e.g. a summary
    recomputed from metrics.jsonl, counts)."""
    return summary.get("status", "finished") != "diverged"


def group_summary(summaries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The group summary of per-seed run summaries (``{seed: summary.json}``).

    ``seeds`` lists each seed's own numbers (and its run directory's name, from the summary's ``run_dir``);
    each of :data:`STAT_FIELDS` gets ``{"mean", "std", "n"}`` over the seeds whose run did not diverge.
    ``rounds_to_target`` is over the seeds that reached the target, and ``reached`` is ``"k/n"`` (null when
    the runs had no target).
    """
    entries = []
    for seed, s in summaries.items():
        entry: dict[str, Any] = {"seed": seed}
        run_dir = s.get("run_dir")
        entry["dir"] = Path(run_dir).name if run_dir else seed_dir_name(seed)
        entry["status"] = s.get("status")
        entry.update({k: s.get(k) for k in SEED_FIELDS})
        entries.append(entry)
    counted = [e for e, s in zip(entries, summaries.values()) if _counted(s)]
    targets = {s.get("target_accuracy") for s in summaries.values()}
    metrics = {s.get("accuracy_metric") for s in summaries.values()} - {None}
    target = targets.pop() if len(targets) == 1 else None
    group: dict[str, Any] = {
        "seeds": [e["seed"] for e in entries],
        "accuracy_metric": metrics.pop() if len(metrics) == 1 else None,
        "target_accuracy": target,
        "counted": f"{len(counted)}/{len(entries)}",
    }
    for name in STAT_FIELDS:
        group[name] = stat(e[name] for e in counted)
    reached = sum(1 for e in counted if e["rounds_to_target"] is not None)
    group["rounds_to_target"]["reached"] = f"{reached}/{len(counted)}" if target is not None else None
    group["runs"] = entries
    return group


NO_STD = "n/a"
"""How a table shows a standard deviation that is undefined (one seed): the data holds None (:func:`stat`), never 0."""


def format_stat(value: dict[str, Any] | None, spec: str = ".2f") -> str:
    """``91.23 ± 0.41``; ``91.23 ± n/a`` when the standard deviation is undefined (one seed, None in the data);
    ``-`` without a mean."""
    if not value or value.get("mean") is None:
        return "-"
    std = value.get("std")
    return f"{format(value['mean'], spec)} ± {NO_STD if std is None else format(std, spec)}"


def format_to_target(group: dict[str, Any]) -> str:
    """Rounds to target over the seeds that reached it, and how many did: ``12.5 ± 2.1 (2/3)``."""
    rtt = group.get("rounds_to_target") or {}
    if rtt.get("reached") is None:
        return "-"
    if rtt.get("mean") is None:
        return f"not reached ({rtt['reached']})"
    return f"{format_stat(rtt, '.1f')} ({rtt['reached']})"


def _cell(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float) else str(value)


def group_markdown(group: dict[str, Any], title: str = "") -> str:
    """``group.md``: one row per seed, then the mean ± std row (report/tables.py writes the table)."""
    metric = group.get("accuracy_metric") or "global"
    target = group.get("target_accuracy")
    lines = [
        f"# {title or 'seed group'}",
        "",
        f"{len(group['runs'])} seeds ({', '.join(str(s) for s in group['seeds'])}); {metric} accuracy in percent; "
        + (f"target {target:g}%" if target is not None else "no target accuracy")
        + "; mean ± sample standard deviation (ddof=1) over the seeds whose run did not diverge "
        + f"({group['counted']}); rounds to target over the seeds that reached it.",
        "",
    ]
    columns = [Column("seed"), Column("run"), Column("status")] + [
        Column(title, align="right") for title in ("final acc %", "best acc %", "best round", "to target", "seconds")
    ]
    rows = []
    for e in group["runs"]:
        to_target = "-" if target is None else (str(e["rounds_to_target"]) if e["rounds_to_target"] is not None else "not reached")
        rows.append([e["seed"], e["dir"], e["status"] or "-", _cell(e["final_accuracy"]), _cell(e["best_accuracy"]),
                     _cell(e["best_round"]), to_target, _cell(e["seconds"], ".1f")])  # fmt: skip
    rows.append(["mean ± std", "", "", format_stat(group["final_accuracy"]), format_stat(group["best_accuracy"]),
                 format_stat(group["best_round"], ".1f"), format_to_target(group), format_stat(group["seconds"], ".1f")])  # fmt: skip
    lines.append(markdown_table(columns, rows))
    return "\n".join(lines) + "\n"


def write_group(path: Path, group: dict[str, Any], title: str = "") -> None:
    """``group.json`` and ``group.md`` in the group directory (each replaced atomically)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / GROUP_JSON, json.dumps(_clean_tree(group), indent=2) + "\n")
    atomic_write(path / GROUP_MD, group_markdown(group, title or path.name))


def _clean_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clean_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean_tree(v) for v in value]
    return _clean(value)


def read_group(path: Path) -> dict[str, Any]:
    """A group directory's ``group.json``; a one-line error if it is missing or damaged."""
    file = Path(path) / GROUP_JSON
    try:
        group = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is not a seed group: {GROUP_JSON} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{file} is not valid JSON; the file is damaged") from None
    if not isinstance(group, dict):
        raise ConfigError(f"{file} is not a group summary; the file is damaged")
    return group


def _member_key(path: Path) -> tuple[int, int | str]:
    match = re.fullmatch(r"seed(\d+)", path.name)
    return (0, int(match.group(1))) if match else (1, path.name)


def group_members(path: Path) -> list[Path] | None:
    """The run directories of a group directory, ``seed0``, ``seed1``, ... in seed order (then other names),
    or None if ``path`` is not a group: a group holds ``group.json`` or, without a ``metrics.jsonl`` of its
    own, subdirectories that do (a group whose first seed is still running). A run that has not written a
    round yet is left out."""
    path = Path(path)
    if not path.is_dir() or (path / "metrics.jsonl").exists():
        return None
    members = sorted((p for p in path.iterdir() if p.is_dir() and (p / "metrics.jsonl").is_file()), key=_member_key)
    if (path / GROUP_JSON).is_file():
        if not members:
            raise ConfigError(f"{path}: a seed group without run directories (no seedN/ holding metrics.jsonl)")
        return members
    return members or None


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> tuple[list[int], list[float], list[float] | None]:
    """Per round, the mean and sample standard deviation of several seeds' accuracy curves, over only the rounds
    that every curve has. One curve has no standard deviation (None, as :func:`stat` says it: no band to draw)."""
    if not curves:
        return [], [], []
    common = set.intersection(*({r for r, _ in c} for c in curves))
    rounds = sorted(common)
    by_round = [dict(c) for c in curves]
    means, stds = [], []
    for r in rounds:
        xs = [float(c[r]) for c in by_round]
        means.append(statistics.fmean(xs))
        if len(xs) > 1:
            stds.append(statistics.stdev(xs))
    return rounds, means, stds if len(curves) > 1 else None
