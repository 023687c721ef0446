"""Rounds of fd-mnist's heavy methods, this tree against another checkout (issue 41, item 2: the speed-ups).

For each method, the first-seed cell of one fd-mnist setting (the suite's protocol, card defaults and the
suite's method_settings, one thread, one process, as `fedistill bench` runs a cell) trains ``--rounds`` rounds
in a fresh process, once with this tree's code and once with the code of ``--before`` (a checkout, e.g. a
`git worktree` of the previous commit), alternating so that the VM's drift falls on both alike. Each round's
wall and server seconds are printed, and a hash of the final global model says whether the two versions
computed the same numbers (bit for bit) or moved the floats. Run on an idle machine:

    git worktree add /tmp/before af2cb75
    python benchmarks/bench_heavy_rounds.py --data-dir ../shared/data --before /tmp/before [--methods feddf,dafkd]

Writes benchmarks/out/heavy-rounds-<time>.json and prints a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ["fedftg", "feddf", "fedgkt", "feddkc", "fedict", "dafkd", "pfedme"]

# What runs in the child process: one cell's rounds, then a hash of the global model (every algorithm's
# server model) and of the server state's tensors.
CHILD = r"""
import hashlib, json, sys, time
from pathlib import Path
import torch
from fedistill.studies.bench import load_suite, suite_cells
from fedistill.models.flat import get_flat
from fedistill.runner import load_dataset_for
from fedistill.simulation import Simulation

method, setting, rounds, data_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
suite = load_suite("fd-mnist")
overrides = ["run.threads=1", "run.workers=1", "run.progress=false", f"dataset.data_dir={data_dir}", "run.checkpoint_every=0"]
cells = [c for c in suite_cells(suite, Path("/tmp/unused"), overrides) if c.method == method and c.setting == setting]
cfg = min(cells, key=lambda c: c.seed).config
torch.set_num_threads(1)
sim = Simulation(cfg, load_dataset_for(cfg))
out = []
for rnd in range(1, rounds + 1):
    started = time.perf_counter()
    row = sim.run_round(rnd)
    out.append({"round": rnd, "seconds": time.perf_counter() - started, "server_seconds": row.get("server_seconds"),
                "personal_accuracy": row.get("personal_accuracy")})
digest = hashlib.sha256(get_flat(sim.server.model).float().numpy().tobytes())
for key, value in sorted(sim.server.state.items()):
    if torch.is_tensor(value):
        digest.update(value.float().cpu().numpy().tobytes())
sim.close()
print("RESULT " + json.dumps({"rounds": out, "hash": digest.hexdigest()[:16]}))
"""


def run_child(src: Path, method: str, setting: str, rounds: int, data_dir: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, method, setting, str(rounds), data_dir], env=env, capture_output=True, text=True
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{method} with {src}: no result\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=os.environ.get("FEDISTILL_DATA"))
    ap.add_argument("--before", required=True, help="a checkout of the code to compare with (its src/ is used)")
    ap.add_argument("--methods", default=",".join(HEAVY))
    ap.add_argument("--setting", default="lda_0.1")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1] / "src"
    before = Path(args.before).resolve() / "src"
    results = []
    for method in args.methods.split(","):
        row = {"method": method}
        for label, src in (("before", before), ("after", here)):
            row[label] = run_child(src, method, args.setting, args.rounds, args.data_dir)
            r = row[label]["rounds"]
            print(f"{method} {label}: " + ", ".join(f"r{x['round']} {x['seconds']:.2f} s (server {x['server_seconds'] or 0:.2f})" for x in r)
                  + f", hash {row[label]['hash']}", flush=True)
        results.append(row)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(__file__).resolve().parent / "out" / f"heavy-rounds-{stamp}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"setting": args.setting, "rounds": args.rounds, "results": results}, indent=1))
    print(f"\nwritten {out}\n")
    print("| method | before: s/round (server) | after: s/round (server) | speed-up | same numbers |")
    print("|---|---:|---:|---:|---|")
    for row in results:
        b, a = row["before"]["rounds"], row["after"]["rounds"]
        bs, as_ = sum(x["seconds"] for x in b) / len(b), sum(x["seconds"] for x in a) / len(a)
        bsv = sum(x["server_seconds"] or 0 for x in b) / len(b)
        asv = sum(x["server_seconds"] or 0 for x in a) / len(a)
        same = "bit for bit" if row["before"]["hash"] == row["after"]["hash"] else "floats moved"
        print(f"| {row['method']} | {bs:.2f} ({bsv:.2f}) | {as_:.2f} ({asv:.2f}) | {bs / as_:.2f}x | {same} |")


if __name__ == "__main__":
    main()
