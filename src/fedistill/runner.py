"""What the CLI commands do, as functions usable from Python too."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .config import Config
from .errors import ConfigError, TrainingDiverged
from .report.plots import accuracy_label, plot_accuracy, plot_class_distributions, plot_partition, plot_personal_accuracy
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


def make_console() -> Console:
    """A console for our tables: at least 150 columns when output is not a terminal (logs, CI)."""
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 150))


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def load_dataset_for(cfg: Config, data_dir: str | None = None, download: bool | None = None):
    """The run's dataset: its files (from ``data_dir``, default ``dataset.data_dir``), variant and resize."""
    from .data.dataset import resized
    from .data.sources import load_dataset

    options = {"split": cfg.dataset.split} if cfg.dataset.split is not None else {}
    dataset = load_dataset(
        cfg.dataset.name,
        data_dir if data_dir is not None else cfg.dataset.data_dir,
        download=cfg.dataset.download if download is None else download,
        verify=cfg.dataset.verify,
        **options,
    )
    return resized(dataset, cfg.dataset.resize)


RESUME_NUMERIC_HINT = "pass --allow-numeric-change to continue anyway (the change is recorded in resumes.jsonl)"


def run_experiment(
    cfg: Config,
    run_dir: RunDirectory | None = None,
    resume: bool = False,
    console: Console | None = None,
    allow_numeric_change: bool = False,
    quiet: bool = False,
) -> dict[str, Any]:
    """Run ``cfg`` into a run directory (a new one unless resuming); returns the summary.

    Everything a user can get wrong is checked before anything is written: the config (already validated),
    the worker and thread counts, the run directory's location, the dataset files, the partition and the
    model. A resume rewrites ``config.yaml`` only once its checkpoint has been restored and rounds remain.
    """
    from .engine.executors import check_workers
    from .engine.simulation import Simulation, summarise

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
    counts = sim.federation.class_counts()
    run_dir.write_partition(counts)
    plot_partition(counts, run_dir.path / "partition.png", f"{cfg.partition.scheme}: {counts.shape[0]} clients")

    key = "personal_accuracy" if cfg.accuracy_metric() == "personal" else "test_accuracy"
    log = RoundLog(console, run_dir.path / "run.log", cfg.rounds, sim.state.round, key, progress=cfg.run.progress, quiet=quiet)
    what = (
        f"{cfg.algorithm.display_name()} on {cfg.dataset.name} ({describe_models(cfg)}), {cfg.partition.num_clients} clients "
        f"({cfg.partition.scheme}), {cfg.clients_per_round}/round, {cfg.rounds} rounds -> {run_dir.path}{note}"
    )
    log.header(what, markup=f"[bold]{escape(cfg.algorithm.display_name())}[/]{escape(what[len(cfg.algorithm.display_name()):])}")
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
    except KeyboardInterrupt:
        run_dir.write_csv(sim.state.history)
        raise
    finally:
        if board is not None:
            board.close()
    summary = summarise(history, cfg.eval.target_accuracy, cfg.accuracy_metric())
    summary["status"] = "finished"
    summary["run_dir"] = str(run_dir.path)
    from .models.flat import num_flat

    summary["model_parameters"] = num_flat(sim.server.model)
    run_dir.write_csv(history)
    run_dir.write_summary(summary)
    with open(run_dir.path / "run.log", "a", encoding="utf-8") as f:
        f.write(
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} finished: final {summary['accuracy_metric']} accuracy "
            f"{_fmt(summary.get('final_accuracy'))}%, best {_fmt(summary.get('best_accuracy'))}% "
            f"(round {summary.get('best_round', '-')}), {_fmt(summary.get('seconds'), '.1f')} s\n"
        )
    curve = [(r["round"], r[key]) for r in history if r.get(key) is not None]
    plot_accuracy(
        {cfg.algorithm.display_name(): curve}, run_dir.path / "accuracy.png", cfg.eval.target_accuracy, ylabel=accuracy_label(key)
    )
    plot_personal_accuracy(history, run_dir.path / "personal_accuracy.png", cfg.algorithm.display_name())
    plot_class_distributions({cfg.algorithm.display_name(): history}, run_dir.path / "class_distributions.png")
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


def describe_models(cfg: Any) -> str:
    """The model(s) a run trains, for its first log line: one name, or the client and server architectures."""
    names = cfg.model.client_model_names()
    clients = ", ".join(names) if names else cfg.model_name()
    if cfg.model.server is None and not names:
        return clients
    return f"clients: {clients}" + (f"; server: {cfg.model.server}" if cfg.model.server else "")


def saved_accuracy_metric(config: dict[str, Any]) -> str:
    """``global`` or ``personal``: the accuracy a saved run's config asked for (Config.accuracy_metric)."""
    metric = (config.get("eval") or {}).get("metric", "auto")
    if metric == "auto":
        return "personal" if (config.get("partition") or {}).get("per_client_test") else "global"
    return metric


def compare_runs(paths: list[str], out: Path | None = None, target: float | None = None, console: Console | None = None) -> None:
    from .engine.simulation import summarise

    console = console or make_console()
    summaries: dict[str, dict[str, Any]] = {}
    curves: dict[str, list[tuple[int, float]]] = {}
    histories: dict[str, list[dict[str, Any]]] = {}
    metrics: set[str] = set()
    for p in paths:
        path = Path(p)
        config, rows, summary = read_run(path)
        goal = target if target is not None else (config.get("eval") or {}).get("target_accuracy")
        name = path.name
        if name in summaries:
            name = str(path)
        metric = saved_accuracy_metric(config)
        metrics.add(metric)
        key = "personal_accuracy" if metric == "personal" else "test_accuracy"
        summaries[name] = summarise(rows, goal, metric)  # recomputed so that a common --target applies to all
        curves[name] = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
        histories[name] = rows
    print_summary(console, summaries)
    out = out or Path("compare.png")
    plot_accuracy(curves, out, target, ylabel=accuracy_label("personal_accuracy" if metrics == {"personal"} else "test_accuracy"))
    console.print(f"curves: {out}")
    distributions = out.with_name(f"{out.stem}_class_distributions{out.suffix or '.png'}")
    if plot_class_distributions(histories, distributions):
        console.print(f"class distributions per round (training labels, test predictions): {distributions}")


def show_partition(args: argparse.Namespace, console: Console | None = None) -> None:
    from .config import build_config, parse_override, read_yaml
    from .data.partition import partition_stats
    from .engine.simulation import build_federation

    console = console or make_console()
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
    base = read_yaml(args.config) if args.config else {}
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
    out = Path(args.out)
    plot_partition(counts, out, f"{cfg.dataset.name} {cfg.partition.scheme}")
    console.print(f"heatmap: {out}")
