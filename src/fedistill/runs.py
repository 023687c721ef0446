"""Run, resume or reuse run directories, one at a time or N at a time (``reproduce`` and ``bench``).

A run directory that already holds a run is compared with the configuration asked for (the parts that decide
its numbers): the same run finished is reused, an interrupted one resumes from its checkpoint, and another
configuration is refused, never mixed into a table.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = ["comparable_config", "read_saved", "run_state", "ensure_run", "ensure_run_quietly", "run_in_parallel"]


def comparable_config(config: dict[str, Any]) -> dict[str, Any]:
    """The parts of a saved config that decide its numbers, resolved (every default written out, keys a later
    version added filled in), so a run saved before a setting existed compares equal to the same run now.
    Only for configs read from a run directory: a key they lack takes the default they ran with
    (config.CHANGED_DEFAULTS); a live config is compared through :func:`live_comparable_config`."""
    from .config import resolved_config

    return _numbers_part(resolved_config(config))


def live_comparable_config(cfg) -> dict[str, Any]:
    """:func:`comparable_config` of the config about to run (its own defaults, today's, written out)."""
    return _numbers_part(cfg.resolved_dict())


def _numbers_part(resolved: dict[str, Any]) -> dict[str, Any]:
    from .engine.checkpoint import comparable_setting

    return {k: comparable_setting(k, v) for k, v in resolved.items() if k not in ("rounds", "run")}


def read_saved(run_path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """(config, rows, summary) of a run directory, tolerating a run that stopped before its first row
    (or was killed while writing one)."""
    from .report.rundir import read_run

    return read_run(run_path, require_metrics=False)


def run_state(cfg, run_path: Path, command: str = "reproduce") -> str:
    """``done`` (finished with ``cfg.rounds`` rounds, or diverged), ``partial`` (to resume) or ``new``; a
    directory holding another configuration is refused (a changed preset, suite or --set must not mix runs;
    ``command`` names the one whose input changed)."""
    if not (run_path / "config.yaml").is_file():
        return "new"
    saved, rows, summary = read_saved(run_path)
    # Not comparable_config(cfg.to_dict()): that dict leaves the algorithm's defaults out, and a FedGKT-family
    # config would then take the saved-run default of a key it lacks (zs_mode eval) and refuse its own runs.
    if comparable_config(saved) != live_comparable_config(cfg):
        changed = "the suite" if command == "bench" else "the preset"
        raise ConfigError(
            f"{command}: {run_path} holds a run with another configuration ({changed} or --set changed); "
            "use another --out, or delete that directory"
        )
    if summary.get("status") == "diverged" or (summary.get("status") == "finished" and len(rows) >= cfg.rounds):
        return "done"
    return "partial"


def ensure_run(cfg, run_path: Path, console, count_first_round=None) -> tuple[list[dict[str, Any]], bool]:
    """Run, resume or reuse the run at ``run_path`` so that it has ``cfg.rounds`` rounds (``count_first_round``:
    called with round 1's FLOPs if round 1 runs here, :func:`fedistill.runner.run_experiment`).

    Returns its metric rows (at most ``cfg.rounds``) and whether it diverged; a diverged run is a result
    (the paper's "Failed"), not an error that stops the table.
    """
    from .errors import TrainingDiverged

    try:
        _run_to_the_end(cfg, run_path, console, count_first_round)
    except TrainingDiverged as exc:
        console.print(f"[yellow]{run_path}: {exc}[/]")
    _, rows, summary = read_saved(run_path)
    return rows[: cfg.rounds], summary.get("status") == "diverged"


def _run_to_the_end(cfg, run_path: Path, console, count_first_round=None) -> None:
    import shutil

    from .report.rundir import RunDirectory
    from .runner import run_experiment

    state = run_state(cfg, run_path)
    if state == "done":
        return
    if state == "partial":
        # Resumed from its checkpoint, or started again from round 1 if it died before the first one.
        run_experiment(cfg, RunDirectory(run_path), resume=True, console=console, count_first_round=count_first_round)
        return
    if run_path.exists():  # a directory without a config: nothing of a run was written yet
        shutil.rmtree(run_path)
    run_path.mkdir(parents=True)
    run_experiment(cfg, RunDirectory(run_path), console=console, count_first_round=count_first_round)


def ensure_run_quietly(config_tree: dict[str, Any], path: str, count_first_round=None) -> str:
    """:func:`ensure_run` from a config tree (in a worker process: picklable), its console discarded."""
    from rich.console import Console

    from .config import build_config

    ensure_run(build_config(config_tree), Path(path), Console(file=io.StringIO(), width=120), count_first_round)
    return path


def run_in_parallel(runs: list[tuple[str, Any, Path]], jobs: int, console, name: str, root: Path) -> None:
    """Bring every (label, config, path) of ``runs`` to its rounds, ``jobs`` at a time in spawned processes
    (no forked torch state; plugins travel in $FEDISTILL_PLUGINS), one line as each finishes. Every directory
    is checked first, so a changed configuration stops everything before any run starts."""
    from concurrent.futures import as_completed

    from .engine.processes import run_pool
    from .engine.interrupts import uninterrupted

    todo = [(label, cfg, path) for label, cfg, path in runs if run_state(cfg, path) != "done"]
    if not todo:
        return
    console.print(f"[bold]{name}[/]: {len(todo)} runs to do, {jobs} at a time -> {root}")
    with run_pool(jobs) as pool:  # interrupted, the running runs stop and resume from their checkpoints
        with uninterrupted():
            futures = {pool.submit(ensure_run_quietly, cfg.resolved_dict(), str(path)): label for label, cfg, path in todo}
        for done, future in enumerate(as_completed(futures), 1):
            future.result()  # a failed run stops here, with its own error
            console.print(f"{futures[future]} finished ({done}/{len(todo)})", highlight=False)
