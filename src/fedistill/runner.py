"""What the CLI commands do, as functions usable from Python too.

Length (over the ~500-line guide of ARCHITECTURE.md): the composition root of a simulated run: configuration to
dataset, federation, algorithm and engine, plus resume and seed groups, read top to bottom in one place.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from rich import filesize
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .config import Config
from .errors import ConfigError, RunInterrupted, TrainingDiverged
from .report.plots import accuracy_label, config_title, plot_accuracy, plot_class_distributions, plot_partition, plot_personal_accuracy
from .report.rundir import RunDirectory, read_run
from .report.environment import environment_info
from .report.runlog import RoundLog


def tensorboard_writer_class() -> Any:
    """torch's TensorBoard ``SummaryWriter`` for ``run.tensorboard``, or a one-line error saying what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        raise ConfigError(
            "run.tensorboard: the tensorboard package is not installed; install it with "
            "`pip install 'fedistill[tensorboard]'` (or `pip install tensorboard`), or set run.tensorboard=false"
        ) from None
    return SummaryWriter


def make_console(wide: bool = False) -> Console:
    """A console for our tables. Off a terminal (logs, CI, nohup) rich uses ``$COLUMNS`` or 80 columns, which
    a run's summary fits (:func:`print_summary` wraps under 110); ``wide`` tables with many columns that
    must stay one row per method (``compare``, ``reproduce``, ``list``) get at least 150 there instead."""
    console = Console()
    return console if console.is_terminal or not wide else Console(width=max(console.width, 150))


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _bytes(n: float | None) -> str:
    """Traffic in rich's decimal units (as the download lines): 950 bytes, 28.9 kB, 170.5 MB, 12.3 GB, 1.0 TB."""
    return "-" if n is None else filesize.decimal(round(n))


def load_dataset_for(cfg: Config, data_dir: str | None = None, download: bool | None = None):
    """The run's dataset: its files (from ``data_dir``, default ``dataset.data_dir``), variant, training
    subset and resize."""
    from .data.dataset import resized, train_subset
    from .data.sources import load_dataset

    options = cfg.dataset_options()  # the EMNIST split; the synthetic federation's clients, seed and options
    dataset = load_dataset(
        cfg.dataset.name,
        data_dir if data_dir is not None else cfg.dataset.data_dir,
        download=cfg.dataset.download if download is None else download,
        verify=cfg.dataset.verify,
        **options,
    )
    try:
        dataset = train_subset(dataset, cfg.dataset.train_samples)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return resized(dataset, cfg.dataset.resize)


RESUME_NUMERIC_HINT = "pass --allow-numeric-change to continue anyway (the change is recorded in resumes.jsonl)"


def model_parameters(cfg: Config, dataset: Any, server_model: Any, num_clients: int) -> dict[str, Any]:
    """summary.json's model sizes: ``model_parameters``, the server model's count (0 for a method that keeps
    none: Local, FD, FedProto, FedGH, FedTGP), and where the clients hold other architectures than the server
    (``model.clients``, ``model.group``, ``model.client_mix``) or the server holds none,
    ``client_model_parameters``: each client architecture's count, by name."""
    from .engine.architectures import client_architectures
    from .engine.seeding import INIT
    from .models.flat import num_flat
    from .simulation import build_model_for

    sizes: dict[str, Any] = {"model_parameters": num_flat(server_model)}
    names = sorted(set(client_architectures(cfg, num_clients)))
    if names != [cfg.model_name()] or sizes["model_parameters"] == 0:
        sizes["client_model_parameters"] = {name: num_flat(build_model_for(cfg, dataset, (INIT,), name)) for name in names}
    return sizes


def run_experiment(
    cfg: Config,
    run_dir: RunDirectory | None = None,
    resume: bool = False,
    console: Console | None = None,
    allow_numeric_change: bool = False,
    quiet: bool = False,
    count_first_round: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` into a run directory (a new one unless resuming); returns the summary.

    ``count_first_round``: called with round 1's FLOPs, counted while round 1 runs (the bench's first-seed
    cells, engine/flops.py); a run resumed after round 1 never calls it.

    Everything a user can get wrong is checked before anything is written: the config (already validated),
    the worker and thread counts, the run directory's location, the dataset files, the partition and the
    model. A resume rewrites ``config.yaml`` only once its checkpoint has been restored and rounds remain.
    """
    from .engine.executors import check_workers
    from .simulation import Simulation, summarise

    console = console or make_console()
    check_workers(cfg)
    writer_class = tensorboard_writer_class() if cfg.run.tensorboard else None
    new_dir: tuple[str, str] | None = None
    if run_dir is None:
        default = f"{cfg.algorithm.display_name()}-{cfg.dataset.name}"
        name = cfg.run.name or f"{default}-{time.strftime('%Y%m%d-%H%M%S')}"
        path = RunDirectory.location(cfg.run.out_dir, name, default)
        if path.exists() and any(path.iterdir()):
            RunDirectory.create(cfg.run.out_dir, name, default)  # raises: says how to continue it
        new_dir = (cfg.run.out_dir, name)
    dataset = load_dataset_for(cfg)
    # Build everything (partition, models, algorithm) before creating the run directory, so that an
    # impossible partition or a bad model option leaves no empty run directory behind.
    sim = Simulation(cfg, dataset)
    if new_dir is not None:
        run_dir = RunDirectory.create(new_dir[0], new_dir[1], new_dir[1])
    assert run_dir is not None
    sim.run_dir = run_dir.path
    note = ""
    if resume:
        restored = sim.restore(allow_numeric_change=allow_numeric_change, hint=RESUME_NUMERIC_HINT)
        done = sim.state.round
        if restored and cfg.rounds < done:
            raise ConfigError(
                f"resume: {run_dir.path} already has {done} rounds; --rounds {cfg.rounds} cannot take them back "
                f"(give --rounds above {done} to continue it, or leave --rounds out)"
            )
        note = run_dir.begin_resume(sim.state.history, restored, cfg.rounds, sim.server_runtime.numeric_changes)
    if sim.state.round < cfg.rounds or not resume:
        run_dir.write_config(cfg.resolved_dict())
        run_dir.write_environment(environment_info(cfg))
    counts, partial = sim.federation.report_counts()
    run_dir.write_partition(counts)
    title = config_title(cfg)  # the same title as `fedistill partition`
    if partial:
        title += f" (first {counts.shape[0]:,} of {sim.federation.num_clients:,} clients)"
        if not quiet:
            console.print(
                f"[dim]partition_counts.csv and partition.png cover the first {counts.shape[0]:,} of the "
                f"{sim.federation.num_clients:,} generated clients (counting all would generate every client's data)[/]"
            )
    if cfg.run.figures:
        plot_partition(counts, run_dir.path / "partition.png", title)

    key = "personal_accuracy" if cfg.accuracy_metric() == "personal" else "test_accuracy"
    log = RoundLog(console, run_dir.path / "run.log", cfg.rounds, sim.state.round, key, progress=cfg.run.progress, quiet=quiet)
    if cfg._method_settings:  # what the method set where the run's defaults do not suit it (config_defaults)
        settings = ", ".join(f"{k}={v}" for k, v in cfg._method_settings.items())
        note += f" ({cfg.algorithm.name} sets {settings}: the run's defaults do not suit it; set them to override)"
    what = (
        f"{cfg.algorithm.display_name()} on {cfg.dataset.name} ({describe_models(cfg)}), {cfg.partition.num_clients} clients "
        f"({cfg.partition.scheme}), {cfg.clients_per_round}/round, {cfg.rounds} rounds -> {run_dir.path}{note}"
    )
    log.header(what, markup=f"[bold]{escape(cfg.algorithm.display_name())}[/]{escape(what[len(cfg.algorithm.display_name()):])}")
    if sim.state.round < cfg.rounds:
        log.note(f"cores: {sim.core_plan()}")
        if sim.cohort_choice:
            log.note(sim.cohort_choice)
    # Every numeric per-round metric, under tensorboard/ in the run directory.
    board = writer_class(log_dir=str(run_dir.path / "tensorboard")) if writer_class is not None else None

    def on_round(row: dict[str, Any]) -> None:
        run_dir.append_metrics(row)
        log.round(row)
        if board is not None:
            for name, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "round":
                    board.add_scalar(name, value, row["round"])
            board.flush()

    sim.on_round = on_round
    sim.count_first_round = count_first_round
    try:
        with log:
            try:
                history = sim.run()
            except TrainingDiverged as exc:
                log.note(f"diverged: {exc}")
                raise
            except KeyboardInterrupt:
                log.note(f"interrupted after round {sim.state.round}")
                raise
    except TrainingDiverged:
        run_dir.write_csv(sim.state.history)
        run_dir.write_summary({**summarise(sim.state.history, cfg.eval.target_accuracy, cfg.accuracy_metric()), "status": "diverged"})
        raise
    except KeyboardInterrupt as exc:
        run_dir.write_csv(sim.state.history)
        raise RunInterrupted(f"continue with `fedistill run --resume {run_dir.path}`") from exc
    finally:
        if board is not None:
            board.close()
    summary = summarise(history, cfg.eval.target_accuracy, cfg.accuracy_metric())
    summary["status"] = "finished"
    summary["run_dir"] = str(run_dir.path)
    summary.update(model_parameters(cfg, sim.dataset, sim.server.model, sim.federation.num_clients))
    run_dir.write_csv(history)
    run_dir.write_summary(summary)
    with open(run_dir.path / "run.log", "a", encoding="utf-8") as f:
        f.write(
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} finished: final {summary['accuracy_metric']} accuracy "
            f"{_fmt(summary.get('final_accuracy'))}%, best {_fmt(summary.get('best_accuracy'))}% "
            f"(round {summary.get('best_round', '-')}), {_fmt(summary.get('seconds'), '.1f')} s\n"
        )
    if cfg.run.figures:
        curve = [(r["round"], r[key]) for r in history if r.get(key) is not None]
        algorithm = cfg.algorithm.display_name()
        title = config_title(cfg, extra=algorithm)
        plot_accuracy({algorithm: curve}, run_dir.path / "accuracy.png", cfg.eval.target_accuracy, ylabel=accuracy_label(key), title=title)
        plot_personal_accuracy(history, run_dir.path / "personal_accuracy.png", algorithm, title=title)
        plot_class_distributions({algorithm: history}, run_dir.path / "class_distributions.png", title=config_title(cfg))
    print_summary(console, {run_dir.path.name: summary})
    return summary


SUMMARY_COLUMNS = ("run", "rounds", "final acc %", "best acc %", "best round", "to target", "down", "up", "seconds")


def _summary_cells(s: dict[str, Any]) -> list[str]:
    target = s.get("target_accuracy")
    to_target = "-" if target is None else (str(s["rounds_to_target"]) if s.get("rounds_to_target") else "not reached")
    return [
        str(s.get("rounds", "-")),
        _fmt(s.get("final_accuracy")),
        _fmt(s.get("best_accuracy")),
        str(s.get("best_round", "-")),
        to_target,
        _bytes(s.get("bytes_down")),
        _bytes(s.get("bytes_up")),
        _fmt(s.get("seconds"), ".1f"),
    ]


def print_summary(console: Console, summaries: dict[str, dict[str, Any]]) -> None:
    """The summary table; under 110 columns (an 80-column terminal) one block per run instead, with the same
    fields as ``name value`` pairs wrapped to the width: nothing is cut or dropped."""
    if console.width < 110:
        import textwrap

        console.print("summary", highlight=False)
        for name, s in summaries.items():
            pairs = [f"{col} {value}" for col, value in zip(SUMMARY_COLUMNS[1:], _summary_cells(s))]
            console.print(textwrap.fill(name, console.width, break_on_hyphens=False), highlight=False, markup=False)
            body = textwrap.fill(" | ".join(pairs), console.width, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
            console.print(body, highlight=False, markup=False)
        return
    table = Table(title="summary", title_justify="left")
    for col in SUMMARY_COLUMNS:
        if col == "run":
            table.add_column(col, justify="left", overflow="fold", min_width=28)  # names must stay readable
        else:
            table.add_column(col, justify="right")
    for name, s in summaries.items():
        table.add_row(name, *_summary_cells(s))
    console.print(table)


def print_rows(console: Console, title: str, columns: Sequence[str], rows: dict[str, list[str]]) -> None:
    """A table of already formatted cells (the first column is the row's name); under 110 columns one wrapped
    block of ``column value`` pairs per row, as :func:`print_summary` does."""
    if console.width < 110:
        import textwrap

        console.print(title, highlight=False, markup=False)
        for name, cells in rows.items():
            pairs = [f"{col} {value}" for col, value in zip(columns[1:], cells)]
            console.print(textwrap.fill(name, console.width, break_on_hyphens=False), highlight=False, markup=False)
            body = textwrap.fill(" | ".join(pairs), console.width, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
            console.print(body, highlight=False, markup=False)
        return
    table = Table(title=escape(title), title_justify="left")
    for i, col in enumerate(columns):
        if i == 0:
            table.add_column(col, justify="left", overflow="fold", min_width=20)
        else:
            table.add_column(col, justify="right")
    for name, cells in rows.items():
        table.add_row(escape(name), *(escape(c) for c in cells))
    console.print(table)


GROUP_COLUMNS = ("seed", "status", "rounds", "final acc %", "best acc %", "best round", "to target", "seconds")


def print_group_summary(console: Console, group: dict[str, Any], title: str) -> None:
    """The group summary of ``run --seeds``: one row per seed, then mean ± std over the seeds."""
    from .report.groups import format_stat, format_to_target

    target = group.get("target_accuracy")
    rows: dict[str, list[str]] = {}
    for e in group["runs"]:
        to_target = "-" if target is None else (str(e["rounds_to_target"]) if e["rounds_to_target"] is not None else "not reached")
        rows[f"seed {e['seed']} ({e['dir']})"] = [
            str(e.get("status") or "-"), str(e.get("rounds", "-")), _fmt(e.get("final_accuracy")), _fmt(e.get("best_accuracy")),
            str(e.get("best_round") or "-"), to_target, _fmt(e.get("seconds"), ".1f"),
        ]  # fmt: skip
    rows[f"mean ± std ({group['counted']} seeds)"] = [
        "", "", format_stat(group["final_accuracy"]), format_stat(group["best_accuracy"]),
        format_stat(group["best_round"], ".1f"), format_to_target(group), format_stat(group["seconds"], ".1f"),
    ]  # fmt: skip
    print_rows(console, title, GROUP_COLUMNS, rows)


def seed_group_configs(base: dict[str, Any], overrides: dict[str, Any], seeds: Sequence[int]) -> tuple[Path, dict[int, Config]]:
    """The group directory of ``run --seeds`` and every seed's validated config (all built before any runs,
    so a bad value fails first). Each seed's run goes to ``<group>/seed<s>``; the group is
    ``<run.out_dir>/<run.name>`` (default ``ALGORITHM-DATASET-TIME`` like a single run's directory)."""
    from .config import build_config
    from .report.groups import check_seeds, seed_dir_name

    seeds = check_seeds(seeds)
    if "seed" in overrides:
        raise ConfigError("--seeds and --seed (or --set seed=...) exclude each other; list every seed in --seeds")
    first = build_config(base, overrides)
    default = f"{first.algorithm.display_name()}-{first.dataset.name}"
    name = first.run.name or f"{default}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = RunDirectory.location(first.run.out_dir, name, default)
    configs = {s: build_config(base, {**overrides, "seed": s, "run.out_dir": str(path), "run.name": seed_dir_name(s)}) for s in seeds}
    return path, configs


def run_seed_group(
    base: dict[str, Any], overrides: dict[str, Any], seeds: Sequence[int], console: Console | None = None, quiet: bool = False
) -> dict[str, Any]:
    """``fedistill run --seeds``: the config ``base`` with ``overrides`` once per seed, in sequence, each an
    ordinary run directory ``<group>/seed<s>``; ``group.json`` and ``group.md`` are rewritten after every
    seed, so an interrupted group keeps the summary of the seeds it finished. A seed whose run diverges is
    recorded (status ``diverged``, left out of the means) and the next seed runs; the group then ends with
    :class:`TrainingDiverged`. Returns the group summary."""
    from .report.groups import group_summary, seed_dir_name, write_group

    console = console or make_console()
    path, configs = seed_group_configs(base, overrides, seeds)
    if path.exists() and any(path.iterdir()):
        raise ConfigError(
            f"run.name: group directory {path} already exists; choose another name with --name (or another --out); "
            f"continue one of its seeds with fedistill run --resume {path}/seedN"
        )
    first = next(iter(configs.values()))
    seeds = list(configs)
    title = f"group summary: {path.name} ({first.algorithm.display_name()} on {first.dataset.name}, seeds {' '.join(map(str, seeds))})"
    summaries: dict[int, dict[str, Any]] = {}
    diverged: list[int] = []
    group: dict[str, Any] = {}
    for i, (seed, cfg) in enumerate(configs.items(), 1):
        run_path = path / seed_dir_name(seed)
        if not quiet:
            console.print(f"seed {seed} ({i}/{len(seeds)}) -> {run_path}", highlight=False, markup=False)
        try:
            summaries[seed] = run_experiment(cfg, console=console, quiet=quiet)
        except TrainingDiverged as exc:
            _, _, saved = read_run(run_path, require_metrics=False)
            summaries[seed] = {**saved, "status": "diverged", "run_dir": str(run_path)}
            diverged.append(seed)
            console.print(f"seed {seed} diverged ({exc}); going on with the next seed", highlight=False, markup=False)
        except KeyboardInterrupt:
            left = " ".join(map(str, seeds[i:]))
            console.print(
                f"group {path}: " + (f"group.json holds seeds {' '.join(map(str, summaries))}" if summaries else "no seed finished")
                + f"; seed {seed} was interrupted (continue it with "
                f"fedistill run --resume {run_path})" + (f"; seeds {left} did not run" if left else ""),
                highlight=False, markup=False,
            )  # fmt: skip
            raise
        group = {"name": path.name, "planned_seeds": seeds, "complete": len(summaries) == len(seeds), **group_summary(summaries)}
        write_group(path, group, title)
    print_group_summary(console, group, title)
    console.print(f"group summary: {path / 'group.json'} and group.md", highlight=False, markup=False)
    if diverged:
        raise TrainingDiverged(
            f"seed(s) {', '.join(map(str, diverged))} of group {path} diverged; the group summary leaves them out "
            f"(their run directories keep the last good checkpoint)"
        )
    return group


def refresh_seed_group(path: Path, cfg: Any, console: Console | None = None) -> dict[str, Any]:
    """Rewrite a seed group's ``group.json``/``group.md`` from its members' saved summaries: after one of its
    seeds was continued with ``run --resume GROUP/seedN`` (what an interrupted group says to do), so that the
    group summary counts it. Seeds without a finished (or diverged) run stay out, and ``complete`` says so."""
    from .report.groups import group_summary, read_group, seed_dir_name, write_group

    previous = read_group(path)
    planned = [s for s in (previous.get("planned_seeds") or previous.get("seeds") or []) if isinstance(s, int)]
    summaries: dict[int, dict[str, Any]] = {}
    for seed in planned:
        run_path = path / seed_dir_name(seed)
        _, _, saved = read_run(run_path, require_metrics=False) if run_path.is_dir() else ({}, [], {})
        if saved.get("status") in ("finished", "diverged"):
            summaries[seed] = {**saved, "run_dir": str(run_path)}
    group = {"name": path.name, "planned_seeds": planned, "complete": len(summaries) == len(planned), **group_summary(summaries)}
    title = f"group summary: {path.name} ({cfg.algorithm.display_name()} on {cfg.dataset.name}, seeds {' '.join(map(str, planned))})"
    write_group(path, group, title)
    if console is not None:
        missing = [s for s in planned if s not in summaries]
        console.print(
            f"group summary: {path / 'group.json'} updated ({len(summaries)}/{len(planned)} seeds"
            + (f"; seeds {' '.join(map(str, missing))} have no finished run" if missing else "") + ")",
            highlight=False, markup=False,
        )  # fmt: skip
    return group


def describe_models(cfg: Any) -> str:
    """The model(s) a run trains, for its first log line: one name, or the client and server architectures."""
    from .protocol import exchange_of
    from .registry import ALGORITHMS

    names = cfg.model.client_model_names()
    clients = ", ".join(names) if names else cfg.model_name()
    if cfg.model.group is not None:
        clients = f"group {cfg.model.group} ({clients})"
    # Only methods that declare a server predictor train model.server (others ignore it, with a warning).
    server = cfg.model.server if exchange_of(ALGORITHMS.get(cfg.algorithm.name)).server_predictor else None
    if server is None and not names:
        return clients
    return f"clients: {clients}" + (f"; server: {server}" if server else "")


def saved_accuracy_metric(config: dict[str, Any]) -> str:
    """``global`` or ``personal``: the accuracy a saved run's config asked for (Config.accuracy_metric)."""
    metric = (config.get("eval") or {}).get("metric", "auto")
    if metric == "auto":
        return "personal" if (config.get("partition") or {}).get("per_client_test") else "global"
    return metric


COMPARE_COLUMNS = ("run", "seeds", "rounds", "final acc %", "best acc %", "best round", "to target", "down", "up", "seconds")


def _group_cells(group: dict[str, Any], rounds: set[int]) -> list[str]:
    """A seed group's row of the comparison table: means ± sample std over its seeds."""
    from .report.groups import format_stat, format_to_target

    count = str(len(group["runs"])) if group["counted"].split("/")[0] == str(len(group["runs"])) else group["counted"]
    mean = lambda name: (group[name] or {}).get("mean")  # noqa: E731
    return [
        count, "-" if not rounds else str(min(rounds)) if len(rounds) == 1 else f"{min(rounds)}-{max(rounds)}",
        format_stat(group["final_accuracy"]), format_stat(group["best_accuracy"]), format_stat(group["best_round"], ".1f"),
        format_to_target(group), _bytes(mean("bytes_down")), _bytes(mean("bytes_up")), format_stat(group["seconds"], ".1f"),
    ]  # fmt: skip


def compare_runs(paths: list[str], out: Path | None = None, target: float | None = None, console: Console | None = None) -> None:
    """``fedistill compare``: the summary table, the overlaid accuracy curves and the class-distribution
    heatmaps of run directories and seed groups (``run --seeds``; a directory holding ``group.json``, or run
    directories without one of its own). A group is one row, its final and best accuracy as mean ± sample
    std over its seeds, and one curve, the per-round mean over the rounds every seed has, with a ±1 std band;
    its class-distribution heatmaps are its first seed's. A seed whose run diverged is left out of both."""
    import math

    from .engine.summary import summarise
    from .report.groups import group_members, group_summary, mean_curve
    from .report.plots import check_figure_path

    console = console or make_console(wide=True)
    out = check_figure_path("--out", out or Path("compare.png"))
    if target is not None and not (math.isfinite(target) and 0 < target <= 100):
        raise ConfigError(f"--target: {target} is not an accuracy in percent; give a number above 0 and at most 100")
    summaries: dict[str, dict[str, Any]] = {}
    cells: dict[str, list[str]] = {}  # rows of the table with groups
    curves: dict[str, list[tuple[int, float]]] = {}
    bands: dict[str, tuple[list[int], list[float], list[float]]] = {}
    histories: dict[str, list[dict[str, Any]]] = {}
    metrics: set[str] = set()

    def load(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any], list[tuple[int, float]]]:
        config, rows, saved = read_run(path)
        goal = target if target is not None else (config.get("eval") or {}).get("target_accuracy")
        metric = saved_accuracy_metric(config)
        metrics.add(metric)
        key = "personal_accuracy" if metric == "personal" else "test_accuracy"
        summary = summarise(rows, goal, metric)  # recomputed so that a common --target applies to all
        summary.update({"status": saved.get("status"), "run_dir": str(path)})
        return config, rows, summary, [(r["round"], r[key]) for r in rows if r.get(key) is not None]

    for p in paths:
        path = Path(p)
        name = path.name
        if name in summaries:
            name = str(path)
        members = group_members(path)
        if members is None:
            config, rows, summary, curve = load(path)
            summaries[name] = summary
            cells[name] = ["1", *_summary_cells(summary)]
            curves[name] = curve
            histories[name] = rows
            continue
        per_seed: dict[Any, dict[str, Any]] = {}
        kept: list[list[tuple[int, float]]] = []
        for member in members:
            config, rows, summary, curve = load(member)
            seed = config.get("seed")
            seed = seed if isinstance(seed, int) and seed not in per_seed else member.name
            if not per_seed:
                histories[f"{name} (seed {seed})"] = rows
            per_seed[seed] = summary
            if summary.get("status") != "diverged":
                kept.append(curve)
        group = group_summary(per_seed)
        summaries[name] = group
        rounds, mean, std = mean_curve(kept)
        cells[name] = _group_cells(group, {s["rounds"] for s in per_seed.values() if s.get("status") != "diverged"})
        label = f"{name} ({len(kept)} seeds, mean ± 1 std)" if len(kept) > 1 else f"{name} ({len(kept)} seed)"
        curves[label] = list(zip(rounds, mean))
        if len(kept) > 1:
            bands[label] = (rounds, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)])
    if any("runs" in s for s in summaries.values()):  # a group: the table with the seeds column
        print_rows(console, "summary", COMPARE_COLUMNS, cells)
    else:
        print_summary(console, summaries)
    ylabel = accuracy_label("personal_accuracy" if metrics == {"personal"} else "test_accuracy")
    plot_accuracy(curves, out, target, ylabel=ylabel, bands=bands or None)
    console.print(f"curves: {out}")
    distributions = out.with_name(f"{out.stem}_class_distributions{out.suffix}")
    if plot_class_distributions(histories, distributions):
        console.print(f"class distributions per round (training labels, test predictions): {distributions}")


def show_partition(args: argparse.Namespace, console: Console | None = None) -> None:
    from .config import build_config, parse_override, read_yaml
    from .data.partition import partition_stats
    from .engine.federation import build_federation

    console = console or make_console(wide=True)
    overrides: dict[str, Any] = {}
    for key in vars(args):
        if key.startswith(("dataset.", "partition.")) or key == "seed":
            if getattr(args, key) is not None:
                overrides[key] = getattr(args, key)
    if args.download:
        overrides["dataset.download"] = True
    if args.no_verify:
        overrides["dataset.verify"] = False
    for item in args.overrides:
        k, v = parse_override(item)
        overrides[k] = v
    from .report.plots import check_figure_path
    from .config import find_config

    if args.max_rows < 0:
        raise ConfigError(f"--max-rows: {args.max_rows} is negative; give the number of clients to print (0 for none)")
    out = check_figure_path("--out", args.out)
    base = read_yaml(find_config(args.config)) if args.config else {}
    base.pop("clients_per_round", None)  # irrelevant here; must not fail the clients-per-round check
    cfg = build_config(base, {**overrides, "clients_per_round": 1})
    dataset = load_dataset_for(cfg)
    fed = build_federation(cfg, dataset)
    counts = fed.class_counts()
    shown = counts[: args.max_rows]
    table = Table(title=f"{cfg.dataset.name}: {cfg.partition.scheme}, {counts.shape[0]} clients (client x class counts)", title_justify="left")
    table.add_column("client", justify="right")
    for c in range(counts.shape[1]):
        table.add_column(str(c), justify="right")
    table.add_column("total", justify="right")
    for k, row in enumerate(shown):
        table.add_row(str(k), *(str(int(v)) if v else "." for v in row), str(int(row.sum())))
    console.print(table)
    if counts.shape[0] > args.max_rows:
        console.print(f"... {counts.shape[0] - args.max_rows} more clients (see --max-rows)")
    stats = partition_stats(counts)
    st = Table(title="statistics", show_header=False, title_justify="left")
    for key, value in stats.items():
        st.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(st)
    plot_partition(counts, out, config_title(cfg), percent=getattr(args, "percent", False))  # the same title as the run directory's
    console.print(f"heatmap: {out}")
