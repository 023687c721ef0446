"""The cores a run may use, how busy they are, and how many one-thread client processes to train on them.

The policy (DESIGN "Cores are shared"), written once for ``fedistill run``, ``reproduce --jobs`` and ``bench --jobs``:

- **One intra-op thread per process, always** (unless ``run.threads`` says otherwise). Torch's default of one
  thread per core makes every operation wait at an OpenMP barrier for its slowest thread; when another process
  holds one of the cores, that thread gets the core a time slice at a time and the whole run crawls (17.6x
  slower on 2 cores with one busy, issue 41). A one-thread process only ever shares a core fairly. It also
  fixes the numbers: the thread count changes the order of floating-point sums, so a run's results no longer
  depend on how many cores the machine has or how busy they were when it started.
- **Parallelism from processes, planned every round.** With ``run.workers=auto`` the clients of a round run in
  as many one-thread worker processes as there are usable cores that nobody else is using, re-planned at the
  start of every round: a busy core, or another fedistill run, takes a process away; a core freed gives it
  back. Which process trains a client never changes its numbers (every client draws from its own (seed, round,
  client) stream), so the plan is free to change mid-run and a resume needs no particular plan.
- **Usable cores** are this process's CPU affinity, capped by a cgroup CPU quota (containers, Slurm).
- **Busy cores** are measured from ``/proc/stat`` over the last round (the first time: over the run's setup),
  less this run's own processes' CPU time.
- **Other fedistill runs** are seen before they get busy: every run writes how many cores it uses into a
  claim file in a machine-wide directory, under a lock, so two runs started in the same second split the
  cores instead of both taking all of them.

Without ``/proc`` (not Linux) the busy measure reads 0 and only the claims and the affinity count.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from filelock import FileLock

from ..fileio import atomic_write, remove_temporaries

# A round's clients must hold at least this much arithmetic (training FLOPs, forward + backward) before worker
# processes pay for themselves (benchmarks/RESULTS.md "Cores shared with other programs"): make run's digits job,
# 2.9 GFLOP a round, was 1.24x slower in two workers than in one process (31 ms a round of pickling and process
# wake-ups, and the pool's start); the MNIST protocol's FedAvg, 2,209 GFLOP a round, 1.7x faster.
POOL_MIN_ROUND_FLOPS = 30e9
# The shortest window over which busy cores are measured (the first plan waits for it, once).
MIN_WINDOW_SECONDS = 0.2


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask), in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def own_cgroup(root: Path, self_cgroup: Path = Path("/proc/self/cgroup")) -> Path:
    """This process's cgroup v2 directory under ``root`` (``0::/path`` of /proc/self/cgroup; ``root`` itself
    inside a container, whose cgroup namespace makes its own cgroup the root)."""
    try:
        for line in self_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                own = root / line[3:].strip().lstrip("/")
                if (own / "cpu.max").is_file():
                    return own
    except OSError:
        pass
    return root


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2 ``cpu.max``, or v1 ``cfs_quota_us``), or
    None when there is none."""
    try:
        fields = (own_cgroup(root, self_cgroup) / "cpu.max").read_text().split()
        if fields and fields[0] != "max":
            return int(fields[0]) / int(fields[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Cores this process may use: its affinity, capped by the cgroup quota (a quota of 1.5 cores is 1)."""
    cores = len(allowed_cpus())
    quota = cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota + 1e-9)))
    return max(1, cores)


def client_threads(cfg: Any) -> int:
    """Intra-op threads of every process of the run (this one and each worker): ``run.threads``, else 1.

    One thread, not one per core: a many-thread process waits at every operation for its slowest thread, which
    on a core that another process keeps busy runs a time slice at a time (the module docstring); and the thread count
    changes the order of floating-point sums, so with one thread a run's numbers depend neither on the machine's
    core count nor on how busy it was. Parallelism comes from worker processes (``run.workers``). The count is one
    of the settings a resume must keep (engine/checkpoint.py)."""
    return cfg.run.threads or 1


# -- busy cores ------------------------------------------------------------------------------------------
def _cpu_ticks(cpus: Iterable[int], stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(busy, total) clock ticks summed over ``cpus`` since boot; busy = everything but idle and iowait (steal
    counts as busy: the hypervisor gave that time to someone else)."""
    wanted = {f"cpu{c}" for c in cpus}
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name not in wanted:
            continue
        ticks = [int(v) for v in rest.split()]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
        # guest time is already inside user time: only the first eight fields add up
        all_ticks = sum(ticks[:8])
        busy += all_ticks - idle
        total += all_ticks
    return busy, total


def process_ticks(pid: int) -> int:
    """User + system clock ticks a process has used (0 when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


def busy_cores(busy_ticks: int, total_ticks: int, own_ticks: int, cpus: int) -> float:
    """Cores kept busy by other processes over a window: the busy ticks of our CPUs less our own, as a
    fraction of one CPU's ticks over the window (``total_ticks / cpus``)."""
    if total_ticks <= 0 or cpus <= 0:
        return 0.0
    return max(0.0, (busy_ticks - own_ticks) / (total_ticks / cpus))


class LoadMeter:
    """Cores that other processes kept busy since the last reading (the first: since the meter started)."""

    def __init__(self, cpus: list[int], own_pids: Callable[[], Iterable[int]]) -> None:
        self.cpus = cpus
        self.own_pids = own_pids
        self._start = self._read()

    def _read(self) -> tuple[float, tuple[int, int] | None, dict[int, int]]:
        return time.monotonic(), _cpu_ticks(self.cpus), {pid: process_ticks(pid) for pid in self.own_pids()}

    def busy_elsewhere(self) -> float:
        started, machine, own = self._start
        waited = time.monotonic() - started
        if waited < MIN_WINDOW_SECONDS:
            time.sleep(MIN_WINDOW_SECONDS - waited)
        now = self._read()
        self._start = now
        if machine is None or now[1] is None:
            return 0.0
        ours = sum(ticks - own.get(pid, 0) for pid, ticks in now[2].items())
        return busy_cores(now[1][0] - machine[0], now[1][1] - machine[1], ours, len(self.cpus))


# -- claims of other fedistill runs --------------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    """A process's start time in ticks since boot (with the pid, it names the process: pids are reused)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()[19]


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return start is None or _start_time(pid) in (None, start)


def claims_directory() -> Path:
    """Where every fedistill process on this machine writes its claim ($FEDISTILL_CLAIMS, else the temp dir)."""
    return Path(os.environ.get("FEDISTILL_CLAIMS") or Path(tempfile.gettempdir()) / "fedistill-cores")


class CoreLedger:
    """This process's claim on cores, beside the other fedistill processes' claims (one JSON file each:
    pid, start time, CPUs, cores). Claims of processes that are gone are removed by whoever reads them."""

    def __init__(self, cpus: list[int], directory: Path | None = None, pid: int | None = None) -> None:
        self.cpus = cpus
        self.directory = directory or claims_directory()
        self.pid = pid or os.getpid()
        self.path = self.directory / f"{self.pid}.json"
        # flock on Unix, as earlier fedistill versions took it (so their runs and these exclude each other), a
        # Windows lock there; mode 0o666: the runs of the machine's other users take the same lock.
        self.lock = FileLock(self.directory / "lock", mode=0o666)
        self.usable = True
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # shared by every user of the machine, like /tmp itself
                self.directory.chmod(0o1777)
        except OSError:
            self.usable = False  # a read-only temp dir: the busy measure alone decides

    def _others(self) -> int:
        claimed = 0
        for path in self.directory.glob("*.json"):
            if path == self.path:
                continue
            try:
                claim = json.loads(path.read_text())
                pid, start, cpus, cores = int(claim["pid"]), claim.get("start"), set(claim["cpus"]), int(claim["cores"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written, or not ours to judge
            if not _alive(pid, start):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if cpus & set(self.cpus):
                claimed += min(cores, len(cpus & set(self.cpus)))
        return claimed

    def claim(self, decide: Callable[[int], int]) -> int:
        """Under the lock: read the cores the other live runs claim, let ``decide(claimed_elsewhere)`` choose how
        many this process uses, write that as its claim, and return it."""
        if not self.usable:
            return decide(0)
        try:
            with self.lock:
                # Claims are written under the lock, so a temporary file found here is one of a killed process.
                remove_temporaries(self.directory)
                cores = decide(self._others())
                record = {"pid": self.pid, "start": _start_time(self.pid), "cpus": self.cpus, "cores": cores}
                # Not synced to the disk: after a power cut no claim is anybody's any more.
                atomic_write(self.path, json.dumps(record), durable=False)
                return cores
        except (OSError, NotImplementedError):  # filelock <= 3.23 on a file system without flock: NotImplementedError
            self.usable = False
            return decide(0)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


# -- the plan ------------------------------------------------------------------------------------------
def processes_allowed(usable: int, busy_elsewhere: float, claimed_elsewhere: int, wanted: int) -> int:
    """One-thread processes this run may use now: the usable cores less those taken elsewhere, at least 1 and
    at most ``wanted``. A core is taken when another process keeps it busy (rounded: 0.6 of a core is taken)
    or another fedistill run has claimed it (before it got busy); a run that is both is counted once."""
    taken = max(round(busy_elsewhere), claimed_elsewhere)
    return max(1, min(wanted, usable - taken))


@dataclass
class CorePlan:
    usable: int
    busy_elsewhere: float
    claimed_elsewhere: int
    processes: int
    threads: int
    single_reason: str | None = None  # why the run never uses worker processes (then nothing was measured)

    def describe(self) -> str:
        """The run header's line: what was chosen and why."""
        if self.single_reason:
            return f"{count(self.usable, 'core')} usable, {self.single_reason}: clients in this process, {count(self.threads, 'thread')}"
        taken = []
        if round(self.busy_elsewhere):
            taken.append(f"{round(self.busy_elsewhere)} busy")
        if self.claimed_elsewhere:
            taken.append(f"{self.claimed_elsewhere} claimed by other fedistill runs")
        why = f"{count(self.usable, 'core')} usable" + (f", {' and '.join(taken)}" if taken else "")
        threads = count(self.threads, "thread")
        how = f"{self.processes} client processes of {threads}" if self.processes > 1 else f"clients in this process, {threads}"
        return f"{why}: {how}"


class CorePlanner:
    """Plans the client processes of each round (``run.workers=auto``) and keeps this run's claim current."""

    def __init__(
        self,
        threads: int,
        max_processes: int,
        own_pids: Callable[[], Iterable[int]] = lambda: (),
        single_reason: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threads = threads
        self.clock = clock
        self.max_processes = max(1, max_processes)
        # A run that never uses worker processes (a small round, an accelerator, one usable core) measures nothing:
        # it only claims its core, so that runs started beside it count it.
        self.single_reason = single_reason if self.max_processes == 1 else None
        cpus = allowed_cpus()
        self.usable = usable_cores()
        self.own_pids = own_pids  # the run's worker processes, whose CPU time is not "elsewhere"
        self.meter = LoadMeter(cpus, lambda: (os.getpid(), *self.own_pids()))
        self.ledger = CoreLedger(cpus)
        self.last: CorePlan | None = None
        self._measured: tuple[float, float] | None = None

    def plan(self, wanted: int | None = None) -> CorePlan:
        """The processes to use now (at most ``wanted``, default the planner's maximum); claims them."""
        wanted = self.max_processes if wanted is None else min(wanted, self.max_processes)
        if self.max_processes == 1:
            if self.last is None:  # once: its claim does not change
                self.ledger.claim(lambda claimed: self.threads)
                self.last = CorePlan(self.usable, 0.0, 0, 1, self.threads, self.single_reason or "one process at most")
            return self.last
        if self._measured is not None and self.clock() - self._measured[0] < MIN_WINDOW_SECONDS:
            busy = self._measured[1]  # planned a moment ago (the run header's plan, then round 1's)
        else:
            busy = self.meter.busy_elsewhere()
            self._measured = (self.clock(), busy)
        seen: dict[str, int] = {}

        def decide(claimed: int) -> int:
            seen["claimed"] = claimed
            processes = processes_allowed(self.usable // self.threads, busy / self.threads, math.ceil(claimed / self.threads), wanted)
            return processes * self.threads

        cores = self.ledger.claim(decide)
        self.last = CorePlan(self.usable, busy, seen.get("claimed", 0), max(1, cores // self.threads), self.threads)
        return self.last

    def close(self) -> None:
        self.ledger.release()


def override_keys(overrides: Iterable[str]) -> set[str]:
    """The keys of ``KEY=VALUE`` overrides."""
    return {o.split("=", 1)[0].strip() for o in overrides}


def count(n: int, word: str) -> str:
    """``1 thread``, ``2 threads``: the header's counts."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def job_overrides(
    command: str, jobs: int, overrides: Iterable[str], one_process_runs: bool = False, check_cores: bool = True
) -> list[str]:
    """The run settings of ``fedistill COMMAND --jobs N`` (reproduce, bench): N runs at once, each in its own
    process. With N > 1 (or ``one_process_runs``) each run trains its clients in its own process
    (``run.workers=1``): the jobs are the parallelism, and N one-thread processes share busy cores fairly. With
    one job the run plans its client processes itself (``run.workers=auto``). ``run.threads`` stays 1 unless set.
    More jobs than usable cores is refused (``check_cores``; not for jobs placed on a Ray cluster)."""
    from ..errors import ConfigError

    cores = usable_cores()
    if jobs < 1:
        raise ConfigError(f"{command} --jobs: {jobs}; give 1 or more")
    if check_cores and jobs > cores:
        raise ConfigError(f"{command} --jobs: {jobs} runs at once on the {cores} cores this process may use would oversubscribe them; use at most {cores}")
    out = list(overrides)
    if (jobs > 1 or one_process_runs) and "run.workers" not in override_keys(out):
        out.append("run.workers=1")
    return out
