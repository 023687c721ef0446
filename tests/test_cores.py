"""The core policy (engine/cores.py): usable cores, busy cores, the claims of other runs, and the per-round plan.

Hand-made /proc and cgroup files and fake planners: no test depends on how busy the machine running it is. The
speed it buys is measured in benchmarks/bench_contention.py, never asserted here."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading

import pytest
import torch

from fedistill.engine import cores
from fedistill.engine.cores import CoreLedger, CorePlan, busy_cores, cgroup_cpu_limit, processes_allowed


# -- what a run may use, by hand ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "usable, busy, claimed, wanted, expected",
    [
        (2, 0.0, 0, 10, 2),  # idle: a process per core
        (2, 1.0, 0, 10, 1),  # one core held by another program: the other one
        (2, 0.6, 0, 10, 1),  # most of a core is taken
        (2, 0.4, 0, 10, 2),  # a light load is not a taken core
        (2, 0.0, 2, 10, 1),  # another fedistill run claimed both (started a moment ago): still one, never zero
        (2, 2.0, 2, 10, 1),  # a busy run that also claimed: counted once, and at least one process
        (4, 1.0, 2, 10, 2),  # the claim is the larger: 4 - 2
        (4, 3.0, 1, 10, 1),
        (8, 0.0, 0, 3, 3),  # no more processes than a round has clients
    ],
)
def test_processes_allowed_by_hand(usable, busy, claimed, wanted, expected):
    assert processes_allowed(usable, busy, claimed, wanted) == expected


def test_busy_cores_subtracts_our_own_time():
    # 2 CPUs over a window of 100 ticks each (200 in all): 150 busy ticks, 50 of them ours -> 1 core elsewhere.
    assert busy_cores(150, 200, 50, 2) == pytest.approx(1.0)
    assert busy_cores(40, 200, 60, 2) == 0.0  # our own time is never negative load elsewhere
    assert busy_cores(10, 0, 0, 2) == 0.0


def test_cpu_ticks_reads_only_our_cpus_and_counts_iowait_as_idle(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  999 0 999 999 0 0 0 0 0 0\n"
        # user nice system idle iowait irq softirq steal guest guest_nice
        "cpu0 10 1 2 100 5 0 1 3 7 0\n"
        "cpu1 20 0 0 50 0 0 0 0 0 0\n"
        "cpu2 500 0 0 0 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    # cpu0: all = 10+1+2+100+5+0+1+3 = 122 (guest is inside user), idle = 105, busy 17; cpu1: 70, 50, 20
    assert cores._cpu_ticks([0, 1], stat) == (37, 192)
    assert cores._cpu_ticks([2], stat) == (500, 500)
    assert cores._cpu_ticks([0], tmp_path / "missing") is None


def test_process_ticks_of_this_process_grow_when_it_computes():
    import os

    before = cores.process_ticks(os.getpid())
    x = torch.randn(256, 256)
    for _ in range(400):
        x = torch.tanh(x @ x.T / 256)
    assert cores.process_ticks(os.getpid()) > before
    assert cores.process_ticks(2**22 + 12345) == 0  # no such process


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_quota(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(tmp_path, tmp_path / "no-self-cgroup") == expected


def test_cgroup_quota_of_this_process_s_own_cgroup(tmp_path):
    """Outside a container the quota is on the process's own cgroup (a Slurm job, a systemd slice), not the root."""
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "job" / "step" / "cpu.max").write_text("200000 100000\n")
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text("0::/job/step\n")
    assert cgroup_cpu_limit(tmp_path, self_cgroup) == 2.0
    self_cgroup.write_text("0::/elsewhere\n")  # not under this root: the root's own file
    assert cgroup_cpu_limit(tmp_path, self_cgroup) is None


def test_usable_cores_is_the_affinity_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(cores, "allowed_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(cores, "cgroup_cpu_limit", lambda: None)
    assert cores.usable_cores() == 4
    monkeypatch.setattr(cores, "cgroup_cpu_limit", lambda: 2.5)
    assert cores.usable_cores() == 2  # half a core does not carry a one-thread process
    monkeypatch.setattr(cores, "cgroup_cpu_limit", lambda: 0.5)
    assert cores.usable_cores() == 1


# -- other fedistill runs -------------------------------------------------------------------------------
@pytest.fixture
def other_process():
    """A live process that stands for another fedistill run."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_two_runs_started_together_split_the_cores(tmp_path, other_process):
    first = CoreLedger([0, 1], tmp_path, pid=other_process.pid)
    second = CoreLedger([0, 1], tmp_path)
    seen = []

    def decide(claimed):
        seen.append(claimed)
        return processes_allowed(2, 0.0, claimed, 10)

    assert first.claim(decide) == 2  # alone: both cores
    assert second.claim(decide) == 1  # the first's claim counts before it is busy
    assert seen == [0, 2]
    assert first.claim(decide) == 1  # its next round sees the second's claim: one each
    other_process.kill()
    other_process.wait()
    assert second.claim(decide) == 2  # the first is gone: its claim no longer counts, and is removed
    assert not first.path.exists()
    second.release()
    assert not second.path.exists()


def test_a_claim_on_other_cpus_does_not_count(tmp_path, other_process):
    CoreLedger([2, 3], tmp_path, pid=other_process.pid).claim(lambda claimed: 2)
    assert CoreLedger([0, 1], tmp_path).claim(lambda claimed: claimed) == 0
    CoreLedger([1, 2, 3], tmp_path, pid=other_process.pid).claim(lambda claimed: 3)
    assert CoreLedger([0, 1], tmp_path).claim(lambda claimed: claimed) == 1  # only the overlap, cpu 1


def test_a_torn_claim_file_is_skipped(tmp_path):
    (tmp_path / "123.json").write_text('{"pid": 12')
    assert CoreLedger([0, 1], tmp_path).claim(lambda claimed: claimed) == 0


def test_an_unwritable_claims_directory_leaves_the_busy_measure_alone(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    ledger = CoreLedger([0, 1], blocker / "claims")  # a directory cannot be made under a file
    assert ledger.claim(lambda claimed: 2 - claimed) == 2


HOLD_THE_LOCK = """
import fcntl, sys
with open(sys.argv[1], "a+") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # what a fedistill from before filelock takes, and filelock on Unix
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


@pytest.mark.skipif(os.name != "posix", reason="flock")
def test_a_claim_waits_for_the_lock_another_process_holds(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(tmp_path / "lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        ledger = CoreLedger([0, 1], tmp_path)
        result = []
        claimer = threading.Thread(target=lambda: result.append(ledger.claim(lambda claimed: 2 - claimed)))
        claimer.start()
        claimer.join(0.5)
        assert claimer.is_alive() and not ledger.path.exists()  # waiting: nothing read, nothing written
        holder.stdin.close()
        claimer.join(10)
        assert result == [2] and json.loads(ledger.path.read_text())["cores"] == 2
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_every_user_may_take_the_lock_and_read_the_claims(tmp_path):
    previous = os.umask(0o022)
    try:
        ledger = CoreLedger([0, 1], tmp_path)
        ledger.claim(lambda claimed: 1)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "lock").stat().st_mode) == 0o666
    assert stat.S_IMODE(ledger.path.stat().st_mode) == 0o644


def test_a_killed_claimer_s_temporary_goes_and_the_claims_stay(tmp_path, other_process):
    CoreLedger([0, 1], tmp_path, pid=other_process.pid).claim(lambda claimed: 1)
    leftover = tmp_path / ".4242.json.0123456789ab.tmp"  # a claim being written when its process was killed
    leftover.write_text('{"pid": 42')
    (tmp_path / "notes.txt").write_text("not ours")
    ledger = CoreLedger([0, 1], tmp_path)
    assert ledger.claim(lambda claimed: claimed) == 1  # the other run's claim still counts
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["lock", "notes.txt", f"{other_process.pid}.json", ledger.path.name])


def test_a_lock_the_file_system_cannot_take_leaves_the_busy_measure_alone(tmp_path):
    class NoFlock:  # filelock up to 3.23 on a file system without flock
        def __enter__(self):
            raise NotImplementedError("FileSystem does not appear to support flock")

        def __exit__(self, *exc):
            return False

    ledger = CoreLedger([0, 1], tmp_path)
    ledger.lock = NoFlock()
    assert ledger.claim(lambda claimed: 2 - claimed) == 2 and not ledger.usable and not ledger.path.exists()


# -- the plan, and what the header says ---------------------------------------------------------------
def test_plan_description():
    assert CorePlan(2, 1.0, 0, 1, 1).describe() == "2 cores usable, 1 busy: clients in this process, 1 thread"
    assert CorePlan(2, 0.2, 0, 2, 1).describe() == "2 cores usable: 2 client processes of 1 thread"
    assert (
        CorePlan(8, 0.0, 4, 4, 1).describe() == "8 cores usable, 4 claimed by other fedistill runs: 4 client processes of 1 thread"
    )


def test_planner_plans_from_the_measured_load_and_its_claim(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDISTILL_CLAIMS", str(tmp_path))
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    clock = [100.0]  # the planner's clock, by hand
    planner = cores.CorePlanner(threads=1, max_processes=2, clock=lambda: clock[0])
    loads = iter([1.0, 0.0])
    monkeypatch.setattr(planner.meter, "busy_elsewhere", lambda: next(loads))
    assert planner.plan().processes == 1
    clock[0] += 0.05
    assert planner.plan().processes == 1  # asked again at once (header, then round 1): the same measurement
    clock[0] += 1.0
    assert planner.plan().processes == 2  # a new window: the other program stopped
    assert planner.plan(wanted=1).processes == 1  # a round of one client
    planner.close()
    assert not list(tmp_path.glob("*.json"))


# -- the executor: the plan changes, the numbers do not ---------------------------------------------
class ScriptedPlanner:
    """Stands in for CorePlanner: each round's processes from a script (the calls that name ``wanted``: the
    header's and each round's start); asked again as clients finish, it alternates 1 and 2 processes."""

    def __init__(self, script):
        self.script = list(script)
        self.max_processes = max(self.script)
        self.own_pids = lambda: ()
        self.calls = []
        self.in_round = 0
        self.closed = False

    def plan(self, wanted=None):
        if wanted is None:
            self.in_round += 1
            return CorePlan(2, 0.0, 0, 1 + self.in_round % 2, 1)
        processes = self.script.pop(0)
        self.calls.append(processes)
        return CorePlan(2, 0.0, 0, processes, 1)

    def close(self):
        self.closed = True


def test_auto_workers_give_the_sequential_numbers_whatever_the_plan(make_config, digits, monkeypatch):
    from fedistill.engine import loop
    from fedistill.models.flat import get_flat
    from fedistill.simulation import Simulation

    here = Simulation(make_config(rounds=3, **{"run.workers": 1, "run.threads": 1}), digits)
    sequential = here.run()
    # the header's plan, then round 1 in worker processes, round 2 in this one, round 3 in workers again; within
    # a worker round the clients at once change as clients finish
    planner = ScriptedPlanner([2, 2, 1, 2])
    monkeypatch.setattr(loop, "make_planner", lambda cfg, dataset, federation: planner)
    sim = Simulation(make_config(rounds=3, **{"run.workers": "auto"}), digits)
    assert sim.core_plan() == "2 cores usable: 2 client processes of 1 thread (planned every round)"
    planned = sim.run()
    assert planner.calls == [2, 2, 1, 2] and not planner.script and planner.closed
    assert planner.in_round >= 2  # asked again as clients finished in the worker rounds
    # two one-thread workers reproduce a one-thread sequential run bit for bit: the weights and every metric
    assert torch.equal(get_flat(sim.server.model), get_flat(here.server.model))
    strip = [{k: v for k, v in row.items() if "seconds" not in k} for row in planned]
    assert strip == [{k: v for k, v in row.items() if "seconds" not in k} for row in sequential]


def test_auto_workers_evaluate_personal_models_in_the_pool_like_in_this_process(make_config, digits, monkeypatch):
    """MTFL's personalised evaluation runs through the executor too: in the planned pool, the same accuracies,
    with the private BatchNorm patches of the zoo's ResNet-8 (8 wide, as tests/test_mtfl.py) carried through the
    workers' client state."""
    from fedistill.engine import loop
    from fedistill.simulation import Simulation

    personal = {"algorithm": "mtfl", "partition.per_client_test": True, "partition.num_clients": 4, "clients_per_round": 4,
                "model.name": "resnet8", "model.kwargs": {"width": 8}, "run.threads": 1}  # fmt: skip
    here = Simulation(make_config(rounds=2, **{**personal, "run.workers": 1}), digits).run()
    planner = ScriptedPlanner([2] * 5)  # every round's training and its evaluation in two processes
    monkeypatch.setattr(loop, "make_planner", lambda cfg, dataset, federation: planner)
    pooled = Simulation(make_config(rounds=2, **{**personal, "run.workers": "auto"}), digits).run()
    assert len(planner.calls) == 4 and planner.in_round >= 2  # two rounds, each a training and an evaluation
    assert [r["personal_accuracies"] for r in pooled] == [r["personal_accuracies"] for r in here]
    assert len(here[-1]["personal_accuracies"]) == 4


def test_small_rounds_stay_in_this_process(make_config, digits):
    from fedistill.engine.loop import make_planner
    from fedistill.simulation import build_federation

    cfg = make_config(**{"run.workers": "auto"})
    planner = make_planner(cfg, digits, build_federation(cfg, digits))
    assert planner.max_processes == 1  # a digits round is a few GFLOP: processes would cost more than they give

    def never(*_):
        raise AssertionError("a run that never uses worker processes measures nothing (and never waits for a window)")

    planner.meter.busy_elsewhere = never
    plan = planner.plan(wanted=3)
    assert plan.processes == 1 and re.fullmatch(
        r"\d+ cores? usable, a round of about [\d.]+ GFLOP is too small for worker processes: clients in this process, 1 thread",
        plan.describe(),
    )
    assert json.loads(planner.ledger.path.read_text())["cores"] == 1  # still claimed, so that other runs count it
    planner.close()


def test_round_training_flops_by_hand(make_config, digits):
    """3x the forward FLOPs of one sample (2 per multiply-add) x clients per round x mean size x epochs."""
    from fedistill.engine.run_setup import round_training_flops
    from fedistill.simulation import build_federation

    cfg = make_config(**{"model.name": "logistic", "local.epochs": 2})
    federation = build_federation(cfg, digits)
    forward = 2 * 64 * 10  # 8x8 pixels to 10 classes, one sample
    mean = float(federation.client_sizes().mean())
    assert round_training_flops(cfg, digits, federation) == pytest.approx(3 * forward * cfg.clients_per_round * mean * 2)


def test_workers_config_takes_auto_or_a_count():
    from fedistill.config import build_config
    from fedistill.errors import ConfigError

    assert build_config({}).run.workers == "auto"
    assert build_config({}, {"run.workers": "3"}).run.workers == 3
    with pytest.raises(ConfigError, match="run.workers: got 0; give auto"):
        build_config({}, {"run.workers": 0})


def test_job_overrides(monkeypatch):
    from fedistill.errors import ConfigError

    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    assert cores.job_overrides("reproduce", 1, []) == []  # one run: it plans its own processes
    assert cores.job_overrides("reproduce", 2, ["a=1"]) == ["a=1", "run.workers=1"]  # the jobs are the parallelism
    assert cores.job_overrides("bench", 1, [], one_process_runs=True) == ["run.workers=1"]
    assert cores.job_overrides("bench", 2, ["run.workers=2"]) == ["run.workers=2"]  # the user's own setting stays
    with pytest.raises(ConfigError, match="bench --jobs: 3 runs at once on the 2 cores"):
        cores.job_overrides("bench", 3, [])
    assert cores.job_overrides("bench", 3, [], check_cores=False) == ["run.workers=1"]  # Ray's cluster, not ours


def test_the_pool_keeps_at_most_the_planned_clients_at_once():
    """ProcessPoolExecutor._feed over a thread pool of 4: the limit, asked as clients finish, is honoured."""
    import concurrent.futures
    import threading
    import time

    from fedistill.engine.executors import ProcessPoolExecutor

    lock, running, peak = threading.Lock(), [0], []

    def client(i):
        with lock:
            running[0] += 1
            peak.append(running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return i

    executor = ProcessPoolExecutor.__new__(ProcessPoolExecutor)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        executor._pool = pool
        for limit, most in ((None, 4), (2, 2), (lambda: 1, 1)):
            peak.clear()
            futures = executor._feed(list(range(8)), limit, lambda i: (client, i))
            assert sorted(f.result() for f in futures.values()) == list(range(8))
            assert max(peak) <= most and (most == 1 or max(peak) > 1)
        limits = iter([3] + [1] * 20)  # a run started beside this one: from three at once down to one
        peak.clear()
        executor._feed(list(range(8)), lambda: next(limits), lambda i: (client, i))
        assert len(peak) == 8 and max(peak[:3]) <= 3 and max(peak[3:]) == 1  # the first three, then one at a time


def test_a_model_the_flop_counter_cannot_follow_gets_worker_processes(make_config, digits, monkeypatch):
    """The FLOP count only decides whether processes pay off: a model it cannot run is treated as large."""
    from fedistill.engine import run_setup
    from fedistill.simulation import build_federation

    class Refuses(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("needs a real batch")

    monkeypatch.setattr(run_setup, "build_model_for", lambda *args, **kwargs: Refuses())
    cfg = make_config()
    assert run_setup.round_training_flops(cfg, digits, build_federation(cfg, digits)) == float("inf")


@pytest.mark.parametrize(
    "script, unsafe",
    [
        ("from fedistill.engine.executors import unguarded_main_script as u\nprint(u())\n", True),
        ("from fedistill.engine.executors import unguarded_main_script as u\nif __name__ == '__main__':\n    print(u())\n", False),
        ("from fedistill.engine.executors import unguarded_main_script as u\ndef go():\n    print(u())\ngo()\n", True),
        (
            "from fedistill.engine.executors import unguarded_main_script as u\ndef go():\n    print(u())\n"
            'if "__main__" == __name__:\n    go()\n',
            False,
        ),
    ],
)
def test_worker_processes_are_never_started_from_an_unguarded_script(tmp_path, script, unsafe):
    """A spawned worker imports the main script first: one that runs fedistill at its top level would run again."""
    path = tmp_path / "user_script.py"
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, check=True).stdout.strip()
    assert out == (str(path) if unsafe else "None")


def test_python_dash_c_has_no_script_to_run_again():
    code = "from fedistill.engine.executors import unguarded_main_script as u; print(u())"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "None"


def test_an_unguarded_script_gets_a_clear_error_for_a_worker_pool_and_no_pool_from_auto(tmp_path):
    if cores.usable_cores() < 2:
        pytest.skip("a one-core machine never plans worker processes")
    path = tmp_path / "user_script.py"
    path.write_text(
        "import fedistill\n"
        "from fedistill.config import build_config\n"
        "from fedistill.engine.executors import check_workers\n"
        "from fedistill.engine.loop import make_planner\n"
        "try:\n"
        "    check_workers(build_config({}, {'run.workers': 2, 'run.threads': 1}))\n"
        "except fedistill.ConfigError as exc:\n"
        "    print(exc)\n"
        "print(make_planner(build_config({}), None, None).single_reason)\n"
    )
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, check=True).stdout
    assert f"run.workers: 2 worker processes would each run {path} again" in out and "__name__" in out
    assert f"worker processes would run {path} again" in out.splitlines()[-1]
