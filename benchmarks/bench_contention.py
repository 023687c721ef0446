"""fedistill beside a busy core: the default thread and worker policy against the one-thread runs it must match.

What a user sees on a shared machine (issue 41): another process holds one core at 100 %, or two runs are started
together. This script starts its own busy process (a Python loop with a deadline of its own, stopped in a
``finally`` and killed at exit), and times, each as a fresh ``fedistill run`` process:

- **make run's job** (configs/digits_fedavg.yaml) and **one round of the MNIST protocol**
  (configs/mnist_fedlmd_protocol_fedavg.yaml, ``rounds=1``), with the default, with one thread in one process
  (``run.threads=1 run.workers=1``: the best one-thread time), with two one-thread workers, and with the
  previous default (every core in one process: ``run.threads=<cores> run.workers=1``), on the idle machine and
  beside the busy process;
- **two default runs started at the same moment** (two seeds in two terminals), against a one-thread run alone;
- **``reproduce --jobs 2``** beside the busy process, against ``--jobs 1`` and the idle machine.

The time of a run is its training time (``seconds`` of summary.json; the process's wall time, imports included,
is kept beside it). Ratios: default beside the busy core / the best one-thread time beside it (target <= 1.5);
each of two runs started together / a one-thread run alone (target <= 1.5); default on the idle machine / the
previous default there (target <= 1, "no slower than today").

Run on an otherwise idle machine:
    python benchmarks/bench_contention.py --data-dir ../shared/data [--skip-mnist] [--repeats 2]
Writes benchmarks/out/contention-<time>.json and prints the markdown table of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FEDISTILL = [sys.executable, "-c", "import sys; from fedistill.cli import main; sys.exit(main())"]
HOG = "import time, sys\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"

JOBS = {
    "digits": ["--config", str(ROOT / "configs/digits_fedavg.yaml")],
    "mnist-round": ["--config", str(ROOT / "configs/mnist_fedlmd_protocol_fedavg.yaml"), "--set", "rounds=1"],
}


def variants(cores: int) -> dict[str, list[str]]:
    return {
        "default": [],
        "one-thread": ["--set", "run.threads=1", "--set", "run.workers=1"],
        "2 one-thread workers": ["--set", "run.threads=1", "--set", "run.workers=2"],
        f"previous default ({cores} threads)": ["--set", f"run.threads={cores}", "--set", "run.workers=1"],
    }


class BusyCore:
    """A process that keeps one core busy until ``stop()`` (or its own deadline, or this script's exit)."""

    def __init__(self, seconds: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOG, str(seconds)])
        atexit.register(self.stop)
        time.sleep(1.0)  # let the scheduler settle it on a core

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_run(args: list[str], out: Path, name: str, env: dict[str, str]) -> tuple[subprocess.Popen, float]:
    cmd = [*FEDISTILL, "run", *args, "--set", f"run.out_dir={out}", "--set", f"run.name={name}", "--set", "run.progress=false"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT), time.perf_counter()


def finish_run(proc: subprocess.Popen, started: float, out: Path, name: str) -> dict:
    output, _ = proc.communicate()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"run {name} failed ({proc.returncode}):\n{output[-3000:]}")
    summary = json.loads((out / name / "summary.json").read_text())
    plan = next((line.split("cores: ", 1)[1] for line in output.splitlines() if line.startswith("cores: ")), "")
    return {"seconds": summary["seconds"], "wall": round(wall, 2), "final_accuracy": summary.get("final_accuracy"), "plan": plan}


def timed(args: list[str], out: Path, env: dict[str, str], repeats: int, tag: str) -> dict:
    """The best (least) training time of ``repeats`` runs, with each run's record."""
    runs = []
    for r in range(repeats):
        name = f"{tag}-{r}-{time.monotonic_ns()}"
        runs.append(finish_run(*start_run(args, out, name, env), out, name))
        shutil.rmtree(out / name, ignore_errors=True)
    best = min(runs, key=lambda x: x["seconds"])
    return {**best, "runs": runs}


def together(args: list[str], out: Path, env: dict[str, str], seeds=(0, 1)) -> list[dict]:
    """Two runs of ``args`` (seeds 0 and 1) started at the same moment."""
    started = []
    for seed in seeds:
        name = f"together-{seed}-{time.monotonic_ns()}"
        started.append((start_run([*args, "--set", f"seed={seed}"], out, name, env), name))
    results = [finish_run(proc, t0, out, name) for (proc, t0), name in started]
    for _, name in started:
        shutil.rmtree(out / name, ignore_errors=True)
    return results


def reproduce_jobs(jobs: int, out: Path, env: dict[str, str]) -> float:
    """Wall seconds of ``reproduce fedlmd_table3_mnist`` for FedAvg on LDA 0.1, seeds 0 and 1, one round each."""
    target = out / f"reproduce-{jobs}-{time.monotonic_ns()}"
    cmd = [*FEDISTILL, "reproduce", "fedlmd_table3_mnist", "--methods", "FedAvg", "--columns", "lda_0.1", "--seeds", "0", "1",
           "--rounds", "1", "--jobs", str(jobs), "--out", str(target), "-q"]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"reproduce --jobs {jobs} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    shutil.rmtree(target, ignore_errors=True)
    return round(wall, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=os.environ.get("FEDISTILL_DATA"), help="official MNIST files (the MNIST cases)")
    ap.add_argument("--skip-mnist", action="store_true", help="only make run's digits job")
    ap.add_argument("--repeats", type=int, default=1, help="runs per measurement (the least training time is kept)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args()

    from fedistill.engine.cores import usable_cores

    cores = usable_cores()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.data_dir:
        env["FEDISTILL_DATA"] = str(Path(args.data_dir).resolve())
    jobs = {k: v for k, v in JOBS.items() if k == "digits" or (not args.skip_mnist and args.data_dir)}
    work = Path(tempfile.mkdtemp(prefix="fedistill-contention-"))
    results: dict = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "usable_cores": cores, "nproc": os.cpu_count()},
        "cases": {},
    }
    try:
        for job, job_args in jobs.items():
            case: dict = {"idle": {}, "busy": {}}
            for label, extra in variants(cores).items():
                case["idle"][label] = timed([*job_args, *extra], work, env, args.repeats, f"{job}-idle")
                print(f"{job} idle  {label:32s} {case['idle'][label]['seconds']:7.2f} s  ({case['idle'][label]['plan']})", flush=True)
            busy = BusyCore(3600)
            try:
                for label, extra in variants(cores).items():
                    case["busy"][label] = timed([*job_args, *extra], work, env, args.repeats, f"{job}-busy")
                    print(f"{job} busy  {label:32s} {case['busy'][label]['seconds']:7.2f} s  ({case['busy'][label]['plan']})", flush=True)
            finally:
                busy.stop()
            case["together"] = {
                "default": together(job_args, work, env),
                f"previous default ({cores} threads)": together([*job_args, *variants(cores)[f"previous default ({cores} threads)"]], work, env),
            }
            for label, pair in case["together"].items():
                print(f"{job} two together, {label}: {[r['seconds'] for r in pair]} s", flush=True)
            results["cases"][job] = case
        if "mnist-round" in jobs:
            runs: dict = {"idle": {}, "busy": {}}
            for jobs_n in (1, 2):
                runs["idle"][jobs_n] = reproduce_jobs(jobs_n, work, env)
            busy = BusyCore(3600)
            try:
                for jobs_n in (1, 2):
                    runs["busy"][jobs_n] = reproduce_jobs(jobs_n, work, env)
            finally:
                busy.stop()
            results["reproduce_jobs"] = runs
            print(f"reproduce, 2 one-round MNIST runs: {runs}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"contention-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"\n{path}\n")
    print(table(results, cores))


def table(results: dict, cores: int) -> str:
    """The RESULTS.md table: training seconds (least of the repeats) and the ratios the targets are about."""
    previous = f"previous default ({cores} threads)"
    lines = ["| job | machine | variant | seconds | ratio | against |", "|---|---|---|---:|---:|---|"]
    for job, case in results["cases"].items():
        for where in ("idle", "busy"):
            one = case[where]["one-thread"]["seconds"]
            for label, rec in case[where].items():
                against = "one-thread here" + (" (target <= 1.5)" if where == "busy" and label == "default" else "")
                lines.append(f"| {job} | {where} | {label} | {rec['seconds']:.2f} | {rec['seconds'] / one:.2f} | {against} |")
        d, p = case["idle"]["default"]["seconds"], case["idle"][previous]["seconds"]
        lines.append(f"| {job} | idle | default vs {previous} | {d:.2f} | {d / p:.2f} | previous default (target <= 1) |")
        one_idle = case["idle"]["one-thread"]["seconds"]
        for label, pair in case["together"].items():
            seconds = ", ".join(f"{r['seconds']:.2f}" for r in pair)
            worst = max(r["seconds"] for r in pair) / one_idle
            target = " (target <= 1.5)" if label == "default" else ""
            lines.append(f"| {job} | two started together | {label} | {seconds} | {worst:.2f} | one-thread alone, idle{target} |")
    if "reproduce_jobs" in results:
        r = results["reproduce_jobs"]
        for where in ("idle", "busy"):
            lines.append(
                f"| reproduce, 2 one-round MNIST runs (wall) | {where} | --jobs 2 | {r[where][2]:.2f} | {r[where][2] / r[where][1]:.2f} | --jobs 1 here ({r[where][1]:.2f} s) |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
