"""Published cells, and a method of your own ranked against them (issue 44).

A full ``fedistill bench SUITE`` writes, beside its leaderboard, ``cells.json``: every cell (setting, method, seed)
with its accuracy in every round, final / best / last-5 accuracy, MB and seconds a round, FLOPs a round, how it
ended, where it ran (CPU, torch, fedistill commit), and a fingerprint of its protocol (the cell's configuration
without the method and the seed). Committed with the leaderboard, it is what ``bench SUITE --methods NAME`` ranks
a new method against without re-running the published methods: only the new method's cells run, on the suite's
seeds, and each is paired by seed with every published method's (report/claims.py: mean difference, 95 %
t-interval, seeds ahead, Wilcoxon). A cell whose protocol matches no published cell of its setting is refused:
the comparison needs the same protocol, not the same floats (another CPU or torch makes other floats, and the
ranking says so). With ``--update-published``, the published cells also stand in for the run directories of every
method but the re-run ones (:func:`with_published_cells`), so the whole leaderboard is written again.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..fileio import atomic_write

__all__ = ["CELLS_FILE", "FLOPS_FILE", "cell_records", "competition_ranks", "write_cells", "load_published", "protocol_of", "rank_against_published", "with_methods", "write_ranking"]

CELLS_FILE = "cells.json"
FLOPS_FILE = "flops.json"  # in a cell's directory: the FLOPs of one round, counted once per (setting, method)
FORMAT = 1


def protocol_of(cfg) -> dict[str, Any]:
    """What a cell's numbers depend on besides its method and seed: its comparable configuration (runs.py: no
    file locations, no run settings, no rounds) without ``algorithm`` and ``seed``; rounds come back in, since
    a ranking needs the same number."""
    from ..runs import live_comparable_config

    protocol = {k: v for k, v in live_comparable_config(cfg).items() if k not in ("algorithm", "seed")}
    return {**protocol, "rounds": cfg.rounds}


def fingerprint(protocol: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(protocol, sort_keys=True, default=str).encode()).hexdigest()[:16]


_MISSING = object()


def published_form(protocol: dict[str, Any], published: dict[str, Any]) -> dict[str, Any]:
    """``protocol`` as the version that wrote ``published`` (a setting's protocol in cells.json) would have written
    it. A key that ``published`` lacks is a setting added since; the published cells ran it at the value this
    version gives it when it reads their protocol as a saved run's (runs.comparable_config: the default, or the
    default it had then where it changed since). Where ``protocol`` holds that value the key is dropped, at any
    depth; set to another value it stays, and so still differs."""
    from ..runs import comparable_config

    return _without_added_defaults(protocol, published, comparable_config(published))


def _without_added_defaults(protocol: dict[str, Any], published: dict[str, Any], read: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in protocol.items():
        then = read.get(key, _MISSING) if isinstance(read, dict) else _MISSING
        if key not in published:
            if then is not _MISSING and then == value:
                continue
            out[key] = value
        elif isinstance(value, dict) and isinstance(published[key], dict):
            out[key] = _without_added_defaults(value, published[key], then if isinstance(then, dict) else {})
        else:
            out[key] = value
    return out


def published_fingerprint(cfg: Any, setting: str, published: dict[str, Any] | None) -> str:
    """The fingerprint of ``cfg``'s protocol, in the form of the published cells' protocol of ``setting`` when
    there are published cells (:func:`published_form`), else as it is."""
    protocol = protocol_of(cfg)
    if published is not None and setting in published.get("protocols", {}):
        protocol = published_form(protocol, published["protocols"][setting])
    return fingerprint(protocol)


def cell_environment(path: Path) -> dict[str, Any]:
    """Where a cell ran, from its run directory's environment.json: CPU, torch, fedistill's commit."""
    try:
        env = json.loads((path / "environment.json").read_text())
    except (OSError, ValueError):
        return {}
    git = env.get("git") or {}
    commit = git.get("commit")
    if commit and git.get("uncommitted_changes"):
        commit += "+changes"
    return {"cpu": env.get("cpu"), "cpu_id": env.get("cpu_id"), "cpu_count": env.get("cpu_count"), "torch": env.get("torch"),
            "fedistill": commit}  # fmt: skip


def _environment_id(environments: dict[str, dict[str, Any]], env: dict[str, Any]) -> str:
    """``env``'s id among ``environments`` (``env0``, ``env1``, ...), added as the next id if it is new."""
    env_id = next((k for k, v in environments.items() if v == env), None)
    if env_id is None:
        env_id = f"env{len(environments)}"
        environments[env_id] = env
    return env_id


def cell_records(cells: list[Any], published: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """(records, environments): one record per cell of the suite (unfinished cells too, as such), and the
    distinct environments they ran in, referenced by id to keep the file small. With ``published`` (cells.json
    being written again with some methods re-run), a new cell's protocol fingerprint is taken in the published
    cells' form, so that it matches theirs where only settings added since differ."""
    environments: dict[str, dict[str, Any]] = {}
    records = []
    flops_of: dict[tuple[str, str], float | None] = {}
    for cell in cells:
        flops_path = cell.path / FLOPS_FILE
        if flops_path.is_file():
            try:
                flops_of[(cell.setting, cell.method)] = json.loads(flops_path.read_text()).get("flops_per_round")
            except (OSError, ValueError):
                pass
    for cell in cells:
        if getattr(cell, "published", None) is not None:  # kept from the published cells as it was
            record = dict(cell.published)
            env = cell.published_environment
            if env is not None:
                record["environment"] = _environment_id(environments, env)
            records.append(record)
            continue
        record: dict[str, Any] = {"setting": cell.setting, "method": cell.method, "seed": cell.seed}
        state = cell.state()
        if state == "n/a":
            records.append({**record, "status": "n/a", "why": cell.why_not})
            continue
        result = cell.result()
        if result is None:
            records.append({**record, "status": "unfinished"})
            continue
        env = cell_environment(cell.path)
        env_id = _environment_id(environments, env)
        accuracy = [a for _, a in result.accuracies]
        flops = flops_of.get((cell.setting, cell.method))
        records.append({
            **record,
            "status": "diverged" if result.diverged_after is not None else "finished",
            "diverged_after": result.diverged_after,
            "metric": cell.config.accuracy_metric(),
            "accuracy": accuracy,
            "final": result.final, "best": result.best,
            "last5": statistics.fmean(accuracy[-5:]) if accuracy else None,
            "mb_per_round": None if result.bytes_per_round is None else result.bytes_per_round / 1e6,
            "seconds_per_round": result.seconds_per_round,
            "gflops_per_round": None if flops is None else flops / 1e9,
            "environment": env_id,
            "protocol": published_fingerprint(cell.config, cell.setting, published),
        })  # fmt: skip
    return records, environments


def write_cells(suite: Any, cells: list[Any], root: Path, published: dict[str, Any] | None = None) -> Path:
    """``cells.json`` beside the leaderboard: the suite's cells and, per setting, the protocol of its first
    finished cell written out (to say what differs when another protocol is refused); with ``published`` (some
    methods re-run into published cells), the published protocols are kept."""
    records, environments = cell_records(cells, published)
    protocols: dict[str, dict[str, Any]] = dict(published["protocols"]) if published is not None else {}
    for cell in cells:
        if cell.setting not in protocols and cell.why_not is None and cell.config is not None:
            protocols[cell.setting] = protocol_of(cell.config)
    data = {"format": FORMAT, "suite": suite.name, "seeds": suite.seeds, "environments": environments,
            "protocols": protocols, "cells": records}  # fmt: skip
    path = root / CELLS_FILE
    atomic_write(path, json.dumps(data, separators=(",", ":"), default=str))
    return path


def bundled_leaderboards_dir() -> Path | None:
    """The published leaderboards' cells that ship with fedistill, or None if this installation has none.

    In an installed wheel they are package data, ``fedistill/leaderboards/SUITE/cells.json`` (pyproject.toml maps
    the repository's ``benchmarks/leaderboards/`` there); from the source tree (an editable install, or ``src`` on
    ``sys.path``) it is the checkout's ``benchmarks/leaderboards/``, whatever the working directory.
    """
    packaged = resources.files("fedistill") / "leaderboards"
    candidates = [Path(str(packaged)), Path(__file__).resolve().parents[3] / "benchmarks" / "leaderboards"]
    return next((c for c in candidates if c.is_dir()), None)


def published_cells_path(suite_name: str) -> Path:
    """Where the published cells of ``suite_name`` ship (a path that may not exist, for the caller's error)."""
    bundled = bundled_leaderboards_dir()
    root = bundled if bundled is not None else Path("benchmarks") / "leaderboards"
    return root / suite_name / CELLS_FILE


def load_published(suite: Any, path: Path | None) -> dict[str, Any]:
    """The published cells of ``suite``: ``path``, else the ones that ship with fedistill (from any directory)."""
    path = Path(path) if path is not None else published_cells_path(suite.name)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"bench --methods: no published cells at {path}; give the file with --published, or run the whole suite") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"bench --methods: cannot read the published cells {path} ({exc}); restore the file from the repository") from None
    if data.get("format") != FORMAT or data.get("suite") != suite.name:
        raise ConfigError(f"bench --methods: {path} holds the cells of {data.get('suite')!r} (format {data.get('format')}), not of suite {suite.name!r}")
    return data


def _differences(mine: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} (published: {b!r})")
    return out


def check_protocol(cells: list[Any], published: dict[str, Any]) -> None:
    """Refuse, in one line, cells whose protocol matches no published cell of their setting (settings added since
    the cells were published, at their defaults, do not count: :func:`published_form`)."""
    known: dict[str, set[str]] = {}
    for record in published["cells"]:
        if record.get("protocol"):
            known.setdefault(record["setting"], set()).add(record["protocol"])
    for cell in cells:
        if cell.why_not is not None:
            continue
        if cell.setting not in published["protocols"]:
            raise ConfigError(f"bench --methods: setting {cell.setting!r} is not in the published cells; the suite changed since they were made")
        protocol = published_form(protocol_of(cell.config), published["protocols"][cell.setting])
        if fingerprint(protocol) not in known.get(cell.setting, set()):
            diff = _differences(protocol, published["protocols"][cell.setting])
            what = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "") if diff else "a method default"
            raise ConfigError(
                f"bench --methods: {cell.method} on {cell.setting} runs another protocol than the published cells "
                f"({what}); rank it with the same protocol, or run the whole suite"
            )


def competition_ranks(scores: dict[str, float]) -> dict[str, int]:
    """The one ranking rule of every leaderboard and ranking (issue 62): highest score first, and equal scores
    share the best of their ranks (90, 80, 80, 70 rank 1, 2, 2, 4): scipy's ``rankdata(method="min")`` of the
    negated scores. Which of two tied methods a table lists first is a matter of display, not of rank."""
    if not scores:
        return {}
    from scipy.stats import rankdata

    ranks = rankdata([-float(v) for v in scores.values()], method="min")
    return {name: int(rank) for name, rank in zip(scores, ranks)}


def rank_against_published(
    suite: Any, published: dict[str, Any], new_cells: list[Any], this_environment: dict[str, Any]
) -> dict[str, Any]:
    """The new methods ranked among the published ones per setting, and each new method's paired verdict against
    every published method on the suite's seeds. Returns {"settings": {setting: [row, ...]}, "verdicts": [...],
    "notes": [...]}; a method both published and re-run is compared with its own published cells too."""
    from ..report.claims import DOES_NOT_HOLD, HOLDS, link_verdict, paired_interval

    seeds = list(published["seeds"])
    finals: dict[tuple[str, str], dict[int, float]] = {}
    info: dict[tuple[str, str], dict[str, list[float]]] = {}
    for record in published["cells"]:
        if record.get("status") == "finished":
            finals.setdefault((record["setting"], record["method"]), {})[record["seed"]] = record["final"]
            bucket = info.setdefault((record["setting"], record["method"]), {"mb": [], "s": []})
            bucket["mb"].append(record.get("mb_per_round"))
            bucket["s"].append(record.get("seconds_per_round"))
    new_methods = list(dict.fromkeys(c.method for c in new_cells))
    mine: dict[tuple[str, str], dict[int, float]] = {}
    mine_info: dict[tuple[str, str], dict[str, list[float]]] = {}
    same_bits: dict[str, list[bool]] = {}
    published_by_key = {(r["setting"], r["method"], r["seed"]): r for r in published["cells"]}
    for cell in new_cells:
        result = cell.result()
        if result is None or result.diverged_after is not None:
            continue
        mine.setdefault((cell.setting, cell.method), {})[cell.seed] = result.final
        bucket = mine_info.setdefault((cell.setting, cell.method), {"mb": [], "s": []})
        bucket["mb"].append(None if result.bytes_per_round is None else result.bytes_per_round / 1e6)
        bucket["s"].append(result.seconds_per_round)
        old = published_by_key.get((cell.setting, cell.method, cell.seed))
        if old is not None and old.get("accuracy") is not None:
            same_bits.setdefault(cell.method, []).append([a for _, a in result.accuracies] == old["accuracy"])
    settings: dict[str, list[dict[str, Any]]] = {}
    verdicts = []
    for setting in suite.settings:
        entries: dict[str, tuple[dict[int, float], dict[str, list[float]], bool]] = {}
        for (s, method), values in finals.items():
            if s == setting and len(values) == len(seeds) and method not in new_methods:
                entries[method] = (values, info[(s, method)], False)
        for (s, method), values in mine.items():
            if s == setting:
                entries[method] = (values, mine_info[(s, method)], True)
        means = {m: statistics.fmean(v.values()) for m, (v, _, _) in entries.items()}
        ranks = competition_ranks(means)
        rows = []
        for method, (values, extra, is_new) in entries.items():
            vals = list(values.values())
            mbs = [x for x in extra["mb"] if x is not None]
            secs = [x for x in extra["s"] if x is not None]
            rows.append({
                "rank": ranks[method], "method": method, "yours": is_new, "final_accuracy": means[method],
                "final_accuracy_std": statistics.stdev(vals) if len(vals) > 1 else None, "seeds": len(vals),
                "mb_per_round": statistics.fmean(mbs) if mbs else None,
                "seconds_per_round": statistics.fmean(secs) if secs else None,
            })  # fmt: skip
        settings[setting] = sorted(rows, key=lambda r: (r["rank"], not r["yours"], r["method"]))
        for method in new_methods:
            if (setting, method) not in mine:
                continue
            ours = mine[(setting, method)]
            for other, values in sorted(finals.items()):
                if other[0] != setting or len(values) != len(seeds):
                    continue
                paired = [s for s in seeds if s in ours and s in values]
                interval = paired_interval([ours[s] for s in paired], [values[s] for s in paired])
                verdict = link_verdict(">", interval)
                symbol = ">" if verdict == HOLDS else "<" if verdict == DOES_NOT_HOLD else "~"
                against = other[1] if other[1] != method else f"{method} (published)"
                verdicts.append({
                    "setting": setting, "method": method, "against": against, "symbol": symbol, "verdict": verdict,
                    "mean": interval.mean, "low": interval.low, "high": interval.high, "ahead": interval.a_wins,
                    "n": interval.n, "text": f"{method} {symbol} {against}: {interval.fmt()}, ahead on {interval.a_wins}/{interval.n}",
                })  # fmt: skip
    notes = []
    published_envs = published.get("environments", {}).values()
    for key in ("cpu", "cpu_id", "torch"):  # cpu_id: the same name may hide another speed (report/environment.py)
        theirs = sorted({str(e.get(key)) for e in published_envs if e.get(key)})
        if theirs and str(this_environment.get(key)) not in theirs:
            notes.append(
                f"this machine's {key} ({this_environment.get(key)}) differs from the published cells' ({', '.join(theirs)}): "
                "their floats may differ, so the comparison is statistical, not bitwise"
            )
    for method, equal in same_bits.items():
        notes.append(f"{method}: {sum(equal)} of {len(equal)} re-run cells equal to the published ones to the last bit")
    return {"settings": settings, "verdicts": verdicts, "notes": notes}


def ranking_markdown(suite: Any, ranking: dict[str, Any]) -> str:
    """ranking.md: per setting, the published and your methods in rank order (report/tables.py writes the
    tables), then each of your methods paired by seed with every published one."""
    from ..report.groups import format_stat
    from ..report.tables import Cell, markdown_table

    lines = [f"# {suite.title}: your methods ranked among the published cells", ""]
    lines += [f"- {note}" for note in ranking["notes"]] + ([""] if ranking["notes"] else [])
    for setting, rows in ranking["settings"].items():
        table = [
            [r["rank"], Cell(r["method"], bold=True, after=" (yours)") if r["yours"] else r["method"],
             format_stat({"mean": r["final_accuracy"], "std": r["final_accuracy_std"]}),
             "" if r["mb_per_round"] is None else f"{r['mb_per_round']:.1f}",
             "" if r["seconds_per_round"] is None else f"{r['seconds_per_round']:.1f}", r["seeds"]]
            for r in rows
        ]  # fmt: skip
        lines += [f"## {suite.settings[setting].label}", "",
                  markdown_table(["rank", "method", "final acc %", "MB/round", "s/round", "seeds"], table)]  # fmt: skip
        lines += ["", "Paired by seed (final accuracy; mean difference [95 % t-interval], seeds ahead):", ""]
        lines += [f"- {v['text']}" for v in ranking["verdicts"] if v["setting"] == setting] + [""]
    return "\n".join(lines)


def write_ranking(suite: Any, published: dict[str, Any], cells: list[Any], root: Path, console) -> list[dict[str, Any]]:
    """ranking.md and ranking.json in the suite's directory, and the ranking printed."""
    import torch

    from ..report.environment import cpu_identity, cpu_name
    from ..report.groups import format_stat

    here = {"cpu": cpu_name(), "cpu_id": cpu_identity(), "torch": torch.__version__}
    ranking = rank_against_published(suite, published, cells, here)
    text = ranking_markdown(suite, ranking)
    atomic_write(root / "ranking.md", text)
    atomic_write(root / "ranking.json", json.dumps(ranking, indent=1))
    for note in ranking["notes"]:
        console.print(f"note: {note}", highlight=False)
    for setting, rows in ranking["settings"].items():
        for row in (r for r in rows if r["yours"]):
            console.print(
                f"{suite.settings[setting].label}: {row['method']} ranks {row['rank']} of {len(rows)} "
                f"({format_stat({'mean': row['final_accuracy'], 'std': row['final_accuracy_std']})})", highlight=False,
            )  # fmt: skip
        for verdict in (v for v in ranking["verdicts"] if v["setting"] == setting):
            console.print(f"  {verdict['text']}", highlight=False)
    console.print(f"ranking: {root / 'ranking.md'} (and ranking.json)")
    return [row for rows in ranking["settings"].values() for row in rows]


def published_peak(suite_name: str, published: Path | None, threads: int) -> tuple[bool, float | None]:
    """(known, peak): the bf16 peak the published leaderboard beside the published cells was set against (its rows'
    ``bf16_peak_gflops_per_s`` at ``threads`` threads), so that the published methods keep their % of peak when
    the leaderboard is written again with a method re-run. Known with no peak when the published rows counted
    FLOPs but had none (a machine without bf16 in hardware): the rewrite keeps none rather than measuring one.
    (False, None) when there is no published leaderboard, or it predates the per-thread peak."""
    path = (Path(published) if published is not None else published_cells_path(suite_name)).parent / "leaderboard.json"
    try:
        rows = [r for r in json.loads(path.read_text()) if isinstance(r, dict)]
    except (OSError, ValueError, TypeError):
        return False, None
    peaks = {r.get("bf16_peak_gflops_per_s") for r in rows if r.get("bf16_peak_threads") == threads}
    peaks.discard(None)
    if peaks:
        return True, max(peaks)
    without = any(r.get("gflops_per_round") for r in rows) and not any(r.get("bf16_peak_gflops_per_s") for r in rows)
    return without, None


def published_result(cell: Any) -> Any:
    """A published cell's RunResult, from its record: the accuracy of every evaluated round (the suite's rounds and
    eval.every give which rounds those were), its seconds and bytes per round, where it diverged."""
    from .reproduce import RunResult

    record = cell.published or {}
    if record.get("status") not in ("finished", "diverged"):
        return None
    cfg = cell.config
    rounds = [r for r in range(1, cfg.rounds + 1) if r % cfg.eval.every == 0 or r == cfg.rounds]
    mb = record.get("mb_per_round")
    return RunResult(
        cell.setting, cell.method, cell.seed, list(zip(rounds, record.get("accuracy") or [])), record.get("seconds_per_round"),
        diverged_after=record.get("diverged_after"), bytes_per_round=None if mb is None else mb * 1e6,
    )  # fmt: skip


def with_published_cells(cells: list[Any], published: dict[str, Any], rerun: list[str]) -> list[Any]:
    """``cells`` (every cell of the suite) with each cell of a method not in ``rerun`` read from the published
    cells (its record; unfinished if it has none), the cells of ``rerun`` from their run directories: the whole
    leaderboard with those methods re-run and every other method as published. A method the published cells do
    not have (registered since, in a suite that runs every method) is left out, not listed as unfinished: the
    leaderboard is the published one with the re-run methods changed."""
    by_key = {(r["setting"], r["method"], r["seed"]): r for r in published["cells"]}
    environments = published.get("environments", {})
    known = {r["method"] for r in published["cells"]} | set(rerun)
    cells = [c for c in cells if c.method in known]
    for cell in cells:
        if cell.method in rerun or cell.config is None:  # re-run, or a method this suite refuses here: as it is
            continue
        record = by_key.get((cell.setting, cell.method, cell.seed), {"setting": cell.setting, "method": cell.method,
                                                                     "seed": cell.seed, "status": "unfinished"})  # fmt: skip
        cell.published, cell.published_environment = record, environments.get(record.get("environment"))
    return cells


def with_methods(suite: Any, methods: list[str], spec_class: Any) -> Any:
    """The suite with ``methods`` among its methods: a suite that lists its methods gets each missing one at
    its card defaults (a method of your own; ``spec_class`` is bench.BenchMethod, passed in since bench imports
    this module); one that runs every registered method has them already."""
    from .. import algorithms as _algorithms  # noqa: F401  (registers the methods)
    from ..registry import ALGORITHMS

    if not methods:
        raise ConfigError("bench --methods: empty; name at least one method")
    specs = suite.method_specs()
    for name in methods:
        if name not in specs and name not in ALGORITHMS:
            known = ", ".join(sorted(set(specs) | set(ALGORITHMS.names())))
            raise ConfigError(f"bench --methods: unknown method {name!r} (a plugin's method needs --plugin FILE.py); choose from: {known}")
    if suite.methods is None:
        return suite
    extra = {name: spec_class(config={"algorithm": {"name": name}}) for name in methods if name not in specs}
    return suite.model_copy(update={"methods": {**suite.methods, **extra}})
