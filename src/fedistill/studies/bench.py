"""``fedistill bench SUITE``: every method on one protocol, and a leaderboard (issue 28).

A suite (``configs/bench/*.yaml``, shipped as ``fedistill/configs/bench``; ``fedistill list`` names them) is one
protocol (``protocol``: a config tree with the dataset, model, rounds, local training, clients and sampling),
a few ``settings`` (config fragments, typically partitions), the ``methods`` (each a config fragment with its
card parameters; left out, every registered method with its card defaults) and the ``seeds``. A cell is one
(setting, method, seed); its run directory is ``<out>/<suite>/<setting>/<method>/seed<s>``, the layout of
``fedistill reproduce``, so a bench is resumable the same way: a finished cell is reused, an interrupted one
resumes from its checkpoint, a cell whose configuration changed is refused.

A method that cannot run a setting (its configuration is refused, e.g. FedAvg with heterogeneous client
models) is a cell with a reason, shown as n/a in the leaderboard, never an error that stops the bench.

``--jobs N`` runs N cells at once, each a one-thread process (engine/cores.py ``job_overrides``; never more
jobs than usable cores); ``--cells`` lists the cells with their numbers and states, ``--cell N`` runs one (a
SLURM array job, benchmarks/slurm_bench.sh). After running, the leaderboard of every finished cell is
written as ``leaderboard.md``, ``leaderboard.csv`` and ``leaderboard.json`` in ``<out>/<suite>/``: per
setting, the methods ranked by final accuracy (mean ± std over seeds), with the best accuracy, rounds to
the suite's target, MB per round and seconds per round.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from ..errors import ConfigError
from ..fileio import atomic_write
from .bench_results import FLOPS_FILE, leaderboard_rows, suite_claim_rows, write_leaderboard
from ..engine.flops import best_bf16_peak, counted_flops, measure_bf16_peak
from .reproduce import ClaimSpec, ColumnSpec, StrictModel, method_dir_name, read_model_file

__all__ = [
    "Suite", "Cell", "load_suite", "available_suites", "suite_cells", "bench", "leaderboard_rows", "suite_claim_rows", "write_leaderboard",
]  # fmt: skip

SUITE_DIR = "configs/bench"
NOT_APPLICABLE = "not_applicable.txt"  # in a cell's directory: why the method cannot run this setting

SettingSpec = ColumnSpec  # a setting is a reproduce column: a label and a config fragment


class BenchMethod(StrictModel):
    config: dict[str, Any] = Field(default_factory=dict)
    per_setting: dict[str, dict[str, Any]] = Field(default_factory=dict)


class Suite(StrictModel):
    name: str
    title: str
    description: str = ""
    protocol: dict[str, Any]
    settings: dict[str, SettingSpec]
    methods: dict[str, BenchMethod] | None = None  # None: every registered method, card defaults
    # With methods left out: what the suite changes from a method's card defaults (a narrower generator, a
    # smaller server model, to fit the suite's budget), by registered name, applied over the card's settings.
    method_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    target_accuracy: float | None = Field(None, gt=0, le=100)
    notes: list[str] = Field(default_factory=list)
    # The papers' comparative claims to test on the suite's cells (methods by their suite names, columns by
    # setting), as in a reproduce preset: the leaderboard says beside its tables whether each holds here.
    claims: list[ClaimSpec] = Field(default_factory=list)

    def parsed_claims(self):
        from ..report.claims import parse_claims

        return parse_claims(self.claims)

    def method_specs(self) -> dict[str, BenchMethod]:
        if self.methods is not None:
            return self.methods
        from .. import algorithms as _algorithms  # noqa: F401  (registers the methods)
        from ..registry import ALGORITHMS

        return {name: BenchMethod(config={"algorithm": {"name": name}}) for name in sorted(ALGORITHMS)}

    def all_notes(self) -> list[str]:
        """The suite's notes, then one line per method whose card defaults the suite changed (method_settings)."""

        def leaves(tree: dict[str, Any], prefix: str = "") -> list[str]:
            out = []
            for key, value in tree.items():
                out += leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [f"{prefix}{key}={value}"]
            return out

        changed = [f"{name} departs from its card defaults here: {', '.join(leaves(fragment))}." for name, fragment in self.method_settings.items()]
        return [*self.notes, *changed]

    def card_settings(self, tree: dict[str, Any]) -> dict[str, Any]:
        """With every method on its card defaults (``methods`` left out), what a method needs where the protocol
        does not suit it wins over the protocol (``Algorithm.config_defaults``: pFedMe's momentum-free steps, the
        split client models and server model of FedGKT, FedDKC and FedICT); a suite that lists its methods
        says everything itself."""
        if self.methods is not None:
            return {}
        from ..registry import ALGORITHMS

        return ALGORITHMS.get(tree["algorithm"]["name"]).config_defaults(tree)


def suite_search_path() -> list[Path]:
    """Where suite names are looked up: ./configs/bench, then the suites that ship with fedistill."""
    from ..config import bundled_configs_dir

    bundled = bundled_configs_dir()
    return [Path.cwd() / SUITE_DIR] + ([bundled / "bench"] if bundled is not None else [])


def available_suites() -> list[tuple[str, str]]:
    """(name, title) of every suite found on the search path."""
    found: dict[str, str] = {}
    for folder in suite_search_path():
        for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
            if path.stem not in found:
                try:
                    found[path.stem] = load_suite(str(path)).title
                except ConfigError as exc:
                    found[path.stem] = f"(invalid: {exc})"
    return sorted(found.items())


def load_suite(name_or_path: str) -> Suite:
    path = Path(name_or_path)
    if not path.is_file():
        candidates = [folder / f"{path.stem if path.suffix == '.yaml' else name_or_path}.yaml" for folder in suite_search_path()]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            names = ", ".join(n for n, _ in available_suites()) or "none found"
            raise ConfigError(f"bench: no suite {name_or_path!r}; choose one of: {names} (or give a path to a suite YAML file)")
    suite = read_model_file(path, Suite, f"bench: suite {path}")
    if not suite.settings:
        raise ConfigError(f"bench: suite {path}: settings is empty; name at least one setting")
    if not suite.seeds or len(set(suite.seeds)) != len(suite.seeds) or min(suite.seeds) < 0:
        raise ConfigError(f"bench: suite {path}: seeds must be distinct non-negative integers, got {suite.seeds}")
    if suite.method_settings:
        if suite.methods is not None:
            raise ConfigError(
                f"bench: suite {path}: method_settings changes card defaults when methods are left out; "
                "with methods listed, put the change in that method's config"
            )
        from .. import algorithms as _algorithms  # noqa: F401  (registers the methods)
        from ..registry import ALGORITHMS

        unknown = sorted(set(suite.method_settings) - set(ALGORITHMS.names()))
        if unknown:
            raise ConfigError(f"bench: suite {path}: method_settings names unknown methods {unknown} (see `fedistill list`)")
    for method, spec in (suite.methods or {}).items():
        unknown = sorted(set(spec.per_setting) - set(suite.settings))
        if unknown:
            raise ConfigError(f"bench: suite {path}: method {method} names unknown settings {unknown}")
    from ..report.claims import parse_claims

    parse_claims(suite.claims, list(suite.method_specs()), list(suite.settings), f"bench: suite {path}", "settings", "suite")
    return suite


@dataclass
class Cell:
    """One (setting, method, seed) of a suite: its run directory, and its config or why it cannot run."""

    index: int
    setting: str
    method: str
    seed: int
    path: Path
    config: Any = None  # fedistill.config.Config
    why_not: str | None = None  # the refusal of a method that cannot run this setting
    _finished: Any = None  # its RunResult once finished (read by result())
    # A cell taken from the published cells.json instead of a run directory (bench --methods --update-published):
    # its record, and the environment it names.
    published: dict[str, Any] | None = None
    published_environment: dict[str, Any] | None = None

    def result(self):
        """The finished cell's numbers (reproduce's RunResult), or None while it is not finished; a finished
        cell's files are read once (the progress line, the leaderboard and the figures all ask)."""
        if self._finished is None:
            self._finished = _cell_result(self)
        return self._finished

    def state(self) -> str:
        """n/a, done, partial (resumable) or todo."""
        if self.published is not None:
            status = self.published.get("status")
            if status == "n/a":
                self.why_not = self.published.get("why") or "n/a in the published cells"
                return "n/a"
            return "done" if status in ("finished", "diverged") else "todo"
        if self.why_not is None and (self.path / NOT_APPLICABLE).is_file():
            self.why_not = (self.path / NOT_APPLICABLE).read_text().strip()  # refused when it was set up
        if self.why_not is not None:
            return "n/a"
        summary = self.path / "summary.json"
        if summary.is_file():
            try:
                saved = json.loads(summary.read_text())
            except (OSError, ValueError):
                saved = {}
            # finished with the suite's rounds (a suite asking for more rounds continues the cell), or diverged
            if saved.get("status") == "diverged" or (saved.get("status") == "finished" and saved.get("rounds", 0) >= self.config.rounds):
                return "done"
        return "partial" if (self.path / "config.yaml").is_file() else "todo"


def suite_cells(suite: Suite, root: Path, overrides: list[str] | None = None) -> list[Cell]:
    """Every cell of the suite in a fixed order (setting, method, seed), each validated before any runs."""
    from .reproduce import _merge
    from ..config import build_config

    cells = []
    for setting, setting_spec in suite.settings.items():
        for method, spec in suite.method_specs().items():
            tree = _merge(_merge(_merge(suite.protocol, setting_spec.config), spec.config), spec.per_setting.get(setting, {}))
            card = suite.card_settings(tree)
            protocol_model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
            card_model = card.get("model") if isinstance(card.get("model"), dict) else {}
            if "name" in card_model and card_model["name"] != protocol_model.get("name") and "kwargs" not in card_model:
                # The method swaps the protocol's model for its own (FedGKT's split fd_resnet8): the protocol's
                # model.kwargs (e.g. a narrower cnn) were options of the model it no longer uses.
                tree = {**tree, "model": {k: v for k, v in protocol_model.items() if k != "kwargs"}}
            tree = _merge(tree, card)
            if method in suite.method_settings:  # the suite's stated departures from the card
                tree = _merge(tree, suite.method_settings[method])
            for seed in suite.seeds:
                path = root / setting / method_dir_name(method) / f"seed{seed}"
                cell = Cell(len(cells), setting, method, seed, path)
                try:
                    cell.config = build_config({**tree, "seed": seed}, overrides or [])
                except ConfigError as exc:
                    cell.why_not = str(exc)
                cells.append(cell)
    return cells




def count_round_flops(config_tree: dict[str, Any]) -> dict[str, Any]:
    """The floating-point operations of the cell's first round (clients and server, evaluation included),
    counted with ``torch.utils.flop_counter.FlopCounterMode`` on a one-round, one-process copy of the run.
    Only the operations it has formulas for (matmul, convolution, attention: the bulk of the work) count."""
    import torch

    from ..config import build_config
    from ..runner import load_dataset_for
    from ..simulation import Simulation

    cfg = build_config({**config_tree, "rounds": 1, "run": {**config_tree.get("run", {}), "workers": 1, "checkpoint_every": 0}})
    simulation = Simulation(cfg, load_dataset_for(cfg))
    try:
        return {"flops_per_round": counted_flops(simulation.run), "torch": torch.__version__}
    finally:
        simulation.close()


def _counts_in_run(config_tree: dict[str, Any]) -> bool:
    """Whether the run's own round 1 is the round :func:`count_round_flops` counts: evaluated (the one-round
    copy always is) and trained in this process (the counter sees no worker process)."""
    every = int(config_tree.get("eval", {}).get("every", 1))
    one_process = str(config_tree.get("run", {}).get("workers", "auto")) == "1"
    return one_process and (every == 1 or int(config_tree.get("rounds", 1)) == 1)


def _has_flops(path: Path) -> bool:
    try:
        return json.loads((path / FLOPS_FILE).read_text()).get("flops_per_round") is not None
    except (OSError, ValueError, AttributeError):
        return False


def _run_cell(config_tree: dict[str, Any], path: str, count_flops: bool = False) -> tuple[str, float]:
    """Run (or resume, or reuse) one cell; in a worker process with --jobs. Returns (path, seconds). With
    ``count_flops`` (the first seed of a (setting, method)) also counts one round's FLOPs into flops.json."""
    import torch

    from ..runs import ensure_run_quietly

    def write_flops(flops: int) -> None:
        atomic_write(Path(path) / FLOPS_FILE, json.dumps({"flops_per_round": flops, "torch": torch.__version__, "counted": "in the run"}))

    # Counted inside the run's own round 1 when that round is the one count_round_flops would count (it is
    # evaluated): no second copy of the round. That round's seconds are then left out of the cell's s/round.
    in_run = count_flops and not _has_flops(Path(path)) and _counts_in_run(config_tree)
    start = time.perf_counter()
    try:
        try:
            ensure_run_quietly(config_tree, path, write_flops if in_run else None)
        except ConfigError:
            raise
        except Exception:
            if not in_run or _has_flops(Path(path)):
                raise  # not the counter's doing: round 1 was counted, or nothing was counted
            # A counter that cannot follow the method must not cost the cell: the run continues without it (from
            # its last checkpoint, or from round 1), and the one-round copy below records why the count is missing.
            ensure_run_quietly(config_tree, path)
    except ConfigError as exc:
        # Refused while the run was set up (a model the method cannot split, ...): n/a with the reason, kept
        # so that later benches skip it; a configuration that changed is the user's to resolve, not n/a.
        if "holds a run with another configuration" in str(exc):
            raise
        Path(path).mkdir(parents=True, exist_ok=True)
        atomic_write(Path(path) / NOT_APPLICABLE, f"{exc}\n")
        return path, time.perf_counter() - start
    seconds = time.perf_counter() - start
    if count_flops and not _has_flops(Path(path)):
        try:
            counted = count_round_flops(config_tree)
        except Exception as exc:  # a counter that cannot follow a method is a missing number, not a failed cell
            counted = {"flops_per_round": None, "error": f"{type(exc).__name__}: {exc}"}
        atomic_write(Path(path) / FLOPS_FILE, json.dumps(counted))
    return path, seconds


def bench(
    suite: Suite,
    out_dir: Path,
    jobs: int = 1,
    only: list[int] | None = None,
    overrides: list[str] | None = None,
    console=None,
    ray_address: str | None = None,
    methods: list[str] | None = None,
    published: Path | None = None,
    update_published: bool = False,
) -> list[dict[str, Any]]:
    """Run the suite's cells (all, or those numbered in ``only``), ``jobs`` at a time (or as Ray tasks on the
    cluster at ``ray_address``; ``local`` starts one on this machine), then write and return the leaderboard
    of every finished cell. With ``methods``: only their cells, ranked against the published cells instead
    (``published``, else the cells that ship with fedistill, fedistill/leaderboards/SUITE/cells.json; bench_rank.py).
    With ``update_published`` as well: the whole leaderboard too (md, csv, json, html, figures, claims.json and
    cells.json), with those methods' new cells in place of their published ones and every other method's cells as
    published, so that a method re-run under a changed default is published without re-running the suite."""
    from ..runner import make_console

    console = console or make_console(wide=True)
    from ..engine.cores import job_overrides, override_keys

    if update_published and methods is None:
        raise ConfigError("bench: update_published needs methods (the methods whose cells replace the published ones)")

    # One-thread, one-process cells, however many run at once: the leaderboard's % of peak is per thread, and a
    # cell's numbers do not depend on --jobs. (Ray places cells on its own cluster's CPUs: no local core check.)
    overrides = job_overrides("bench", jobs, overrides or [], one_process_runs=True, check_cores=ray_address is None)
    if "run.threads" not in override_keys(overrides):
        overrides.append("run.threads=1")
    threads = next(o.split("=", 1)[1].strip() for o in reversed(overrides) if o.split("=", 1)[0].strip() == "run.threads")
    overrides += ["run.progress=false"]
    root = Path(out_dir) / suite.name
    published_cells = None
    if methods is not None:  # only these methods' cells, ranked against the published ones (bench_rank.py)
        from .bench_rank import check_protocol, load_published, with_methods

        suite = with_methods(suite, methods, BenchMethod)
        published_cells = load_published(suite, published)  # before anything runs: a missing file stops here
    cells = suite_cells(suite, root, overrides)
    if published_cells is not None:
        cells = [c for c in cells if c.method in methods]
        check_protocol(cells, published_cells)
    if only is not None:
        bad = [i for i in only if not 0 <= i < len(cells)]
        if bad:
            raise ConfigError(f"bench --cell: {', '.join(map(str, bad))} not in 0..{len(cells) - 1} (fedistill bench {suite.name} --cells lists them)")
    _refuse_changed_cells(cells)
    chosen = [cells[i] for i in only] if only is not None else cells
    first_seed = suite.seeds[0]
    # A finished first-seed cell whose FLOPs are missing (or could not be counted by an earlier version) is
    # visited again: the run is reused, only the one-round count runs.
    todo = [c for c in chosen if c.why_not is None and (c.state() != "done" or (c.seed == first_seed and not _has_flops(c.path)))]
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"bench --out {out_dir}: cannot create {root} ({exc.strerror or exc}); choose another --out") from None
    console.print(
        f"[bold]{suite.name}[/]: {len(cells)} cells ({sum(c.why_not is not None for c in cells)} n/a), "
        f"{len(todo)} to run, {jobs} at a time with {threads} thread(s) each -> {root}"
    )
    started, durations, waiting = time.perf_counter(), [], {c.index: c.method for c in todo}

    def finished(cell: Cell, seconds: float, done: int) -> None:
        durations.append((cell.method, seconds))
        waiting.pop(cell.index, None)
        eta = estimate_remaining(durations, list(waiting.values()), jobs)
        console.print(
            f"cell {cell.index} {cell.setting} / {cell.method} / seed {cell.seed}: {_final_text(cell)} in {seconds:.0f} s "
            f"({done}/{len(todo)}; ETA {_duration(eta)})",
            highlight=False,
        )

    if ray_address is not None:
        for i, (cell, seconds) in enumerate(_run_on_ray(todo, ray_address, int(threads), first_seed), 1):
            finished(cell, seconds, i)
    elif jobs == 1:
        for i, cell in enumerate(todo, 1):
            _, seconds = _run_cell(cell.config.resolved_dict(), str(cell.path), cell.seed == first_seed)
            finished(cell, seconds, i)
    elif todo:
        from concurrent.futures import as_completed

        from ..engine.processes import run_pool
        from ..engine.interrupts import uninterrupted

        with run_pool(jobs) as pool:  # an interrupted bench stops its cells; they resume from their checkpoints
            with uninterrupted():
                futures = {pool.submit(_run_cell, c.config.resolved_dict(), str(c.path), c.seed == first_seed): c for c in todo}
            for i, future in enumerate(as_completed(futures), 1):
                _, seconds = future.result()
                finished(futures[future], seconds, i)
    if published_cells is not None:
        from .bench_rank import with_published_cells, write_ranking

        ranked = write_ranking(suite, published_cells, cells, root, console)
        if not update_published:
            return ranked
        cells = with_published_cells(suite_cells(suite, root, overrides), published_cells, methods or [])
    # Against the rate of the threads a cell has (one, unless --set run.threads=N): two cells side by side each
    # hold one core, so the all-core rate (2x on two cores) would halve every cell's share of what it could use.
    cell_threads = int(threads)
    known, peak = False, None
    if update_published:  # the published leaderboard's own peak: the published rows keep their % of peak
        from .bench_rank import published_peak

        known, peak = published_peak(suite.name, published, cell_threads)
    if not known:  # None where bf16 is not in this machine's hardware (engine/flops.py)
        peak = best_bf16_peak(root, measure_bf16_peak(cell_threads), cell_threads)
    rows = leaderboard_rows(suite, cells, peak, cell_threads)
    claims = suite_claim_rows(suite, cells)
    write_leaderboard(suite, rows, root, cells, claims, published_cells if update_published else None)
    console.print(f"leaderboard: {root / 'leaderboard.md'} (and .csv, .json, .html) after {_duration(time.perf_counter() - started)}")
    if claims:
        from ..report.claims import print_claims

        print_claims(console, claims, root, where="beside the tables in leaderboard.md and .html")
    return rows


def _run_on_ray(todo: list[Cell], address: str, threads: int, first_seed: int):
    """Each cell a Ray task asking for ``threads`` CPUs; yields (cell, seconds) as they finish. The cells'
    directories must be on a filesystem every node sees (the same path); plugins travel in the tasks'
    environment ($FEDISTILL_PLUGINS)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("bench --ray: Ray is not installed; install it with `pip install 'fedistill[ray]'` (or `pip install ray`)") from None
    from ..plugins import PLUGIN_ENV

    env = {PLUGIN_ENV: os.environ.get(PLUGIN_ENV, "")}
    started_here = not ray.is_initialized()
    if started_here:
        try:
            local = {"include_dashboard": False} if address == "local" else {}  # the dashboard costs a core for a minute
            ray.init(address=None if address == "local" else address, runtime_env={"env_vars": env}, log_to_driver=False, **local)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(f"bench --ray {address}: cannot connect ({exc}); start the cluster with `ray start --head`, or use --ray local") from None
    try:
        task = ray.remote(num_cpus=threads)(_run_cell)
        pending = {task.remote(c.config.resolved_dict(), str(c.path.resolve()), c.seed == first_seed): c for c in todo}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            cell = pending.pop(done[0])
            _, seconds = ray.get(done[0])
            yield cell, seconds
    finally:
        if started_here:
            ray.shutdown()


def _refuse_changed_cells(cells: list[Cell]) -> None:
    """Before anything runs: a cell directory holding a run of another configuration (the suite or --set
    changed) is refused, finished or not, so the leaderboard never mixes two protocols."""
    from ..runs import run_state

    for cell in cells:
        if cell.why_not is None:
            run_state(cell.config, cell.path, "bench")  # the one comparison reproduce makes too


def estimate_remaining(durations: list[tuple[str, float]], methods_left: list[str], jobs: int) -> float:
    """Seconds until the cells of ``methods_left`` (one entry per unfinished cell) are done, ``jobs`` at a time:
    each cell is expected to take the mean of its method's finished cells, or of all finished cells while its
    method has none. Per method because the suite's methods differ twentyfold (FedAvg against the FD family), so
    one mean over everything swings with whichever method ran last."""
    if not durations:
        return 0.0
    by_method: dict[str, list[float]] = {}
    for method, seconds in durations:
        by_method.setdefault(method, []).append(seconds)
    overall = statistics.fmean(seconds for _, seconds in durations)
    expected = sum(statistics.fmean(by_method[m]) if m in by_method else overall for m in methods_left)
    return expected / jobs


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _final_text(cell: Cell) -> str:
    if cell.state() == "n/a":
        return f"n/a ({cell.why_not})"
    result = cell.result()
    if result is None or result.final is None:
        return "no result"
    return f"diverged after round {result.diverged_after}" if result.diverged_after else f"final {result.final:.2f} %"


def _cell_result(cell: Cell):
    """The finished cell's numbers (reproduce's RunResult), or None."""
    if cell.published is not None:
        from .bench_rank import published_result

        return published_result(cell)
    if cell.why_not is not None or not (cell.path / "config.yaml").is_file():
        return None
    from .reproduce import run_result
    from ..runs import read_saved

    _, rows, summary = read_saved(cell.path)
    if summary.get("status") not in ("finished", "diverged"):
        return None
    return run_result(cell.config, cell.setting, cell.method, cell.seed, rows[: cell.config.rounds], summary.get("status") == "diverged")


def list_cells(suite: Suite, out_dir: Path, overrides: list[str] | None = None) -> list[Cell]:
    """``--cells``: one tab-separated line per cell, never wrapped (scripts read it): number, setting, method,
    seed and state (n/a with its reason)."""
    cells = suite_cells(suite, Path(out_dir) / suite.name, overrides)
    for c in cells:
        state = c.state()
        reason = f"  ({c.why_not})" if c.why_not else ""
        print(f"{c.index}\t{c.setting}\t{c.method}\tseed {c.seed}\t{state}{reason}")
    return cells
