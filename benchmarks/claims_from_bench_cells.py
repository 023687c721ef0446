"""Issue 65: a claim preset's runs taken from a bench suite's finished cells where the two are the same run, so that
the 10-seed claims do not run seeds 0-2 again.

A cell and a run are the same run when everything that decides their numbers is equal: the resolved configs
compared as ``fedistill reproduce`` compares them (``runs.live_comparable_config``), the seed and the rounds. This
copies the four small files reproduce reads back (``config.yaml``, ``metrics.jsonl``, ``summary.json``,
``environment.json``) of every finished cell that matches a (column, method, seed) of the preset to that run's
directory under OUT, where ``fedistill reproduce PRESET --out OUT`` then counts it as done. Nothing is matched by
name: a preset method and a suite method pair up only through their configs.

    PYTHONPATH=src python benchmarks/claims_from_bench_cells.py fd-hetero-mnist BENCH_OUT \\
        benchmarks/presets/fd_hetero_claims.yaml CLAIMS_OUT --columns mnist_0.1 --seeds 0 1 2

BENCH_OUT is the bench's ``--out`` (its cells lie under BENCH_OUT/SUITE). A run OUT already holds finished is left
as it is; a cell that is not finished is skipped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from fedistill.runs import live_comparable_config
from fedistill.studies.bench import load_suite, suite_cells
from fedistill.studies.reproduce import load_preset, method_dir_name, run_config

KEPT = ("config.yaml", "metrics.jsonl", "summary.json", "environment.json")


def finished(path: Path) -> bool:
    try:
        return json.loads((path / "summary.json").read_text()).get("status") == "finished"
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite")
    parser.add_argument("bench_out", type=Path)
    parser.add_argument("preset")
    parser.add_argument("out", type=Path)
    parser.add_argument("--columns", nargs="+", required=True)
    parser.add_argument("--seeds", nargs="+", type=int, required=True)
    args = parser.parse_args(argv)
    suite = load_suite(args.suite)
    preset = load_preset(args.preset)
    cells = [c for c in suite_cells(suite, args.bench_out / suite.name) if c.why_not is None and c.seed in args.seeds]
    by_numbers: dict[str, list] = {}
    for cell in cells:
        key = json.dumps([live_comparable_config(cell.config), cell.config.rounds, cell.seed], sort_keys=True, default=str)
        by_numbers.setdefault(key, []).append(cell)
    copied = 0
    for column in args.columns:
        for method in preset.methods:
            for seed in args.seeds:
                # reproduce's rounds without --rounds: the preset's base rounds, else the paper's
                rounds = preset.base.get("rounds") or preset.paper_rounds
                cfg = run_config(preset, column, method, seed, rounds, [])
                key = json.dumps([live_comparable_config(cfg), cfg.rounds, seed], sort_keys=True, default=str)
                matches = [c for c in by_numbers.get(key, []) if finished(c.path)]
                dest = args.out / preset.name / column / method_dir_name(method) / f"seed{seed}"  # reproduce's layout
                if not matches or finished(dest):
                    continue
                dest.mkdir(parents=True, exist_ok=True)
                for name in KEPT:
                    if (matches[0].path / name).is_file():
                        shutil.copy2(matches[0].path / name, dest / name)
                copied += 1
                print(f"{column} / {method} / seed {seed} <- {matches[0].path}")
    print(f"{copied} runs copied to {args.out / preset.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
