"""Seconds per round of a 3-client digits FedAvg run on a local Flower deployment (issue 15, target 4).

Starts a SuperLink and 3 SuperNodes on 127.0.0.1 (insecure, private FLWR_HOME, free ports), and in the
``worker`` modes a long-running ClientApp process next to each SuperNode; submits the app written from
configs/digits_fedavg.yaml with 3 clients, 3 per round and ``run.threads=1``; waits for the run and reads
each round's seconds from the run directory's metrics.jsonl (ServerApp side: broadcast, waiting for the
replies, aggregation and evaluation). Every process is started in its own process group and killed on
exit (normal end, error, Ctrl-C or SIGTERM).

Modes (``--mode``, repeatable; default: all four, in this order):

- ``stock``: Flower 1.41 as shipped: a ``flwr-clientapp`` process per message, SuperNodes polling every 3 s;
- ``fast-poll``: a process per message, SuperNodes through ``python -m fedistill.flower supernode``;
- ``worker``: long-running ClientApps (``--isolation process`` + ``python -m fedistill.flower clientapp``),
  SuperNodes polling every 3 s;
- ``worker+fast-poll``: both (the fast setup the README documents).

    .venv/bin/python benchmarks/bench_flower_round.py --rounds 6 --out benchmarks/flower_round.json

After each run the federation is left idle for ``--idle-seconds`` and the CPU time its processes use in
that time is reported (the price of polling faster). The machine this ran on is shared: repeat and compare.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fedistill.config import build_config, read_yaml  # noqa: E402
from fedistill.flower.local import LocalFederation, descendants  # noqa: E402
from fedistill.flower.project import write_app  # noqa: E402

MODES = {
    "stock": dict(clientapp="subprocess", poll_interval=None),
    "fast-poll": dict(clientapp="subprocess", poll_interval=0.1),
    "worker": dict(clientapp="worker", poll_interval=None),
    "worker+fast-poll": dict(clientapp="worker", poll_interval=0.1),
}


def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU seconds of these processes (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def federation_pids(fed: LocalFederation) -> dict[str, list[int]]:
    """The process ids of each role: the SuperLink (with its SuperExec), the SuperNodes (with theirs), the workers."""
    roles = {"superlink": [fed.superlink], "supernodes": list(fed.supernodes.values()), "workers": list(fed.workers.values())}
    return {role: [p.pid for p in procs if p] + [pid for p in procs if p for pid in descendants(p.pid)] for role, procs in roles.items()}


def run_mode(mode: str, rounds: int, workdir: Path, idle_seconds: float, poll_interval: float, worker_poll: float) -> dict:
    options = dict(MODES[mode])
    if options["poll_interval"] is not None:
        options["poll_interval"] = poll_interval
    if options["clientapp"] == "worker":
        options["worker_poll_interval"] = worker_poll
    cfg = build_config(
        read_yaml(str(ROOT / "configs" / "digits_fedavg.yaml")),
        {"partition.num_clients": 3, "clients_per_round": 3, "rounds": rounds, "run.threads": 1},
    )
    run_dir = workdir / f"run-{mode}"
    app = write_app(workdir / f"app-{mode}", cfg, run_dir=str(run_dir), round_timeout=600)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with LocalFederation(workdir / f"fed-{mode}", 3, **options) as fed:
        run_id = fed.submit(app)
        info = fed.wait(run_id, timeout=60 + 120 * rounds)
        run_seconds = time.perf_counter() - started
        idle_cpu = None
        if idle_seconds > 0:
            time.sleep(2)  # the run's processes wind down
            pids = federation_pids(fed)
            before = {role: cpu_seconds(p) for role, p in pids.items()}
            time.sleep(idle_seconds)
            idle_cpu = {role: round((cpu_seconds(p) - before[role]) / idle_seconds, 3) for role, p in pids.items()}
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    seconds = [float(r["seconds"]) for r in rows]
    later = seconds[1:] or seconds
    return {
        "mode": mode,
        "status": info.get("status"),
        "rounds": len(rows),
        "seconds": [round(s, 3) for s in seconds],
        "train_seconds": [round(float(r["train_seconds"]), 3) for r in rows],
        "round1_seconds": round(seconds[0], 3) if seconds else None,
        "median_later_seconds": round(statistics.median(later), 3) if later else None,
        "mean_later_seconds": round(statistics.fmean(later), 3) if later else None,
        "accuracy": [r.get("test_accuracy") for r in rows],
        "status_details": info.get("status-details"),
        "wall_seconds": round(run_seconds, 1),
        "idle_cpu_fraction": idle_cpu,  # CPU seconds per second, by role, right after the run
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", action="append", choices=list(MODES), help="repeatable; default: all")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=1, help="runs per mode")
    parser.add_argument("--poll-interval", type=float, default=0.1, help="of the fast-poll SuperNodes (0.1)")
    parser.add_argument("--worker-poll-interval", type=float, default=0.1, help="of the ClientApp workers (0.1)")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="idle time after each run for the CPU measurement")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--workdir", help="keep the federations' logs and run directories here (default: a temporary directory)")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))  # `with` blocks still close
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-flower-") as tmp:
        base = Path(args.workdir) if args.workdir else Path(tmp)
        for attempt in range(args.repeat):
            for mode in args.mode or list(MODES):
                result = run_mode(
                    mode, args.rounds, base / f"{attempt}", args.idle_seconds, args.poll_interval, args.worker_poll_interval
                )
                results.append(result)
                idle = result["idle_cpu_fraction"]
                idle = "" if idle is None else f", idle CPU {100 * sum(idle.values()):.0f}% of a core {idle}"
                print(
                    f"{mode:>17}: {result['status']}, round 1 {result['round1_seconds']} s, rounds 2-{result['rounds']} "
                    f"median {result['median_later_seconds']} s (each: {result['seconds']}), final accuracy "
                    f"{result['accuracy'][-1] if result['accuracy'] else result['status_details']}, load {result['loadavg_before'][0]}->{result['loadavg_after'][0]}{idle}",
                    flush=True,
                )
    if args.out:
        record = {
            "date": started,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, {platform.platform()}",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "results": results,
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
