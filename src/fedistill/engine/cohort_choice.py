"""``run.cohort = auto`` (issue 66, item 5): cohort training where a measurement on this device showed it faster
than the sequential path, the sequential path everywhere else.

Whether K clients stacked into one batched step (engine/cohort.py) beat one client after another depends on the
device: on a CPU the batched step is slower (issue 66: 0.62x in fp32, 0.74x in bf16, for 10 stacked MNIST CNN
clients on one thread), and on a GPU it is the lever against thousands of tiny launches, by how much only a
measurement says. So ``auto`` never guesses: it reads the measurements recorded in ``cohort_measured.json`` (next
to this module, shipped with the package), written by ``benchmarks/bench_gpu_cohort.py --record`` on a lent GPU
(``gpu_check.sh``'s ``cohort`` stage), and chooses cohort training only where a measurement of this GPU model,
this precision and this method (with or without ``run.resident_weights``, as the run has it) found the cohort
round faster than the sequential one with CUDA graphs, the fastest path before cohorts. Everywhere else (a CPU, a
GPU never measured, a measured loss, a method whose client step does not batch, Flower) it is the sequential path,
and the run header's line says which and why.

When cohort training is chosen, a cohort holds the round's clients (K = ``clients_per_round``), as measured, and
the clients' CUDA graphs are off (a cohort step is one batched call per step already: the path that was timed);
when the sequential path is chosen, ``run.cuda_graphs`` stays as set. The choice is made once per run, when the
run starts, and is one of the run's numerics (engine/checkpoint.py): resuming on a device that chooses otherwise
is refused as any other change of the numbers would be.

The measurements are of the MNIST protocol's CNN (``bench_gpu_cohort.py``); a much larger model fills the device
with the sequential path alone, so for one the choice is yours: set ``run.cohort=K`` or leave it unset.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MEASURED = Path(__file__).with_name("cohort_measured.json")


def load_measurements(path: Path = MEASURED) -> list[dict[str, Any]]:
    """The recorded measurements: one row per (device, precision, method, path) with ``seconds_per_round``."""
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("measurements", []))


def record_measurements(bench: dict[str, Any], path: Path = MEASURED) -> int:
    """Merge a ``bench_gpu_cohort.py --json`` result into the table at ``path``: a row of the same device,
    precision, method, path and clients replaces the older one. Returns the rows now in the table."""
    keep = ("method", "path", "seconds_per_round", "samples_per_second", "final_accuracy", "padded_slots")
    missing = [k for k in ("device", "precision", "clients", "rounds", "rows") if k not in bench]
    if missing:
        raise ValueError(f"not a benchmarks/bench_gpu_cohort.py --json result: it has no {', '.join(missing)}")
    if bench["device"] == "cpu":
        raise ValueError("a CPU measurement: run.cohort=auto never chooses cohorts on a CPU, so only a GPU's rows are recorded")
    if bench["rounds"] < 2:
        # The first round (allocations, autotuning, graph capture) is left out of the timing: one round times nothing.
        raise ValueError(f"{bench['rounds']} round timed nothing (round 1 is the warm-up): measure with --rounds 2 or more")
    unusable = [f"{row.get('method')} {row.get('path')}" for row in bench["rows"] if not _finite_seconds(row.get("seconds_per_round"))]
    if unusable:
        raise ValueError(f"no finite seconds a round for {', '.join(unusable)}: a failed or untimed row cannot be chosen by")
    new = [
        {"device": bench["device"], "precision": bench["precision"], "clients": bench["clients"], "rounds": bench["rounds"],
         "date": bench.get("date"), **{k: row.get(k) for k in keep}}
        for row in bench["rows"]
    ]  # fmt: skip

    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        return (row["device"], row["precision"], row["method"], row["path"], row["clients"])

    replaced = {key(row) for row in new}
    rows = [row for row in load_measurements(path) if key(row) not in replaced] + new
    rows.sort(key=key)
    about = ("Seconds per round of the graphed sequential path and of cohort training (issue 66), written by "
             "benchmarks/bench_gpu_cohort.py --record; read by run.cohort=auto (engine/cohort_choice.py).")  # fmt: skip
    path.write_text(json.dumps({"about": about, "measurements": rows}, indent=1) + "\n")
    return len(rows)


def _finite_seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def batches_clients(algorithm: Any) -> bool:
    """Whether ``algorithm``'s client step, as configured, batches (its ``cohort_batches``, algorithms/fedavg.py) and
    the CohortExecutor would batch it (engine/executors.py: not a method whose clients score their own models)."""
    declared = getattr(algorithm, "cohort_batches", None)
    return declared is not None and declared() and getattr(algorithm, "personal_model", "global") != "local"


def device_model(device: str) -> str:
    """The measurements' name for ``device``: the GPU's model name (``torch.cuda.get_device_name``), or "cpu"."""
    import torch

    if not device.startswith("cuda"):
        return "cpu"
    return torch.cuda.get_device_name(torch.device(device))


def choose_cohort(
    cfg: Any, algorithm: Any, device: str | None = None, measurements: list[dict[str, Any]] | None = None
) -> tuple[int | None, str]:
    """``(K, why)`` for ``run.cohort = auto``: K the cohort size, or None for the sequential path.
    ``device`` is the measurements' name for the run's device (:func:`device_model` by default)."""
    method = cfg.algorithm.name
    if not batches_clients(algorithm):
        return None, f"{cfg.algorithm.display_name()}'s client step does not batch"
    if cfg.clients_per_round < 2:
        return None, "one client a round: nothing to stack"
    device = device or device_model(cfg.run.device)
    if device == "cpu":
        return None, "on a CPU the batched step is slower (0.62x in fp32 for 10 MNIST CNN clients, docs/speed.md)"
    rows = measurements if measurements is not None else load_measurements()
    suffix = "+resident" if cfg.run.resident_weights else ""

    def seconds(path: str) -> float | None:
        found = [r for r in rows if (r["device"], r["precision"], r["method"], r["path"]) == (device, cfg.run.precision, method, path + suffix)]
        # A table edited by hand may still hold a NaN, and NaN >= x is False: it would read as "faster".
        return float(found[-1]["seconds_per_round"]) if found and _finite_seconds(found[-1]["seconds_per_round"]) else None

    sequential, cohort = seconds("sequential"), seconds("cohort")
    if sequential is None or cohort is None:
        return None, (f"no measurement of {method} on {device} in {cfg.run.precision} (benchmarks/bench_gpu_cohort.py "
                      "--record on this GPU makes one)")  # fmt: skip
    measured = f"{cohort:.3f} s a round against {sequential:.3f} s sequential with graphs on {device}"
    if cohort >= sequential:
        return None, f"measured slower: {measured}"
    return cfg.clients_per_round, f"measured faster: {measured}"


def resolve_cohort(cfg: Any, algorithm: Any, device: str | None = None) -> tuple[Any, str | None]:
    """``cfg`` with ``run.cohort = auto`` replaced by its choice (and the clients' CUDA graphs off under a
    cohort), and the run header's line that says it; any other value is returned as it is, with no line."""
    if cfg.run.cohort != "auto":
        return cfg, None
    size, why = choose_cohort(cfg, algorithm, device)
    run = cfg.run.model_copy(update={"cohort": size, "cuda_graphs": cfg.run.cuda_graphs and size is None})
    chosen = f"cohorts of {size} clients" if size else "one client after another"
    graphs = " (the clients' CUDA graphs off under it)" if size and cfg.run.cuda_graphs else ""
    return cfg.model_copy(update={"run": run}), f"run.cohort=auto: {chosen}{graphs}: {why}"


def main(argv: list[str] | None = None) -> int:
    """``python -m fedistill.engine.cohort_choice GPU_OUT/cohort.json``: record a lent GPU's rows in the table."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fedistill.engine.cohort_choice",
                                     description="Record a lent GPU's benchmarks/bench_gpu_cohort.py --json result in the "
                                                 "table that run.cohort=auto reads.")  # fmt: skip
    parser.add_argument("cohort_json", type=Path, help="the --json file of benchmarks/bench_gpu_cohort.py (gpu_check.sh: OUT/cohort.json)")
    args = parser.parse_args(argv)
    try:
        bench = json.loads(args.cohort_json.read_text())
        count = record_measurements(bench)
    except OSError as error:
        parser.exit(2, f"error: cannot read {args.cohort_json}: {error.strerror or error}\n")
    except json.JSONDecodeError as error:
        parser.exit(2, f"error: {args.cohort_json} is not JSON ({error.msg}, line {error.lineno}): a truncated copy?\n")
    except ValueError as error:
        parser.exit(2, f"error: {args.cohort_json}: {error}; nothing recorded\n")
    print(f"{count} rows in {MEASURED}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
