"""Worker processes come from a fork server (engine/processes.py ``process_context``): they start without
importing torch again, yet see the parent's environment as it is when their pool starts, and end with the
process whose pool they serve, which is not their parent."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from fedistill.engine.processes import process_context, process_identity, run_pool

pytestmark = pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server on this platform")


def _variable(name: str) -> str | None:
    return os.environ.get(name)


def _torch_was_imported_before_the_task() -> bool:
    return "torch" in sys.modules


def test_a_pool_started_after_the_fork_server_sees_the_environment_of_now(monkeypatch):
    with run_pool(1) as pool:  # starts this process's fork server (if no earlier test did) with the env of then
        assert pool.submit(_variable, "FEDISTILL_TEST_LATE").result() is None
    monkeypatch.setenv("FEDISTILL_TEST_LATE", "set after the server started")
    with run_pool(1) as pool:
        assert pool.submit(_variable, "FEDISTILL_TEST_LATE").result() == "set after the server started"
        assert pool.submit(_torch_was_imported_before_the_task).result()  # preloaded by the server, not by the task
    monkeypatch.delenv("FEDISTILL_TEST_LATE")
    with run_pool(1) as pool:  # and a variable removed since is gone
        assert pool.submit(_variable, "FEDISTILL_TEST_LATE").result() is None


def test_the_context_is_the_fork_server_not_fork():
    assert process_context().get_start_method() == "forkserver"


def test_a_process_is_known_by_pid_and_start_time_until_it_is_a_zombie():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = process_identity(child.pid)
        assert identity is not None and identity[0] == child.pid
        assert process_identity(child.pid) == identity  # the same process, asked again
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_identity(child.pid) is not None:  # dead but not reaped (a zombie) already counts as gone
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    assert process_identity(child.pid) is None  # reaped


_OWNER = """
import sys, time
from fedistill.engine.processes import run_pool

def report(path):
    import os
    open(path, "w").write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    with run_pool(1) as pool:
        pool.submit(report, sys.argv[1])
        time.sleep(120)
"""


def test_a_worker_ends_when_its_owner_is_killed_though_its_parent_the_fork_server_lives_on(tmp_path):
    from conftest import live_processes

    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    marker = tmp_path / "worker.pid"
    owner = subprocess.Popen([sys.executable, str(script), str(marker)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    try:
        deadline = time.monotonic() + 120
        while not (marker.exists() and marker.read_text()):
            assert owner.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        worker = int(marker.read_text())
        assert process_identity(worker) is not None
        owner.kill()  # SIGKILL: no handler runs, the pool is never shut down
        owner.wait()
        deadline = time.monotonic() + 15
        while live_processes({worker}):
            assert time.monotonic() < deadline, "the worker outlived the process whose pool it served"
            time.sleep(0.2)
    finally:
        owner.kill()
        if worker is not None and live_processes({worker}):
            os.kill(worker, signal.SIGKILL)


def test_without_proc_a_process_is_known_by_a_signal_zero(monkeypatch):
    """macOS has no /proc: there a live pid is known (with no start time) and a reaped one is gone, rather than
    every owner looking gone at once, which would end each worker as it starts."""
    import fedistill.engine.processes as processes

    real_isdir = os.path.isdir
    monkeypatch.setattr(processes.os.path, "isdir", lambda path: False if path == "/proc/self" else real_isdir(path))
    assert process_identity(os.getpid()) == (os.getpid(), "")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_identity(child.pid) is None
