"""A whole Flower federation on this machine: one SuperLink and N SuperNodes as subprocesses on 127.0.0.1.

For local trials and the tests. Every process runs in its own process group and ``close()`` kills the
groups (the SuperExec and ClientApp/ServerApp children included); ports are chosen free; ``FLWR_HOME``
is a private directory, so the user's ``~/.flwr`` is neither read nor written. The SuperLink is started
with ``--disable-runtime-dependency-installation`` (and ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``
in the environment), so the apps run in this Python environment and nothing is ever installed.

``clientapp="worker"`` starts every SuperNode with ``--isolation process`` and, next to it, a long-running
ClientApp worker (``python -m fedistill.flower clientapp``, :mod:`.worker`) instead of Flower's SuperExec
and its process per message; ``poll_interval=S`` starts the SuperNodes through
``python -m fedistill.flower supernode --poll-interval S`` (:mod:`.supernode`), which polls the SuperLink
every S seconds during a run instead of every 3 s. The defaults are Flower's own processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tomli_w

import fedistill

CONNECTION = "fedistill-local"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _bin(name: str) -> str:
    """The Flower executable next to this Python (the project's virtual environment), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: install the flower extra (pip install 'fedistill[flower]')")
    return found


def flower_env(flwr_home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every Flower process: this venv first on PATH, fedistill importable, no installs."""
    env = dict(os.environ)
    src = str(Path(fedistill.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["FLWR_HOME"] = str(flwr_home)
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    # SuperExec looks for new ClientApp/ServerApp tasks every second by default; 0.2 s shortens each round.
    env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = env.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2")
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class LocalFederation:
    """``with LocalFederation(workdir, 3) as fed: run_id = fed.submit(app_dir)``; everything stops on exit."""

    def __init__(
        self,
        workdir: str | Path,
        num_supernodes: int,
        node_config: dict[int, dict[str, Any]] | None = None,
        clientapp: str = "subprocess",
        poll_interval: float | None = None,
        worker_poll_interval: float | None = None,
    ) -> None:
        if clientapp not in ("subprocess", "worker"):
            raise ValueError(f"clientapp must be 'subprocess' (Flower's process per message) or 'worker', not {clientapp!r}")
        self.workdir = Path(workdir)
        self.num_supernodes = num_supernodes
        self.node_config = node_config or {}
        self.clientapp = clientapp
        self.poll_interval = poll_interval
        self.worker_poll_interval = worker_poll_interval
        self.workers: dict[int, subprocess.Popen] = {}
        self.flwr_home = self.workdir / "flwr-home"
        self.env = flower_env(self.flwr_home)
        self.port = 0
        self.superlink: subprocess.Popen | None = None
        self.supernodes: dict[int, subprocess.Popen] = {}
        self._logs: list[Any] = []

    # -- processes --------------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        self._logs.append(log)
        return subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, start_new_session=True)

    def start(self, timeout: float = 60.0) -> "LocalFederation":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.superlink = self._spawn(
            "superlink",
            [_bin("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
             "--host", "127.0.0.1", "--port", str(self.port)],
        )
        deadline = time.monotonic() + timeout
        while not _port_open(self.port):
            if self.superlink.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the SuperLink did not start; see {self.workdir / 'superlink.log'}")
            time.sleep(0.2)
        self.write_connection()
        for i in range(self.num_supernodes):
            self.start_supernode(i)
        return self

    def start_supernode(self, partition_id: int) -> subprocess.Popen:
        config = {"partition-id": partition_id, "num-partitions": self.num_supernodes, **self.node_config.get(partition_id, {})}
        text = " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())
        port = free_port()
        if self.poll_interval is None:
            command = [_bin("flower-supernode")]
        else:
            command = [sys.executable, "-m", "fedistill.flower", "supernode", "--poll-interval", str(self.poll_interval)]
        command += ["--insecure", "--superlink", f"127.0.0.1:{self.port}", "--host", "127.0.0.1", "--port", str(port),
                    "--node-config", text]
        if self.clientapp == "worker":
            command += ["--isolation", "process"]
        proc = self._spawn(f"supernode-{partition_id}", command)
        self.supernodes[partition_id] = proc
        if self.clientapp == "worker":
            self.workers[partition_id] = self._spawn(
                f"clientapp-{partition_id}",
                [sys.executable, "-m", "fedistill.flower", "clientapp", "--insecure",
                 "--runtime-api-address", f"127.0.0.1:{port}", "--parent-pid", str(proc.pid)]
                + ([] if self.worker_poll_interval is None else ["--poll-interval", str(self.worker_poll_interval)]),
            )
        return proc

    def write_connection(self) -> Path:
        """``$FLWR_HOME/config.toml`` with the connection ``fedistill-local`` to this SuperLink."""
        path = self.flwr_home / "config.toml"
        path.write_text(
            tomli_w.dumps({"superlink": {"default": CONNECTION, CONNECTION: {"address": f"127.0.0.1:{self.port}", "insecure": True}}})
        )
        return path

    def kill_supernode(self, partition_id: int) -> None:
        """SIGKILL a SuperNode and everything it started (a crash, not a graceful leave)."""
        procs = [self.supernodes.pop(partition_id)] + ([self.workers.pop(partition_id)] if partition_id in self.workers else [])
        children = [pid for proc in procs for pid in descendants(proc.pid)]
        for proc in procs:
            _kill_group(proc, signal.SIGKILL)
        _kill_pids(children, signal.SIGKILL)

    def close(self) -> None:
        procs = list(self.workers.values()) + list(self.supernodes.values()) + ([self.superlink] if self.superlink else [])
        # SuperExec and the app processes run in sessions of their own: collect them before their parents go.
        children = [pid for proc in procs for pid in descendants(proc.pid)]
        for proc in procs:
            _kill_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_group(proc, signal.SIGKILL)
        _kill_pids(children, signal.SIGKILL)
        self.supernodes.clear()
        self.workers.clear()
        self.superlink = None
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> "LocalFederation":
        try:
            return self.start()
        except BaseException:  # a failed or interrupted start: stop what did start (`with` will not)
            self.close()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the flwr CLI -----------------------------------------------------------------------------
    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_bin("flwr"), *args], env=self.env, cwd=self.workdir, capture_output=True, text=True, timeout=timeout
        )

    def submit(self, app_dir: str | Path, run_config: str | None = None) -> int:
        """``flwr run APP fedistill-local``; returns the run id."""
        args = ["run", str(app_dir), CONNECTION, "--format", "json"]
        if run_config:
            args += ["--run-config", run_config]
        done = self.flwr(*args)
        try:
            return int(json.loads(done.stdout)["run-id"])
        except (ValueError, KeyError, TypeError):
            raise RuntimeError(f"flwr run failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}") from None

    def run_info(self, run_id: int) -> dict[str, Any]:
        """``flwr ls --run-id ID --format json``'s entry for the run (``status``, ``status-details`` ...)."""
        done = self.flwr("list", CONNECTION, "--run-id", str(run_id), "--format", "json")
        try:
            return dict(json.loads(done.stdout)["runs"][0])
        except (ValueError, KeyError, IndexError, TypeError):
            return {"status": f"unknown ({done.stdout.strip()} {done.stderr.strip()})"}

    def run_status(self, run_id: int) -> str:
        """``finished:completed``, ``finished:failed`` (a fedistill error, with the reason in
        ``status-details``), ``running`` ...: ``flwr run`` exits 0 either way, so this is how to tell."""
        return str(self.run_info(run_id)["status"])

    def wait(self, run_id: int, timeout: float = 300.0, interval: float = 2.0) -> dict[str, Any]:
        """Wait until the run has finished (completed, failed or stopped); its ``flwr ls`` entry. Asked every
        ``interval`` seconds: each ``flwr ls`` is a process that costs about 1.5 s of a core."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.run_info(run_id)
            if str(info.get("status", "")).startswith("finished") or time.monotonic() > deadline:
                return info
            time.sleep(interval)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc; empty elsewhere)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        for kill in (lambda: os.killpg(pid, sig), lambda: os.kill(pid, sig)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is not None and sig == signal.SIGTERM:
        sig = signal.SIGKILL  # the leader is gone; its children may not be
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
