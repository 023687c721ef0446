"""Worker processes: how they start, what they see, and how they end.

Every pool of fedistill (a run's client workers, ``run.workers``; whole runs, ``bench --jobs`` and ``reproduce
--jobs``) takes its processes from ``process_context``: forked from a fork server that imported torch and fedistill
once, so that a pool starts in milliseconds instead of seconds a process. A worker takes the parent's environment
as it is when its pool starts (``adopt_environment``) and ends with the process whose pool it serves
(``exit_with_owner``); an interrupted pool is stopped, not waited for (``abandon_pool``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
from typing import Any, Iterator, Mapping

from .interrupts import uninterrupted

# What the fork server imports once, so that a worker forked from it starts in milliseconds. A spawned process
# imports them itself, about 5 s on an idle AVX2-only AMD EPYC (torch 2.2 s, fedistill 0.5 s, and torch._dynamo
# 2.1 s, which torch.optim imports on its first step), and every pool paid that again: 6-7 s for a pool of two, each
# bench --jobs, each run.workers run (benchmarks/RESULTS.md, "Worker start").
FORK_SERVER_PRELOAD = ["torch", "torch._dynamo", "fedistill.algorithms", "fedistill.models", "fedistill.runs", "fedistill.engine.loop"]


def process_context() -> Any:
    """The multiprocessing context of every pool: a fork server that has imported torch and fedistill, where the
    platform has one (Linux, macOS), else spawn (Windows). Never plain fork: forking a process whose OpenMP
    runtime has run a parallel region can deadlock; the fork server forks from a process that has only imported
    (no tensor op ever ran in it), as DataLoader workers fork after torch's import. A worker still imports the
    parent's ``__main__`` script first, as a spawned one does (engine/executors.py ``unguarded_main_script``), and
    takes the parent's environment as it is when the pool starts (``adopt_environment``), not as it was when the
    server started."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORK_SERVER_PRELOAD)  # read once, when this process's fork server starts
    return context


def adopt_environment(environment: Mapping[str, str]) -> None:
    """Make this worker's ``os.environ`` the parent's at the time the pool started. A forked worker inherits the
    fork server's environment, frozen when the server started (the first pool of the process): a later
    ``--plugin`` ($FEDISTILL_PLUGINS), data directory or claims directory would otherwise not reach it. Every
    variable fedistill reads is read at call time, after this."""
    if dict(os.environ) != dict(environment):
        os.environ.clear()
        os.environ.update(environment)


def _init_run_process(environment: Mapping[str, str], owner: int) -> None:
    """A ``run_pool`` process: the parent's environment, and an end with the parent (``owner``)."""
    adopt_environment(environment)
    exit_with_owner(owner)


def process_identity(pid: int) -> tuple[int, str] | None:
    """``pid`` with its start time where /proc has it (Linux), so that a reused pid is not taken for the process;
    None once the process is gone or a zombie (killed, not yet reaped by its own parent). On Windows, where a
    signal 0 would end the process and workers are spawned children of their owner, only the parent id is
    watched (``exit_with_owner``)."""
    if os.name == "nt":
        return (pid, "")
    if not os.path.isdir("/proc/self"):  # no /proc (macOS): a signal 0 says whether the pid is in use
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return (pid, "")
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else (pid, fields[19])


def exit_with_owner(owner: int, poll_seconds: float = 1.0) -> None:
    """End this worker when ``owner``, the process whose pool it serves, is gone (killed with SIGKILL, or by a
    signal it did not handle): otherwise the worker lives on, holding its memory and writing into run directories
    that the next command resumes. A daemon thread looks once a second. The owner is not the worker's parent: a
    worker is forked from the fork server (``process_context``), which lives as long as any worker does, so its
    end cannot be waited for. On a clean shutdown the pool stops the worker first."""
    import threading
    import time

    identity = process_identity(owner)
    parent = os.getppid()

    def watch() -> None:
        while identity is not None and process_identity(owner) == identity and os.getppid() == parent:
            time.sleep(poll_seconds)
        os._exit(1)

    threading.Thread(target=watch, name="fedistill-owner-watch", daemon=True).start()


def abandon_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Stop a process pool whose running tasks are thrown away (an interrupted round; an interrupted bench, whose
    cells resume from their checkpoints): its workers are terminated, not waited for."""
    # CPython's record of the pool's worker processes (pid -> Process), read before shutdown clears it.
    workers = list((getattr(pool, "_processes", None) or {}).values())
    # The pool's manager thread, also read before shutdown forgets it: see the join below.
    manager = getattr(pool, "_executor_manager_thread", None)
    with uninterrupted():
        pool.shutdown(wait=False, cancel_futures=True)
    _quiet_resource_sharer_resets()
    for process in workers:
        process.terminate()
    for process in workers:
        process.join(timeout=10)
    # Let the manager thread see its workers gone and close its wake-up pipe before we return. Otherwise the
    # command can exit (143) while that thread is still closing the pipe, and CPython 3.11's exit hook
    # (concurrent.futures.process._python_exit) writes to it as it closes: "OSError: Bad file descriptor" and a
    # traceback after our clean "terminated: ..." line. 3.12 takes a lock there; 3.11 does not.
    if manager is not None:
        manager.join(timeout=10)


@contextlib.contextmanager
def run_pool(jobs: int) -> Iterator[concurrent.futures.ProcessPoolExecutor]:
    """``jobs`` processes for whole runs (``reproduce --jobs``, ``bench --jobs``), from ``process_context``: no
    forked torch state; plugins travel in $FEDISTILL_PLUGINS. A run process ends with the command, however it
    ends: interrupted (SIGTERM, Ctrl-C), the running runs are stopped, not waited for, and resume from their last
    checkpoints; killed, each process sees the command gone within a second, instead of writing on, orphaned,
    into the run directories that the next command resumes. Submit under ``uninterrupted()``."""
    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=process_context(), initializer=_init_run_process, initargs=(dict(os.environ), os.getpid())
    )
    try:
        yield pool
    except KeyboardInterrupt:
        abandon_pool(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _quiet_resource_sharer_resets() -> None:
    """A worker terminated while it fetched a task's shared tensors leaves multiprocessing's resource-sharer
    thread (which hands tensor storage to workers) with a reset connection, which it reports through
    sys.excepthook as a traceback. After an abandoned round that is expected: drop those reports, and only those."""
    import sys

    previous = sys.excepthook
    if getattr(previous, "_fedistill_quiet_resets", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        frames, step = [], tb
        while step is not None:
            frames.append(step.tb_frame.f_code.co_filename)
            step = step.tb_next
        if issubclass(kind, ConnectionError) and any(f.endswith(os.path.join("multiprocessing", "resource_sharer.py")) for f in frames):
            return
        previous(kind, value, tb)

    hook._fedistill_quiet_resets = True  # type: ignore[attr-defined]
    sys.excepthook = hook
