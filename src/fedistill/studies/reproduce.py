"""``fedistill reproduce``: run the methods of a published table and print our numbers beside the paper's.

A preset (``configs/reproduce/*.yaml``, shipped in the package as ``fedistill/configs/reproduce``) describes
one table: a base configuration (the paper's protocol), columns (settings such as "MNIST shards s=2"),
methods (each a config fragment, with per-column hyperparameters such as the paper's tuned values), and the
published numbers. Every (column, method, seed) is an ordinary run directory under
``<out>/<preset>/<column>/<method>/seed<s>``, so the harness is resumable: a finished run is reused, an
interrupted one is resumed, and asking for more rounds continues the existing runs (resume allows
``rounds`` to grow). The table is written as Markdown and CSV.

Metrics follow experiments-fedlmd.md §4: the reported accuracy is the best test accuracy over the rounds
run; the speedup is ``r_ref / r_method`` where ``r_X`` is the first round at which X reaches the reference
method's (FedAvg's) best accuracy of the same seed. A method that never reaches it has no speedup (the paper
prints 1.00× there; we print "n/r", not reached).
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import load_yaml
from ..config import bundled_configs, bundled_configs_dir, build_config, find_config  # noqa: F401  (re-exported)
from ..errors import ConfigError
from ..engine.flops import FLOPS_COUNTED_KEY
from ..engine.pauses import PAUSED_KEY
from .reproduce_tables import print_table, write_tables
from ..runs import ensure_run, read_saved, run_in_parallel, run_state

PRESET_DIR = "configs/reproduce"


class StrictModel(BaseModel):
    """A preset's (or a bench suite's) section: unknown keys are errors, not ignored typos."""

    model_config = ConfigDict(extra="forbid")


class ColumnSpec(StrictModel):
    label: str
    config: dict[str, Any] = Field(default_factory=dict)


class MethodSpec(StrictModel):
    config: dict[str, Any] = Field(default_factory=dict)
    per_column: dict[str, dict[str, Any]] = Field(default_factory=dict)


class Published(StrictModel):
    accuracy: float | None = None
    speedup: float | None = None
    note: str | None = None  # "Failed", "not in the paper", ...


class ClaimSpec(StrictModel):
    """A claim to test over seeds (report/claims.py): ``claim: "FedICT > FedDKC > FedGKT"``."""

    claim: str
    metric: str = "final"
    margin: float | None = None  # "~" claims: the equivalence margin in the metric's units
    columns: list[str] | None = None  # default: every column
    paper: str | None = None  # where the paper claims it (table, section)
    note: str | None = None


class Preset(StrictModel):
    name: str
    title: str
    source: str
    reference_method: str = "FedAvg"
    paper_rounds: int
    base: dict[str, Any]
    columns: dict[str, ColumnSpec]
    methods: dict[str, MethodSpec]
    published: dict[str, dict[str, Published]] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    claims: list[ClaimSpec] = Field(default_factory=list)

    def parsed_claims(self):
        from ..report.claims import parse_claims

        return parse_claims(self.claims)


def preset_search_path() -> list[Path]:
    """Where preset names are looked up: ./configs/reproduce, then the presets that ship with fedistill."""
    bundled = bundled_configs_dir()
    return [Path.cwd() / PRESET_DIR] + ([bundled / "reproduce"] if bundled is not None else [])


def config_summary(path: Path) -> str:
    """One line on a shipped configuration: its algorithm, dataset, partition, clients and rounds."""
    from ..config import Config

    try:
        cfg = Config.model_validate(load_yaml(path.read_text()) or {})
    except (OSError, yaml.YAMLError, ValidationError, ConfigError) as exc:
        return f"not loadable ({exc.__class__.__name__})"
    p = cfg.partition
    return (
        f"{cfg.algorithm.name} on {cfg.dataset.name}, {p.scheme} partition over {p.num_clients} clients "
        f"({cfg.clients_per_round} per round), {cfg.rounds} rounds"
    )


def preset_summaries() -> list[tuple[str, str]]:
    """(name, "title. source") of every preset ``reproduce NAME`` finds (the source cites the paper); a broken
    one says why it cannot be loaded."""
    out = []
    for name in available_presets():
        try:
            preset = load_preset(name)
        except ConfigError as exc:
            out.append((name, f"not loadable: {exc}"))
        else:
            out.append((name, f"{preset.title}. {preset.source}"))
    return out


def available_presets() -> list[str]:
    names: set[str] = set()
    for folder in preset_search_path():
        if folder.is_dir():
            names.update(p.stem for p in folder.glob("*.yaml"))
    return sorted(names)


def read_model_file(path: Path, model: type[BaseModel], what: str):
    """A YAML file validated as ``model``; one line for a binary file, a YAML error (with its line and column)
    or the first invalid key, as for --config."""
    from ..config import parse_yaml_text
    from ..report.rundir import _read_text

    data = parse_yaml_text(path, _read_text(path), what=what)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(f"{what}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def load_preset(name_or_path: str) -> Preset:
    path = Path(name_or_path)
    if not path.is_file():
        # A name, or the repository's spelling configs/reproduce/NAME.yaml of a shipped preset.
        parts = path.parts[2:] if path.parts[:2] == tuple(Path(PRESET_DIR).parts) else path.parts
        name = parts[0][: -len(".yaml")] if len(parts) == 1 and parts[0].endswith(".yaml") else name_or_path
        candidates = [folder / f"{name}.yaml" for folder in preset_search_path()]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            raise ConfigError(
                f"reproduce: no preset {name_or_path!r}; choose one of: {', '.join(available_presets()) or 'none found'} "
                f"(or give a path to a preset YAML file)"
            )
    preset = read_model_file(path, Preset, f"reproduce: preset {path}")
    for method, spec in preset.methods.items():
        unknown = set(spec.per_column) - set(preset.columns)
        if unknown:
            raise ConfigError(f"reproduce: preset {path}: method {method} names unknown columns {sorted(unknown)}")
    if preset.reference_method not in preset.methods:
        raise ConfigError(f"reproduce: preset {path}: reference method {preset.reference_method} is not among its methods")
    from ..report.claims import parse_claims

    parse_claims(preset.claims, list(preset.methods), list(preset.columns), f"reproduce: preset {path}")
    return preset


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _override_keys(overrides: list[str] | dict[str, Any]) -> list[str]:
    if isinstance(overrides, dict):
        return [str(k).strip() for k in overrides]
    return [str(o).split("=", 1)[0].strip() for o in overrides]


def _algorithm_parameters(preset: Preset, method: str, columns: list[str]) -> set[str] | None:
    """The parameters (``algorithm.KEY``) that ``method``'s algorithm accepts in every one of ``columns``; None when
    its algorithm cannot be named here (an unknown name: :func:`run_config` then reports it)."""
    from .. import algorithms as _algorithms  # noqa: F401  (registers the algorithms: a fresh `reproduce` has none yet)
    from ..registry import ALGORITHMS

    accepted: set[str] | None = None
    for column in columns:
        algorithm = _method_tree(preset, column, method).get("algorithm", {})
        name = algorithm if isinstance(algorithm, str) else algorithm.get("name")
        try:
            fields = set(ALGORITHMS.get(name, key="algorithm.name").Params.model_fields)
        except ConfigError:
            return None
        accepted = fields if accepted is None else accepted & fields
    return accepted


def method_overrides(
    preset: Preset, methods: list[str], columns: list[str], overrides: list[str], console=None
) -> dict[str, list[str]]:
    """Each method's ``--set`` values. A method parameter (``algorithm.KEY``) goes to the selected methods whose
    algorithm has it, so that a variant of one method can be run beside the reference, whose algorithm (FedAvg)
    has no such key; which methods took it is printed. Nobody having it is an error; every other key goes to
    every method."""
    taken: dict[str, list[str]] = {m: [] for m in methods}
    parameters = {m: _algorithm_parameters(preset, m, columns) for m in methods}
    for override, key in zip(overrides, _override_keys(overrides)):
        parts = key.split(".")
        if len(parts) != 2 or parts[0] != "algorithm" or parts[1] in ("name", "plus"):
            for m in methods:
                taken[m].append(override)
            continue
        takers = [m for m in methods if parameters[m] is None or parts[1] in parameters[m]]
        if not takers:
            raise ConfigError(
                f"reproduce --set {key}: none of the selected methods ({', '.join(methods)}) has the parameter "
                f"{parts[1]!r}; `fedistill list` and docs/methods.md list each method's parameters"
            )
        for m in takers:
            taken[m].append(override)
        if len(takers) < len(methods) and console is not None:
            others = [m for m in methods if m not in takers]
            console.print(f"--set {key}: applied to {', '.join(takers)}; not to {', '.join(others)} (no such parameter)")
    return taken


def _method_tree(preset: Preset, column: str, method: str) -> dict[str, Any]:
    """One method's config tree in one column: the base, the column's, the method's, its per-column values."""
    spec = preset.methods[method]
    tree = _merge(preset.base, preset.columns[column].config)
    tree = _merge(tree, spec.config)
    return _merge(tree, spec.per_column.get(column, {}))


def run_config(preset: Preset, column: str, method: str, seed: int, rounds: int, overrides: list[str] | dict[str, Any]):
    """The validated Config of one (column, method, seed) run."""
    tree = _method_tree(preset, column, method)
    tree["seed"] = seed
    tree["rounds"] = rounds
    try:
        return build_config(tree, overrides)
    except ConfigError as exc:
        raise ConfigError(f"reproduce {preset.name} [{column} / {method}]: {exc}") from None


@dataclass
class RunResult:
    column: str
    method: str
    seed: int
    accuracies: list[tuple[int, float]]  # (round, test accuracy) for the rounds asked for
    seconds_per_round: float | None
    diverged_after: int | None = None  # the last good round of a run that diverged (the paper's "Failed")
    bytes_per_round: float | None = None  # down + up, all clients, mean over the rounds asked for
    weight_exchange_bytes_per_round: float | None = None  # what sending the same clients' weights would cost

    @property
    def best(self) -> float | None:
        return max((a for _, a in self.accuracies), default=None)

    @property
    def final(self) -> float | None:
        return self.accuracies[-1][1] if self.accuracies else None

    def first_round_reaching(self, level: float) -> int | None:
        return next((r for r, a in self.accuracies if a >= level), None)


def method_dir_name(name: str) -> str:
    """A method's (or setting's) directory name: its display name without slashes or spaces."""
    return name.replace("/", "_").replace(" ", "_")


def run_result(cfg, column: str, method: str, seed: int, rows: list[dict[str, Any]], diverged: bool) -> RunResult:
    """A run's metric rows (at most ``cfg.rounds``) as the numbers the tables use."""
    key = "personal_accuracy" if cfg.accuracy_metric() == "personal" else "test_accuracy"
    accuracies = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
    # A round run under the FLOP counter (the bench's first seed, engine/flops.py) paid the counter's overhead; a
    # round the process was stopped in (engine/pauses.py) counted the stop.
    seconds = [r["seconds"] for r in rows
               if r.get("seconds") is not None and not r.get(FLOPS_COUNTED_KEY) and not r.get(PAUSED_KEY)]
    traffic = [r["bytes_down"] + r["bytes_up"] for r in rows]
    weights = [r["bytes_weight_exchange"] for r in rows if r.get("bytes_weight_exchange")]
    return RunResult(
        column, method, seed, accuracies, statistics.fmean(seconds) if seconds else None,
        diverged_after=len(rows) if diverged else None,
        bytes_per_round=statistics.fmean(traffic) if traffic else None,
        weight_exchange_bytes_per_round=statistics.fmean(weights) if len(weights) == len(rows) and rows else None,
    )  # fmt: skip


def reproduce(
    preset: Preset,
    out_dir: Path,
    rounds: int | None = None,
    seeds: list[int] | None = None,
    methods: list[str] | None = None,
    columns: list[str] | None = None,
    overrides: list[str] | None = None,
    console=None,
    jobs: int = 1,
    status: bool = False,
    continue_command: str | None = None,
) -> list[dict[str, Any]]:
    """Run (or reuse) every selected run, ``jobs`` at a time (each a one-thread process, engine/cores.py
    ``job_overrides``), then write and return the comparison table rows.

    ``status``: run nothing; report which runs have finished and write the tables and claims over the seeds whose
    every run has (:func:`report_finished`), with ``continue_command`` as the line that continues the rest."""
    from ..runner import make_console

    console = console or make_console(wide=True)
    from ..report.groups import check_seeds

    from ..engine.cores import job_overrides

    asked = list(overrides or [])  # the user's --set values, before the job settings below
    overrides = job_overrides("reproduce", jobs, asked)
    if jobs > 1:
        overrides.append("run.progress=false")  # one line per finished run instead of interleaved bars

    # A reduced preset states its own rounds in base (dafkd_reduced: 15 of the paper's 60); a paper preset's base
    # rounds are the paper's. Without --rounds a run has the preset's protocol, not the paper's length.
    rounds = rounds or preset.base.get("rounds") or preset.paper_rounds
    seeds = check_seeds(seeds) if seeds is not None else [0]
    # The seed and the rounds of every run come from --seeds and --rounds; a --set of either would make every
    # "seed" the same run, or the table claim rounds that did not run.
    for key in _override_keys(overrides or []):
        if key in ("seed", "rounds"):
            flag = "--seeds" if key == "seed" else "--rounds"
            raise ConfigError(f"reproduce --set {key}: reproduce sets each run's {key} itself; use {flag}")
    for name, chosen in (("--methods", methods), ("--columns", columns)):
        if chosen is not None and not chosen:
            raise ConfigError(f"reproduce {name}: empty; name at least one, or leave {name} out for all of them")
        repeated = sorted({c for c in chosen or [] if chosen.count(c) > 1})
        if repeated:
            raise ConfigError(f"reproduce {name}: {', '.join(repeated)} given more than once")
    methods = methods or list(preset.methods)
    columns = columns or list(preset.columns)
    for name, known in (("--methods", preset.methods), ("--columns", preset.columns)):
        chosen = methods if name == "--methods" else columns
        bad = [c for c in chosen if c not in known]
        if bad:
            raise ConfigError(f"reproduce {name}: {', '.join(bad)} not in preset {preset.name} (choose from: {', '.join(known)})")
    if preset.reference_method not in methods:
        methods = [preset.reference_method, *methods]  # speedups need the reference's curve
    # Validate every configuration before the first run starts. Seed by seed: a reproduce stopped part way (a
    # claim whose runs take longer than a session) leaves whole seeds, each with every column and method, and
    # the claims over the seeds finished so far can be read from them.
    per_method = method_overrides(preset, methods, columns, overrides or [], console)
    configs = {
        (c, m, s): run_config(preset, c, m, s, rounds, per_method[m]) for s in seeds for c in columns for m in methods
    }
    root = Path(out_dir) / preset.name
    changed = changed_by_set(asked, per_method)
    if status:
        return report_finished(preset, root, configs, rounds, seeds, columns, methods, console, continue_command, changed)
    try:  # before the first run: a --out that is a file or cannot be created stops here, in one line
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"reproduce --out {out_dir}: cannot create {root} ({exc.strerror or exc}); choose another --out") from None
    if jobs > 1:
        todo = [(f"{preset.columns[c].label} / {m} / seed {sd}", cfg, root / c / method_dir_name(m) / f"seed{sd}") for (c, m, sd), cfg in configs.items()]
        run_in_parallel(todo, jobs, console, preset.name, root)
    results: dict[tuple[str, str, int], RunResult] = {}
    for (column, method, seed), cfg in configs.items():
        run_path = run_directory(root, column, method, seed)
        console.print(f"[bold]{preset.name}[/]: {preset.columns[column].label} / {method} / seed {seed} -> {run_path}")
        rows, diverged = ensure_run(cfg, run_path, console)
        results[(column, method, seed)] = run_result(cfg, column, method, seed, rows, diverged)
    return tabulate_runs(preset, results, root, rounds, seeds, columns, methods, console, changed=changed)


# --set keys that say where the data is or how the run is shown, not what it computes: not listed as changes.
NOT_A_CHANGE = ("dataset.data_dir", "dataset.download", "dataset.verify", "run.progress", "run.threads", "run.workers")


def changed_by_set(asked: list[str], per_method: dict[str, list[str]]) -> list[str]:
    """The user's ``--set`` values that change what the runs compute, each with the methods it reached unless it
    reached all: the tables' setting labels are the preset's, so table.md and claims.json say what differs."""
    changed = []
    for override, key in zip(asked, _override_keys(asked)):
        if key in NOT_A_CHANGE:
            continue
        takers = [m for m, values in per_method.items() if override in values]
        changed.append(override if len(takers) == len(per_method) else f"{override} ({', '.join(takers)})")
    return changed


def tabulate_runs(preset, results, root: Path, rounds: int, seeds: list[int], columns, methods, console,
                  planned: list[int] | None = None, provisional: str | None = None,
                  changed: list[str] | None = None) -> list[dict[str, Any]]:
    """The comparison table and the claims over ``seeds`` (of the ``planned`` ones: the claims are provisional
    while fewer have finished), written under ``root`` and printed. ``changed``: the --set values the runs had
    (:func:`changed_by_set`), stated above the tables and in each claim's record."""
    table = comparison_rows(preset, results, columns, methods, seeds, rounds)
    from ..report.claims import claim_rows, print_claims

    claims = claim_rows(preset, results, columns, seeds)
    for row in claims:  # in claims.json: a verdict over 3 of 10 planned seeds is not the 10-seed verdict
        row["seeds_finished"], row["seeds_planned"] = list(seeds), list(planned or seeds)
        row["changed_by_set"] = list(changed or [])
    if changed:
        line = "**Changed by `--set`** (the setting labels below are the preset's): " + ", ".join(f"`{c}`" for c in changed) + "."
        provisional = f"{line}\n\n{provisional}" if provisional else line
        console.print(f"changed by --set: {', '.join(changed)}", highlight=False, markup=False)
    write_tables(preset, table, root, rounds, seeds, claims, provisional)
    print_table(console, preset, table, rounds, seeds, root)
    print_claims(console, claims, root)
    return table


def report_finished(preset, root: Path, configs, rounds: int, seeds: list[int], columns, methods, console,
                    continue_command: str | None = None, changed: list[str] | None = None) -> list[dict[str, Any]]:
    """``reproduce --status``: which of the selected runs have finished, which are part way (and at which round),
    which have not started; then the tables and claims over the seeds whose every selected run has finished (the
    runs go seed by seed, so a stopped claim leaves whole seeds), marked provisional while seeds remain. Nothing
    runs; a run directory holding another configuration is refused as a run would refuse it."""
    from ..runner import print_rows

    states: dict[tuple[str, str, int], str] = {}
    rounds_done: dict[tuple[str, str, int], int] = {}
    for key, cfg in configs.items():
        path = run_directory(root, *key)
        states[key] = run_state(cfg, path)
        rounds_done[key] = len(read_saved(path)[1]) if states[key] == "partial" else 0
    finished = [s for s in seeds if all(states[(c, m, s)] == "done" for c in columns for m in methods)]
    remaining = [key for key, state in states.items() if state != "done"]
    progress = {}
    for column in columns:
        for method in methods:
            done = [s for s in seeds if states[(column, method, s)] == "done"]
            part = [f"seed {s} at round {rounds_done[(column, method, s)]}/{rounds}" for s in seeds if states[(column, method, s)] == "partial"]
            progress[f"{preset.columns[column].label} / {method}"] = [
                f"{len(done)}/{len(seeds)}", ", ".join(map(str, done)) or "-", "; ".join(part) or "-"
            ]  # fmt: skip
    print_rows(console, f"{preset.name}: runs finished under {root}", ("run", "finished", "seeds", "part way"), progress)
    command = continue_command or "the same fedistill reproduce command without --status"
    left = f"{len(remaining)} of {len(states)} runs remain; continue them with: {command}" if remaining else "every run has finished"
    console.print(left, highlight=False, markup=False)
    if not finished:
        console.print(f"no seed has finished every run yet: no table or claims written (seeds {seeds})", highlight=False)
        return []
    results = {}
    for (column, method, seed), cfg in configs.items():
        if seed in finished:
            _, rows, summary = read_saved(run_directory(root, column, method, seed))
            results[(column, method, seed)] = run_result(cfg, column, method, seed, rows[: cfg.rounds], summary.get("status") == "diverged")
    provisional = None
    if remaining:
        provisional = (
            f"**Provisional**: seeds {finished} of the {len(seeds)} planned ({seeds}) have finished every run; "
            f"{len(remaining)} runs remain. Continue them with `{command}`."
        )
    return tabulate_runs(preset, results, root, rounds, finished, columns, methods, console, planned=seeds, provisional=provisional,
                         changed=changed)


def run_directory(root: Path, column: str, method: str, seed: int) -> Path:
    """Where reproduce keeps the run of (column, method, seed): ``<out>/<preset>/<column>/<method>/seed<s>``."""
    return root / column / method_dir_name(method) / f"seed{seed}"


def comparison_rows(preset, results, columns, methods, seeds, rounds) -> list[dict[str, Any]]:
    rows = []
    for column in columns:
        ref_seconds = [results[(column, preset.reference_method, s)].seconds_per_round for s in seeds]
        ref_seconds = [s for s in ref_seconds if s]
        for method in methods:
            runs = [results[(column, method, s)] for s in seeds]
            bests = [r.best for r in runs if r.best is not None]
            speedups = []
            for seed, run in zip(seeds, runs):
                ref = results[(column, preset.reference_method, seed)]
                if ref.best is None:
                    continue
                r_ref, r_method = ref.first_round_reaching(ref.best), run.first_round_reaching(ref.best)
                speedups.append(None if r_method is None else r_ref / r_method)
            reached = [s for s in speedups if s is not None]
            published = preset.published.get(column, {}).get(method, Published(note="not in the paper's table"))
            seconds = [r.seconds_per_round for r in runs if r.seconds_per_round]
            failed = [f"seed {r.seed} diverged after round {r.diverged_after}" for r in runs if r.diverged_after is not None]
            mean_seconds = statistics.fmean(seconds) if seconds else None
            finals = [r.final for r in runs if r.final is not None]
            traffic = [r.bytes_per_round for r in runs if r.bytes_per_round is not None]
            weights = [r.weight_exchange_bytes_per_round for r in runs if r.weight_exchange_bytes_per_round]
            rows.append(
                {
                    "column": column,
                    "setting": preset.columns[column].label,
                    "method": method,
                    "rounds": rounds,
                    "seeds": len(seeds),
                    "best_accuracy": statistics.fmean(bests) if bests else None,
                    "best_accuracy_std": statistics.stdev(bests) if len(bests) > 1 else None,
                    "final_accuracy": statistics.fmean(finals) if finals else None,
                    "final_accuracy_std": statistics.stdev(finals) if len(finals) > 1 else None,
                    "bytes_per_round": statistics.fmean(traffic) if traffic else None,
                    # the FD papers' communication claim: traffic against exchanging the same clients' weights
                    "bytes_vs_weight_exchange": (
                        statistics.fmean(traffic) / statistics.fmean(weights) if traffic and len(weights) == len(traffic) else None
                    ),
                    "speedup": statistics.fmean(reached) if reached else None,
                    "speedup_reached": f"{len(reached)}/{len(speedups)}",
                    "published_accuracy": published.accuracy,
                    "published_speedup": published.speedup,
                    "published_note": published.note,
                    "seconds_per_round": mean_seconds,
                    "seconds_vs_reference": mean_seconds / statistics.fmean(ref_seconds) if mean_seconds and ref_seconds else None,
                    "failed": "; ".join(failed) or None,
                }
            )
    return rows
