"""Example (d): from a method in a file to its rank against a published leaderboard, in minutes.

The method is a plugin file (here examples/confidence_penalty.py's ``fedavg_cp``); only its cells run, on the
suite's protocol and seeds, and each is paired by seed with every published method's cell (the suite's
committed cells.json): its rank per setting, and ``mine > X``, ``mine < X`` or ``mine ~ X`` with the mean
difference, its 95 % t-interval and the seeds ahead.

    python examples/rank_my_method.py --data-dir DATA                      # fedavg_cp on fd-mnist, 6 cells
    python examples/rank_my_method.py --plugin my_method.py --method mine --data-dir DATA --jobs 2

The same from the command line: ``fedistill bench fd-mnist --plugin examples/confidence_penalty.py --methods
fedavg_cp --data-dir DATA``. Run it from the repository root (the published cells are benchmarks/leaderboards/
SUITE/cells.json), or give them with --published.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedistill.cli import main as fedistill_main

HERE = Path(__file__).resolve().parent


def rank(plugin: str, method: str, suite: str, out: str, jobs: int = 1, data_dir: str | None = None,
         published: str | None = None, settings: list[str] | None = None) -> dict:  # fmt: skip
    """Run the method's cells of ``suite`` and return the ranking (bench writes it as ranking.json)."""
    command = ["bench", suite, "--plugin", plugin, "--methods", method, "--jobs", str(jobs), "--out", out, "-q"]
    command += ["--data-dir", data_dir] if data_dir else []
    command += ["--published", published] if published else []
    for setting in settings or []:
        command += ["--set", setting]
    code = fedistill_main(command)
    if code != 0:
        raise SystemExit(code)
    name = json.loads(Path(published).read_text())["suite"] if published else Path(suite).stem
    return json.loads((Path(out) / name / "ranking.json").read_text())


def closest(ranking: dict, setting: str, method: str, k: int = 3) -> list[dict]:
    """The ``k`` published methods whose mean final accuracy is nearest the method's on ``setting``."""
    rows = ranking["settings"][setting]
    mine = next(r for r in rows if r["method"] == method and r["yours"])
    others = [r for r in rows if not r["yours"]]
    return sorted(others, key=lambda r: abs(r["final_accuracy"] - mine["final_accuracy"]))[:k]


if __name__ == "__main__":  # worker processes import this file again (--jobs): nothing runs at import
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plugin", default=str(HERE / "confidence_penalty.py"))
    parser.add_argument("--method", default="fedavg_cp")
    parser.add_argument("--suite", default="fd-mnist")
    parser.add_argument("--out", default="bench-mine")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--data-dir")
    parser.add_argument("--published")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. algorithm.beta=0.2")
    args = parser.parse_args()
    ranking = rank(args.plugin, args.method, args.suite, args.out, args.jobs, args.data_dir, args.published, args.set)
    for setting, rows in ranking["settings"].items():
        mine = next(r for r in rows if r["method"] == args.method and r["yours"])
        print(f"{setting}: {args.method} ranks {mine['rank']} of {len(rows)} ({mine['final_accuracy']:.2f} %)")
        for row in closest(ranking, setting, args.method):
            verdict = next(v for v in ranking["verdicts"] if v["setting"] == setting and v["against"] == row["method"])
            print(f"  nearest: {verdict['text']}")
