"""The ``fedistill`` command: run, partition, compare, list.

Errors caused by input (a bad config value, a missing dataset file, an impossible partition) print one
line, ``error: <what is wrong and how to fix it>``, and exit with code 2. A diverged run exits with 1
after saying where its last good checkpoint is.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from .errors import ConfigError, FedistillError, RunInterrupted, TrainingDiverged

# Flags of ``fedistill run`` that are shortcuts for config keys.
RUN_FLAGS: list[tuple[str, str, type, str]] = [
    ("--algorithm", "algorithm.name", str, "algorithm name (see `fedistill list`)"),
    ("--dataset", "dataset.name", str, "dataset name"),
    ("--data-dir", "dataset.data_dir", str, "directory of the official dataset files (env FEDISTILL_DATA)"),
    ("--model", "model.name", str, "model name (default: the dataset's)"),
    ("--partition", "partition.scheme", str, "iid, shards, lda, client_dirichlet; natural for synthetic and npz_federation"),
    ("--alpha", "partition.alpha", float, "Dirichlet concentration"),
    ("--shards", "partition.shards_per_client", int, "shards per client (shards scheme)"),
    ("--clients", "partition.num_clients", int, "number of clients K"),
    ("--clients-per-round", "clients_per_round", int, "clients sampled per round"),
    ("--rounds", "rounds", int, "communication rounds"),
    ("--epochs", "local.epochs", int, "local epochs E"),
    ("--batch-size", "local.batch_size", int, "local batch size B"),
    ("--lr", "local.lr", float, "initial local learning rate"),
    ("--seed", "seed", int, "run seed"),
    ("--precision", "run.precision", str, "fp32 or bf16 (autocast, fp32 master weights)"),
    ("--out", "run.out_dir", str, "parent directory of run directories (default runs/)"),
    ("--name", "run.name", str, "run directory name (default: algorithm-dataset-time)"),
    ("--target", "eval.target_accuracy", float, "target accuracy in percent (rounds to target)"),
]


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a federated experiment", description="Run a federated experiment.")
    p.add_argument("--config", "-c", help="YAML config file, or the name of a shipped config (see `fedistill list`)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override any config key, e.g. --set local.lr=0.05 (repeatable)")
    for flag, key, typ, help_text in RUN_FLAGS:
        p.add_argument(flag, dest=key, type=typ, default=None, help=f"{help_text} [{key}]")
    p.add_argument("--download", action="store_true", default=None, help="download missing official dataset files")
    p.add_argument("--no-verify", action="store_true", help="skip md5 checks of dataset files (custom copies)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its checkpoint")
    p.add_argument(
        "--seeds", type=int, nargs="*", default=None, metavar="SEED",
        help="run once per seed: a group directory OUT/NAME holding seed0/, seed1/, ... and group.json/group.md "
        "(mean and std over the seeds); not with --seed or --resume",
    )  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--print-config", action="store_true", help="print the fully resolved configuration (as config.yaml will hold it) and exit")
    p.add_argument(
        "--allow-numeric-change", action="store_true",
        help="with --resume: allow run.precision, run.threads, run.channels_last or run.device to "
        "differ from the checkpoint's (the rest of the run then no longer equals an uninterrupted one; recorded in resumes.jsonl)",
    )


def _overrides_from_args(args: argparse.Namespace) -> list[tuple[str, Any]]:
    from .config import parse_override

    items: list[tuple[str, Any]] = []
    for _, key, _, _ in RUN_FLAGS:
        value = getattr(args, key)
        if value is not None:
            items.append((key, value))
    if args.download:
        items.append(("dataset.download", True))
    if args.no_verify:
        items.append(("dataset.verify", False))
    if args.no_progress:
        items.append(("run.progress", False))
    items.extend(parse_override(o) for o in args.overrides)
    return items


def cmd_run(args: argparse.Namespace) -> int:
    from .config import build_config, read_yaml
    from .report.rundir import RunDirectory
    from .config import find_config
    from .runner import make_console, refresh_seed_group, run_experiment

    overrides = dict(_overrides_from_args(args))
    if args.allow_numeric_change and not args.resume:
        raise ConfigError("--allow-numeric-change goes with --resume RUN_DIR")
    if args.seeds is not None:
        return _run_seeds(args, overrides)
    if args.resume:
        if args.config:
            raise ConfigError("--resume takes its config from the run directory; drop --config")
        moved = [flag for flag, key in (("--out", "run.out_dir"), ("--name", "run.name")) if key in overrides]
        if moved:
            raise ConfigError(
                f"--resume continues the run in {args.resume}; drop {' and '.join(moved)} (to rename or move a run, move its directory)"
            )
        run_dir = RunDirectory(Path(args.resume))
        base = run_dir.read_config()
        cfg = build_config(base, overrides, source=str(run_dir.path / "config.yaml"))
        if args.print_config:
            import yaml

            print(yaml.safe_dump(cfg.resolved_dict(), sort_keys=False), end="")
            return 0
        group = run_dir.path.parent
        in_group = (group / "group.json").is_file()
        try:
            run_experiment(cfg, run_dir=run_dir, resume=True, allow_numeric_change=args.allow_numeric_change, quiet=args.quiet > 0)
        except TrainingDiverged:
            if in_group:
                refresh_seed_group(group, cfg, make_console())
            raise
        if in_group:  # a seed of a `run --seeds` group: its group summary now counts this run
            refresh_seed_group(group, cfg, make_console())
    else:
        base = read_yaml(find_config(args.config)) if args.config else {}
        cfg = build_config(base, overrides)
        if args.print_config:
            import yaml

            print(yaml.safe_dump(cfg.resolved_dict(), sort_keys=False), end="")
            return 0
        run_experiment(cfg, quiet=args.quiet > 0)
    return 0


def _run_seeds(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """``run --seeds``: one run directory per seed in a group directory (runner.run_seed_group). With
    ``--print-config`` the first seed's config.yaml is printed, after a comment line naming the seeds."""
    from .config import read_yaml
    from .config import find_config
    from .runner import run_seed_group, seed_group_configs

    if args.resume:
        raise ConfigError("--seeds starts a new group of runs; continue one seed's run with --resume GROUP_DIR/seedN, without --seeds")
    base = read_yaml(find_config(args.config)) if args.config else {}
    if args.print_config:
        import yaml

        path, configs = seed_group_configs(base, overrides, args.seeds)
        seed, cfg = next(iter(configs.items()))
        print(
            f"# seed {seed}, the first of --seeds {' '.join(map(str, configs))} (group {path}); the other seeds' config.yaml "
            "differ in seed, run.name and partition.seed (unless set)"
        )
        print(yaml.safe_dump(cfg.resolved_dict(), sort_keys=False), end="")
        return 0
    run_seed_group(base, overrides, args.seeds, quiet=args.quiet > 0)
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    from .runner import show_partition

    show_partition(args)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .runner import compare_runs

    compare_runs(args.runs, out=Path(args.out) if args.out else None, target=args.target)
    return 0


def _data_overrides(args: argparse.Namespace) -> list[str]:
    """--set values, then --data-dir and --download as the keys they stand for (reproduce, bench)."""
    overrides = list(args.overrides)
    if args.data_dir:
        overrides.append(f"dataset.data_dir={args.data_dir}")
    if args.download:
        overrides.append("dataset.download=true")
    return overrides


def cmd_reproduce(args: argparse.Namespace) -> int:
    from .studies.reproduce import available_presets, load_preset, reproduce

    if not args.preset:
        print("presets: " + (", ".join(available_presets()) or "none found (this fedistill installation lacks its configs/reproduce package data; reinstall it)"))
        return 0
    if args.rounds is not None and args.rounds < 1:
        raise ConfigError(f"--rounds must be >= 1 (got {args.rounds})")
    preset = load_preset(args.preset)
    overrides = _data_overrides(args)
    # None when the flag is absent; an empty list (refused by reproduce) when it is given empty.
    split = lambda text: [t.strip() for t in text.split(",") if t.strip()] if text is not None else None  # noqa: E731
    # --status prints the line that continues the runs: this very command without --status.
    continue_command = shlex.join(["fedistill", *[a for a in args.argv if a != "--status"]])
    reproduce(
        preset, Path(args.out), rounds=args.rounds, seeds=args.seeds, methods=split(args.methods),
        columns=split(args.columns), overrides=overrides, jobs=args.jobs, status=args.status,
        continue_command=continue_command,
    )  # fmt: skip
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .studies.bench import available_suites, bench, list_cells, load_suite

    if not args.suite:
        print("suites: " + (", ".join(n for n, _ in available_suites()) or "none found"))
        return 0
    suite = load_suite(args.suite)
    overrides = _data_overrides(args)
    if args.cells:
        list_cells(suite, Path(args.out), overrides)
        return 0
    methods = None if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    published = None if args.published is None else Path(args.published)
    if published is not None and methods is None:
        raise ConfigError("bench --published: only with --methods (the cells to rank against)")
    if args.update_published and methods is None:
        raise ConfigError("bench --update-published: only with --methods (the methods whose cells replace the published ones)")
    if methods is not None and args.cell is not None:
        raise ConfigError("bench: --cell and --methods cannot be combined; --methods runs every cell of those methods")
    bench(suite, Path(args.out), jobs=args.jobs, only=None if args.cell is None else [args.cell], overrides=overrides,
          ray_address=args.ray, methods=methods, published=published, update_published=args.update_published)  # fmt: skip
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from rich.table import Table

    from . import algorithms as _a  # noqa: F401
    from . import models as _m  # noqa: F401
    from .data import partition as _p  # noqa: F401
    from .data import sources as _s  # noqa: F401
    from .registry import ALGORITHMS, DATASETS, GENERATORS, MODEL_GROUPS, MODELS, PARTITIONS

    from .runner import make_console

    console = make_console(wide=True)
    registries = (
        ("algorithms", ALGORITHMS), ("datasets", DATASETS), ("models", MODELS),
        ("model groups (model.group: client k trains member k mod M)", MODEL_GROUPS), ("generators", GENERATORS),
        ("partitions", PARTITIONS),
    )  # fmt: skip
    for title, reg in registries:
        table = Table(title=title, show_header=False, title_justify="left")
        for name in reg.names():
            limits = getattr(reg.get(name), "cannot_run", {}) if reg is ALGORITHMS else {}
            cannot = "".join(f" Cannot run {dataset}: {why}." for dataset, why in limits.items())
            members = f". Members: {', '.join(reg.get(name)())}" if reg is MODEL_GROUPS else ""
            table.add_row(name, reg.describe(name) + members + cannot)
        console.print(table)
    # The configurations and presets that ship with the package (fedistill/configs), with the paper each
    # preset reproduces: both are found from any directory.
    from .studies.reproduce import bundled_configs, config_summary, preset_summaries

    shipped = (
        ("configs (fedistill run --config NAME)", [(n, config_summary(p)) for n, p in bundled_configs().items()]),
        ("reproduce presets (fedistill reproduce NAME): table and paper", preset_summaries()),
        ("bench suites (fedistill bench NAME): the leaderboard protocols", _suite_summaries()),
    )  # fmt: skip
    for title, rows in shipped:
        table = Table(title=title, show_header=False, title_justify="left")
        for name, text in rows:
            table.add_row(name, text)
        console.print(table if rows else f"{title}: none found (this installation lacks its configs package data)")
    return 0


def _suite_summaries() -> list[tuple[str, str]]:
    from .studies.bench import available_suites

    return available_suites()


def _verbosity_flags() -> argparse.ArgumentParser:
    """-v / -q, accepted before or after the command."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more log messages (-vv: debug)")
    flags.add_argument("-q", "--quiet", action="count", default=argparse.SUPPRESS, help="only warnings, errors and the summary (no per-round lines)")
    flags.add_argument(
        "--plugin", action="append", default=argparse.SUPPRESS, metavar="FILE.py|MODULE",
        help="import a file or module that registers a method, dataset, model or partition of your own (repeatable)",
    )  # fmt: skip
    return flags


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (not the stream of the first call), so a
    replaced stderr (a caller's redirection, pytest's capture) is followed."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure_logging(verbose: int, quiet: int) -> None:
    """The library's loggers (``fedistill.*``): rich on a terminal, plain timestamped lines otherwise; INFO by
    default, DEBUG with -vv, WARNING with -q."""
    level = logging.WARNING if quiet else logging.DEBUG if verbose > 1 else logging.INFO
    logger = logging.getLogger("fedistill")
    logger.setLevel(level)
    if getattr(logger, "_fedistill_handler", None) is None:
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.logging import RichHandler

            handler: logging.Handler = RichHandler(console=Console(stderr=True), show_path=False)
        else:
            handler = _CurrentStderrHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
        logger._fedistill_handler = handler  # type: ignore[attr-defined]


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    flags = _verbosity_flags()
    parser = argparse.ArgumentParser(
        prog="fedistill", description="Federated learning on non-IID data through knowledge distillation.", parents=[flags]
    )
    parser.add_argument("--version", action="version", version=f"fedistill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_parser = sub.add_parser
    sub.add_parser = lambda *a, **k: _add_parser(*a, parents=[flags], **k)  # type: ignore[method-assign]
    _add_run_parser(sub)

    p = sub.add_parser("partition", help="show a partition's client x class counts and save a heatmap")
    p.add_argument("--config", "-c", help="take dataset and partition from this YAML config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    for flag, key, typ, help_text in RUN_FLAGS:
        if key.startswith(("dataset.", "partition.")) or key == "seed":
            p.add_argument(flag, dest=key, type=typ, default=None, help=f"{help_text} [{key}]")
    p.add_argument("--download", action="store_true", default=None)
    p.add_argument("--no-verify", action="store_true")
    p.add_argument(
        "--out", default="partition.png", help="heatmap file; its extension picks the format: .png, .pdf or .svg (default partition.png)"
    )
    p.add_argument("--percent", action="store_true", help="colour each client's row as a percentage of that client's samples")
    p.add_argument("--max-rows", type=int, default=30, help="clients shown in the printed matrix")

    p = sub.add_parser("compare", help="compare run directories: table and overlaid accuracy curves")
    p.add_argument("runs", nargs="+", help="run directories and seed groups (run --seeds: mean ± std over the seeds)")
    p.add_argument(
        "--out",
        help="file for the overlaid curves; its extension picks the format: .png, .pdf or .svg (default: compare.png in "
        "the current directory); the class-distribution heatmaps go beside it as NAME_class_distributions.EXT",
    )
    p.add_argument("--target", type=float, default=None, help="target accuracy in percent for rounds-to-target")

    p = sub.add_parser("reproduce", help="run a paper's table (a preset) and print our numbers beside the published ones")
    p.add_argument("preset", nargs="?", help="preset name (see `fedistill list`) or path to a preset YAML file; omit to list them")
    p.add_argument("--rounds", type=int, help="rounds per run (default: the preset's base rounds, else the paper's); more rounds later continue the runs")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (default 0)")
    p.add_argument("--methods", help="comma-separated subset of the preset's methods")
    p.add_argument("--columns", help="comma-separated subset of the preset's columns (settings)")
    p.add_argument("--out", default="reproduce", help="parent directory of the runs and tables (default reproduce/)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each a one-thread process (default 1: the run plans its own client processes)")
    p.add_argument("--data-dir", help="directory of the official dataset files [dataset.data_dir]")
    p.add_argument("--download", action="store_true", help="download missing official dataset files")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a key in every run, e.g. run.workers=2")
    p.add_argument(
        "--status", action="store_true",
        help="run nothing: list the runs finished and part way, write the tables and claims over the seeds whose every "
        "run has finished (provisional while seeds remain), and print the command that continues the rest",
    )  # fmt: skip

    p = sub.add_parser("bench", help="run a suite (every method x settings x seeds on one protocol) and write its leaderboard")
    p.add_argument("suite", nargs="?", help="suite name (see `fedistill list`) or path to a suite YAML file; omit to list them")
    p.add_argument("--out", default="bench", help="parent directory of the cells and the leaderboard (default bench/)")
    p.add_argument("--jobs", type=int, default=1, help="cells run at once, each a one-thread process (default 1)")
    p.add_argument("--cells", action="store_true", help="list the cells with their numbers and states; run nothing")
    p.add_argument("--cell", type=int, help="run only cell N (a SLURM array task), then write the leaderboard of what finished")
    p.add_argument("--ray", metavar="ADDRESS", help="run the cells as Ray tasks on the cluster at ADDRESS (`local`: start Ray here); --out must be shared")
    p.add_argument("--data-dir", help="directory of the official dataset files [dataset.data_dir]")
    p.add_argument("--download", action="store_true", help="download missing official dataset files")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a key in every cell")
    p.add_argument("--methods", metavar="NAME[,NAME]", help="run only these methods' cells (a --plugin method too) and rank them against the suite's published cells")
    p.add_argument("--published", metavar="CELLS.json", help="with --methods: the published cells (default: the ones that ship with fedistill, benchmarks/leaderboards/SUITE/cells.json in the repository)")
    p.add_argument("--update-published", action="store_true", help="with --methods: also write the whole leaderboard (and its cells.json) with these methods' new cells in place of their published ones, every other method's as published: to publish a method re-run after its defaults changed")

    sub.add_parser("list", help="list algorithms, datasets, models, generators, partitions, shipped configs, reproduce presets and bench suites")
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's scancel, timeout or pre-emption), raised where the main thread is."""


def _raise_terminated(signum: int, frame: Any) -> None:
    from .engine.interrupts import raise_or_hold

    raise_or_hold(_Terminated())  # held while the worker pool's bookkeeping runs (engine/interrupts.py)


def main(argv: Sequence[str] | None = None) -> int:
    import signal

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # reproduce --status prints it back, less --status
    args.verbose, args.quiet = getattr(args, "verbose", 0), getattr(args, "quiet", 0)
    configure_logging(args.verbose, args.quiet)
    handlers = {
        "run": cmd_run, "partition": cmd_partition, "compare": cmd_compare, "list": cmd_list, "reproduce": cmd_reproduce,
        "bench": cmd_bench,
    }  # fmt: skip
    # SIGTERM takes the Ctrl-C path: the round in progress is abandoned, run.log notes it, the worker pool is
    # shut down (the default action killed this process alone and left the workers running), exit 143.
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if _in_main_thread() else None
    try:
        from .plugins import add_plugins

        add_plugins(getattr(args, "plugin", []))  # before any config is read: their names must be known
        return handlers[args.command](args)
    except TrainingDiverged as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except FedistillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        terminated = isinstance(exc, _Terminated) or isinstance(exc.__context__, _Terminated) or isinstance(exc.__cause__, _Terminated)
        what = "terminated" if terminated else "interrupted"
        hint = exc.hint if isinstance(exc, RunInterrupted) else "no run had started, so there is nothing to continue"
        if args.command in ("reproduce", "bench"):
            hint = f"run the same fedistill {args.command} command again to continue (finished runs are kept, the interrupted one resumes)"
            if args.command == "reproduce":
                hint += "; add --status to it to see where the runs stand and the claims over the seeds finished"
        print(f"{what}: {hint}", file=sys.stderr)
        return 143 if terminated else 130
    except BrokenPipeError:
        # The reader of our output went away (`fedistill bench SUITE --cells | head`): not an error of ours.
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        # A file the command had to write or read failed (a full disk, a vanished directory, no permission).
        if args.verbose > 1:
            raise
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        print(f"error: {where}{exc.strerror or exc} (-vv shows where)", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
