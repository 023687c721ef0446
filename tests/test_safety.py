"""Issue 9: safe checkpoints, runs that can always be continued, validation before any work.

Every bad input gives one line (``error: ...``) and exit code 2, writes nothing, and never runs code from
a run directory; every interrupted run can be continued.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from conftest import child_processes, live_processes, without_timings

from fedistill.cli import main

# run.figures=false: these runs check files, errors and resumes, not figures (about 0.6 s a run; issue 62 item 9)
FAST = ["--rounds", "2", "--clients", "6", "--clients-per-round", "3", "--epochs", "1", "--no-progress", "--set", "run.figures=false"]


def _run(tmp_path: Path, *extra: str, name: str = "r") -> Path:
    assert main(["run", *FAST, "--out", str(tmp_path), "--name", name, *extra]) == 0
    return tmp_path / name


def _one_line_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


class _Planted:
    """A pickled object that would create ``marker`` when unpickled (what an attacker would plant)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# -- 1. a tampered checkpoint or client-state file never runs code --------------------------------------
def test_a_malicious_checkpoint_is_refused_without_running_its_code(tmp_path, capsys):
    run = _run(tmp_path)
    marker = tmp_path / "pwned"
    payload = torch.load(run / "checkpoint.pt", weights_only=True)
    payload["history"].append(_Planted(marker))  # one extra object among genuine content
    torch.save(payload, run / "checkpoint.pt")
    config_before = (run / "config.yaml").read_text()
    assert main(["run", "--resume", str(run), "--rounds", "3", "--no-progress"]) == 2
    assert not marker.exists()
    _one_line_error(capsys, "checkpoint", "not loaded")
    assert (run / "config.yaml").read_text() == config_before  # a failed resume rewrites nothing


def test_a_malicious_client_state_file_is_refused_without_running_its_code(tmp_path, capsys):
    run = _run(tmp_path, "--algorithm", "scaffold", "--set", "run.client_state=disk")
    files = sorted((run / "client_states").glob("*.pt"))
    assert files
    marker = tmp_path / "pwned"
    for path in files:  # whichever client is sampled next loads a planted file
        torch.save({"scaffold_c": _Planted(marker)}, path)
    assert main(["run", "--resume", str(run), "--rounds", "4", "--no-progress"]) == 2
    assert not marker.exists()
    _one_line_error(capsys, "state file", "not loaded")


def test_a_corrupt_client_state_file_is_one_line(tmp_path, capsys):
    run = _run(tmp_path, "--algorithm", "scaffold", "--set", "run.client_state=disk")
    for victim in sorted((run / "client_states").glob("*.pt")):
        victim.write_bytes(b"\x00garbage" * 10)
    assert main(["run", "--resume", str(run), "--rounds", "4", "--no-progress"]) == 2
    _one_line_error(capsys, "client_states", "cannot be read")


# -- 2. run names stay inside run.out_dir ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../../escaped", "/tmp/absolute-run", "a/b", ".."])
def test_run_names_outside_the_output_directory_are_refused(tmp_path, capsys, name):
    out = tmp_path / "runs"
    assert main(["run", *FAST, "--out", str(out), "--name", name]) == 2
    _one_line_error(capsys, "run.name")
    assert not out.exists() and not (tmp_path / "escaped").exists() and not Path("/tmp/absolute-run").exists()


# -- 3. a run that died before its first checkpoint ------------------------------------------------------
def test_resume_of_a_run_without_checkpoint_starts_it_from_round_one(tmp_path, capsys):
    full = _run(tmp_path, name="full")
    died = _run(tmp_path, name="died")
    (died / "checkpoint.pt").unlink()  # as if killed after round 1's row, before any checkpoint
    lines = (died / "metrics.jsonl").read_text().splitlines()
    (died / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:20])
    (died / "summary.json").unlink()
    assert main(["run", *FAST, "--out", str(tmp_path), "--name", "died"]) == 2
    assert "--resume" in _one_line_error(capsys, "already exists")
    assert main(["run", "--resume", str(died), "--no-progress"]) == 0
    assert "round 1" in capsys.readouterr().out
    assert without_timings(_rows(died)) == without_timings(_rows(full))


def test_resume_without_checkpoint_removes_the_client_state_files_of_the_dead_attempt(tmp_path):
    full = _run(tmp_path, "--algorithm", "scaffold", "--set", "run.client_state=disk", name="full")
    died = _run(tmp_path, "--algorithm", "scaffold", "--set", "run.client_state=disk", name="died")
    (died / "checkpoint.pt").unlink()
    assert main(["run", "--resume", str(died), "--no-progress"]) == 0
    assert _rows(died)[-1]["test_accuracy"] == _rows(full)[-1]["test_accuracy"]


# -- 5. resumes that fail, are pointless, or would change the numbers ------------------------------------
def test_a_pointless_resume_is_refused_and_rewrites_nothing(tmp_path, capsys):
    run = _run(tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert main(["run", "--resume", str(run), "--rounds", "1", "--no-progress"]) == 2
    _one_line_error(capsys, "already has 2 rounds")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_resume_of_a_finished_run_does_not_rewrite_its_config(tmp_path):
    run = _run(tmp_path)
    config = (run / "config.yaml").read_bytes()
    assert main(["run", "--resume", str(run), "--no-progress", "--set", "run.checkpoint_every=5"]) == 0
    assert (run / "config.yaml").read_bytes() == config
    assert [r["round"] for r in _rows(run)] == [1, 2]


@pytest.mark.parametrize(
    "change", ["run.precision=bf16", "run.threads=1", "run.channels_last=false", "run.workers=2", "run.cohort=2"]
)
def test_a_resume_that_changes_the_numbers_needs_an_explicit_flag_and_is_recorded(tmp_path, capsys, change, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # the same thread arithmetic on any machine
    run = _run(tmp_path, "--set", "run.threads=2" if "workers" not in change else "run.threads=1")
    config = (run / "config.yaml").read_bytes()
    if "workers" in change:
        change = "run.workers=2"  # threads 1 per worker: same thread count, allowed without the flag
        assert main(["run", "--resume", str(run), "--rounds", "3", "--no-progress", "--set", change]) == 0
        assert not (run / "resumes.jsonl").exists()
        return
    assert main(["run", "--resume", str(run), "--rounds", "3", "--no-progress", "--set", change]) == 2
    _one_line_error(capsys, "--allow-numeric-change")
    assert (run / "config.yaml").read_bytes() == config
    assert main(["run", "--resume", str(run), "--rounds", "3", "--no-progress", "--set", change, "--allow-numeric-change"]) == 0
    record = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert record[0]["after_round"] == 2 and record[0]["changed"]


def test_a_run_of_the_old_every_core_default_resumes_only_with_its_thread_count(tmp_path, capsys, monkeypatch, keep_threads):
    """Before run.threads defaulted to 1, an unset count was every core (client_threads 2 on two cores): such a
    checkpoint's resume under the new default is a numeric change, and the error says which --set keeps it."""
    import fedistill.engine.run_setup as run_setup

    monkeypatch.setattr(run_setup, "client_threads", lambda cfg: cfg.run.threads or 2)  # the old default, here 2
    run = _run(tmp_path)
    monkeypatch.undo()
    assert main(["run", "--resume", str(run), "--rounds", "3", "--no-progress"]) == 2
    _one_line_error(capsys, "client_threads: 2 -> 1", "--set run.threads=2")
    assert main(["run", "--resume", str(run), "--rounds", "3", "--no-progress", "--set", "run.threads=2"]) == 0


# -- 6. a half-written metrics line ------------------------------------------------------------------------
def test_compare_and_reproduce_read_a_half_written_last_metrics_line(tmp_path, capsys):
    from fedistill.report.rundir import read_run

    run = _run(tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"round": 3, "test_accur')
    _, rows, _ = read_run(run)
    assert [r["round"] for r in rows] == [1, 2]
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png")]) == 0


def test_a_damaged_metrics_line_in_the_middle_is_one_line(tmp_path, capsys):
    run = _run(tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("{broken\n" + "\n".join(lines) + "\n")
    assert main(["compare", str(run), "--out", str(tmp_path / "c.png")]) == 2
    _one_line_error(capsys, "metrics.jsonl", "line 1")


# -- 7, 8. validation before any work ----------------------------------------------------------------------
def _nothing_written(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir())


def test_too_many_worker_threads_are_refused_before_the_run_directory_exists(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    out = tmp_path / "runs"
    assert main(["run", *FAST, "--out", str(out), "--set", "run.workers=2", "--set", "run.threads=2"]) == 2
    _one_line_error(capsys, "run.workers")
    _nothing_written(out)


@pytest.mark.parametrize("device,words", [("banana", ["run.device", "not a device"]), ("cuda:7", ["run.device"])])
def test_unusable_devices_are_one_line(tmp_path, capsys, device, words):
    out = tmp_path / "runs"
    assert main(["run", *FAST, "--out", str(out), "--set", f"run.device={device}"]) == 2
    _one_line_error(capsys, *words)
    _nothing_written(out)


def test_cuda_without_cuda_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["run", *FAST, "--out", str(tmp_path / "runs"), "--set", "run.device=cuda"]) == 2
    _one_line_error(capsys, "run.device", "no usable CUDA")


def test_an_output_directory_that_is_a_file_is_one_line(tmp_path, capsys):
    target = tmp_path / "afile"
    target.write_text("x")
    assert main(["run", *FAST, "--out", str(target)]) == 2
    _one_line_error(capsys, "run.out_dir", "is a file")
    assert main(["run", *FAST, "--out", str(target / "below")]) == 2
    _one_line_error(capsys, "is a file")


def test_a_binary_yaml_file_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "garbage.yaml"
    cfg.write_bytes(bytes(range(256)) * 4)
    assert main(["run", "--config", str(cfg), "--out", str(tmp_path / "runs")]) == 2
    _one_line_error(capsys, "garbage.yaml")


@pytest.mark.parametrize("content,words", [("- a\n- b\n", ["mapping", "list"]), ("rounds: [1,\n", ["not valid YAML", "line"])])
def test_a_run_directory_with_a_bad_config_is_one_line_naming_the_file(tmp_path, capsys, content, words):
    run = _run(tmp_path)
    (run / "config.yaml").write_text(content)
    assert main(["run", "--resume", str(run), "--no-progress"]) == 2
    _one_line_error(capsys, str(run / "config.yaml"), *words)


def test_resume_of_a_missing_directory_is_one_line(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path / "nope")]) == 2
    _one_line_error(capsys, "not a directory")


# -- 9. values accepted today and wrong --------------------------------------------------------------------
@pytest.mark.parametrize(
    "override,key",
    [
        ("local.lr=.inf", "local.lr"),
        ("local.lr=.nan", "local.lr"),
        ("rounds=true", "rounds"),
        ("rounds=1e23", "rounds"),
        ("rounds=100000000000000000000000", "rounds"),
        ("partition.min_size=0", "partition.min_size"),
        ("algorithm.name=fedprox", None),  # control: valid
    ],
)
def test_wrong_values_are_refused(tmp_path, capsys, override, key):
    from fedistill.config import build_config
    from fedistill.errors import ConfigError

    if key is None:
        build_config({}, [override])
        return
    with pytest.raises(ConfigError, match=f"^{key.replace('.', '[.]')}:"):
        build_config({}, [override])


def test_algorithm_parameters_are_strict_too():
    from fedistill.config import build_config
    from fedistill.errors import ConfigError

    with pytest.raises(ConfigError, match="algorithm.mu"):
        build_config({"algorithm": {"name": "fedprox", "mu": float("inf")}})
    with pytest.raises(ConfigError, match="algorithm.server_momentum"):
        build_config({"algorithm": {"name": "fedavgm", "server_momentum": True}})


def test_yaml_errors_keep_their_line_and_column(tmp_path, capsys):
    cfg = tmp_path / "tabs.yaml"
    cfg.write_text("rounds: 3\nlocal:\n\tlr: 0.1\n")
    assert main(["run", "--config", str(cfg)]) == 2
    _one_line_error(capsys, "line 3, column 1", "tabs.yaml")


def test_an_error_in_a_run_directory_config_says_it_came_from_that_file(tmp_path, capsys):
    run = _run(tmp_path)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["local"]["lr"] = -1.0
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert main(["run", "--resume", str(run), "--no-progress"]) == 2
    _one_line_error(capsys, str(run / "config.yaml"), "local.lr")
    # A bad override is the user's flag, not the file's.
    saved["local"]["lr"] = 0.05
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert main(["run", "--resume", str(run), "--no-progress", "--set", "local.epochs=-1"]) == 2
    err = _one_line_error(capsys, "local.epochs")
    assert "config.yaml" not in err


def test_unknown_keys_suggest_the_closest_valid_key(capsys):
    assert main(["run", "--set", "local.batchsize=5"]) == 2
    _one_line_error(capsys, "local.batchsize", "did you mean 'batch_size'")
    assert main(["run", "--set", "algorithm.name=fedprox", "--set", "algorithm.muu=0.1"]) == 2
    _one_line_error(capsys, "did you mean 'mu'")


# -- 11. non-finite logits with finite weights --------------------------------------------------------------
def _nan_evaluation(monkeypatch, after_round: int):
    """From evaluation ``after_round`` on, the global model's logits are non-finite while its weights stay
    finite (what broken BatchNorm statistics do): a forward hook turns the output into NaN."""
    import fedistill.engine.server as simulation

    real = simulation.evaluate
    calls = {"n": 0}

    def evaluate(model, batches, precision, **options):
        calls["n"] += 1
        if calls["n"] < after_round:
            return real(model, batches, precision, **options)
        handle = model.register_forward_hook(lambda module, inputs, output: output * float("nan"))
        try:
            return real(model, batches, precision, **options)
        finally:
            handle.remove()

    monkeypatch.setattr(simulation, "evaluate", evaluate)


def test_a_nan_test_loss_stops_the_run_as_diverged(tmp_path, capsys, monkeypatch):
    _nan_evaluation(monkeypatch, after_round=2)
    out = tmp_path / "runs"
    assert main(["run", *FAST, "--rounds", "3", "--out", str(out), "--name", "nan"]) == 1
    err = capsys.readouterr().err
    assert "round 2" in err and "test loss" in err
    summary = json.loads((out / "nan" / "summary.json").read_text())
    assert summary["status"] == "diverged"
    assert [r["round"] for r in _rows(out / "nan")] == [1]  # the non-finite round is not a result


def test_reproduce_shows_a_nan_test_loss_as_a_failed_cell(tmp_path, monkeypatch):
    from fedistill.studies.reproduce import Preset, reproduce

    _nan_evaluation(monkeypatch, after_round=2)
    preset = Preset.model_validate(
        {
            "name": "nan",
            "title": "NaN loss",
            "source": "test",
            "paper_rounds": 3,
            "base": {
                "clients_per_round": 3,
                "partition": {"scheme": "lda", "num_clients": 6, "alpha": 0.5},
                "local": {"epochs": 1, "batch_size": 32},
                "run": {"figures": False, "progress": False, "checkpoint_every": 1},
            },
            "columns": {"lda": {"label": "LDA"}},
            "methods": {"FedAvg": {"config": {"algorithm": {"name": "fedavg"}}}},
        }
    )
    rows = reproduce(preset, tmp_path / "out", rounds=3)
    assert rows[0]["failed"] is not None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process parents from /proc")
def test_sigterm_stops_the_workers_notes_the_round_and_the_run_resumes(tmp_path):
    """A scheduler's SIGTERM takes the Ctrl-C path: exit 143 with the resume command, a note in run.log, and
    the worker processes end with the run (the default action left them running, 340 MB each)."""
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "t"
    cmd = [sys.executable, "-m", "fedistill.cli", "run", "--rounds", "30", "--clients", "6", "--clients-per-round", "4",
           "--epochs", "3", "--no-progress", "--out", str(tmp_path), "--name", "t",
           "--set", "run.workers=2", "--set", "run.threads=1", "--set", "run.checkpoint_every=1",
           "--set", "run.figures=false"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    workers = child_processes(proc.pid)
    assert workers  # the pool (and multiprocessing's resource tracker) are running
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert f"terminated: continue with `fedistill run --resume {run}`" in err and "Traceback" not in err, err
    assert "interrupted after round" in (run / "run.log").read_text()
    deadline = time.monotonic() + 15
    while live_processes(workers):
        assert time.monotonic() < deadline, "worker processes outlived the run"
        time.sleep(0.2)
    done = (run / "metrics.jsonl").read_text().count("\n")
    # Resumed in this process without the pool (one thread a client either way: no numeric change, no flag; the
    # pool's own resume is test_a_resume_that_changes_the_numbers_...[run.workers=2]): two spawned workers fewer.
    assert main(["run", "--resume", str(run), "--rounds", str(done + 1), "--no-progress", "--set", "run.workers=1"]) == 0
    assert (run / "metrics.jsonl").read_text().count("\n") == done + 1


def test_a_termination_inside_the_pools_bookkeeping_is_held_until_every_task_is_submitted():
    """A SIGTERM that lands inside concurrent.futures' submit (its lock held, its wake-up pipe half-written) could
    leave the pool's shutdown waiting forever; the handler holds it and it is raised once the submits are done."""
    import concurrent.futures

    from fedistill.cli import _raise_terminated, _Terminated
    from fedistill.engine.executors import ProcessPoolExecutor
    from fedistill.engine.interrupts import raise_or_hold, uninterrupted
    from fedistill.protocol import Message

    submitted = []

    class Pool:
        def submit(self, fn, *args):
            submitted.append(args[0])
            if len(submitted) == 1:
                _raise_terminated(15, None)  # what the signal handler does, here mid-submit
            done = concurrent.futures.Future()
            done.set_result(({}, {}))
            return done

    executor = ProcessPoolExecutor.__new__(ProcessPoolExecutor)  # no workers needed: the pool is the fake above
    executor._pool, executor._sizes = Pool(), [5, 9, 7]
    with pytest.raises(_Terminated):
        executor.run([(cid, None, Message({}), {}) for cid in range(3)])
    assert sorted(submitted) == [0, 1, 2]  # every submit completed before the termination was raised
    with pytest.raises(_Terminated):  # outside the pool's bookkeeping it is raised at once
        raise_or_hold(_Terminated())
    with pytest.raises(_Terminated):  # nested blocks hold it until the outermost ends
        with uninterrupted():
            with uninterrupted():
                raise_or_hold(_Terminated())
            submitted.append("inner block ended without raising")
    assert submitted[-1] == "inner block ended without raising"


def test_an_abandoned_pool_terminates_its_running_workers_instead_of_waiting_for_them():
    """After an interrupt the round's results are thrown away: close(abandon=True) must not wait for a client that
    is still training (a big one can take minutes); its worker is terminated."""
    import concurrent.futures
    import multiprocessing
    import time

    from fedistill.engine.executors import ProcessPoolExecutor

    executor = ProcessPoolExecutor.__new__(ProcessPoolExecutor)
    executor._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    running = executor._pool.submit(time.sleep, 600)  # a client that would train for ten minutes
    deadline = time.monotonic() + 60
    while not executor._pool._processes:
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    worker = next(iter(executor._pool._processes))
    started = time.monotonic()
    executor.close(abandon=True)
    assert time.monotonic() - started < 30  # not the 600 s the task would take
    # gone or a zombie (the pool's manager thread and close both reap it, so Process.is_alive cannot tell)
    assert not live_processes({worker})
    # the pool's manager thread sees its worker gone and fails the abandoned task: nothing is left waiting on it
    concurrent.futures.wait([running], timeout=30)
    assert isinstance(running.exception(timeout=0), concurrent.futures.process.BrokenProcessPool)


def test_an_abandoned_pool_has_closed_its_wake_up_pipe_before_the_command_exits():
    """CI saw "OSError: Bad file descriptor" and a traceback after a terminated bench's clean exit line: the
    pool's manager thread was still closing its wake-up pipe while CPython 3.11's exit hook wrote to it. So
    abandon_pool returns only once that thread has ended and the pipe is closed (the exit hook skips a closed
    one). Without the join the thread was still alive here 9 times in 10."""
    import concurrent.futures
    import multiprocessing
    import time

    from fedistill.engine.processes import abandon_pool

    for _ in range(3):
        pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
        running = [pool.submit(time.sleep, 600) for _ in range(2)]
        deadline = time.monotonic() + 60
        while not running[0].running():  # handed to the workers' call queue: the manager thread is at work
            assert time.monotonic() < deadline, "the tasks never reached the workers' queue"
            time.sleep(0.05)
        manager, wakeup = pool._executor_manager_thread, pool._executor_manager_thread_wakeup
        abandon_pool(pool)
        assert not manager.is_alive()
        assert wakeup._closed


def test_after_an_abandoned_round_only_the_resource_sharers_connection_resets_are_silenced(monkeypatch, capsys):
    """Terminating a worker mid-fetch makes multiprocessing's resource-sharer thread report a reset connection
    through sys.excepthook (seen as a traceback after a SIGTERM); exactly those reports are dropped."""
    import os
    import sys

    from fedistill.engine.processes import _quiet_resource_sharer_resets

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    _quiet_resource_sharer_resets()
    _quiet_resource_sharer_resets()  # idempotent: one filter, not a chain of them

    def report(kind, where):
        code = compile(f"raise {kind}('from {where}')", os.path.join("lib", where), "exec")
        try:
            exec(code, {})
        except BaseException:
            sys.excepthook(*sys.exc_info())
        return capsys.readouterr().err

    assert report("ConnectionResetError", os.path.join("multiprocessing", "resource_sharer.py")) == ""
    assert "ConnectionResetError: from elsewhere.py" in report("ConnectionResetError", "elsewhere.py")
    assert "ValueError: from" in report("ValueError", os.path.join("multiprocessing", "resource_sharer.py"))


def test_an_interrupted_run_abandons_its_executor(digits):
    """Simulation.run closes the executor with abandon=True when a round is interrupted (once: the finally's
    close finds it gone)."""
    from conftest import small_config

    from fedistill.simulation import Simulation

    sim = Simulation(small_config(), digits)
    closes = []
    real_executor = sim.executor

    class Recording:
        def run(self, tasks):
            return real_executor.run(tasks)

        def evaluate(self, tasks):
            return real_executor.evaluate(tasks)

        def close(self, abandon=False):
            closes.append(abandon)

    sim._executor = Recording()

    def interrupt(row):
        if row["round"] == 2:
            raise KeyboardInterrupt

    sim.on_round = interrupt
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    assert closes == [True] and sim.state.round == 2


def test_a_reader_that_goes_away_is_not_an_error():
    """`fedistill bench SUITE --cells | head`: the closed pipe ends the command quietly (exit 141, as a shell's
    own tools do), not with 'error: Broken pipe'."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom fedistill import cli\n"
        "def closed(args):\n    raise BrokenPipeError(32, 'Broken pipe')\n"
        "cli.cmd_list = closed\nsys.exit(cli.main(['list']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_ctrl_c_before_a_run_directory_exists_says_there_is_nothing_to_continue(tmp_path, capsys, monkeypatch):
    import fedistill.runner as runner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "load_dataset_for", interrupted)
    assert main(["run", *FAST, "--out", str(tmp_path), "--name", "x"]) == 130
    assert "interrupted: no run had started" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "argv,words",
    [
        (["compare", "RUN", "--target", "-5"], ["--target", "above 0"]),
        (["compare", "RUN", "--target", "nan"], ["--target"]),
        (["compare", "RUN", "--out", "OUT/missing/c.png"], ["--out", "does not exist"]),
        (["compare", "RUN", "--out", "OUT"], ["--out", "is a directory"]),
        (["partition", "--out", "OUT/missing/p.png"], ["--out", "does not exist"]),
        (["partition", "--max-rows", "-3"], ["--max-rows", "negative"]),
        (["run", "--set", "algorithm.plus=fedprox,fedprox", "--print-config"], ["fedprox given more than once"]),
        (["run", "--resume", "RUN", "--name", "other"], ["--resume", "drop --name"]),
    ],
)
def test_more_bad_inputs_are_one_line_before_any_work(tmp_path, capsys, argv, words):
    run = _run(tmp_path, name="base")
    capsys.readouterr()
    argv = [a.replace("RUN", str(run)).replace("OUT", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    _one_line_error(capsys, *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # nothing written


def test_one_process_with_more_threads_than_cores_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert main(["run", *FAST, "--out", str(tmp_path), "--name", "x", "--set", "run.threads=8"]) == 2
    _one_line_error(capsys, "run.threads", "exceed the 2 CPU cores")


def test_partition_finds_the_shipped_configs_from_anywhere(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["partition", "--config", "configs/digits_fedavg.yaml", "--out", "p.png", "--max-rows", "0"]) == 0
    assert (tmp_path / "p.png").exists()


def test_compare_without_an_extension_writes_png_files(tmp_path):
    run = _run(tmp_path, name="base")
    assert main(["compare", str(run), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp.png").exists() and (tmp_path / "cmp_class_distributions.png").exists()


def test_a_run_resumes_from_a_moved_data_directory(tmp_path):
    """dataset.data_dir, download and verify say where the files are, not what the run computes."""
    run = _run(tmp_path, "--rounds", "1")
    assert main(["run", "--resume", str(run), "--rounds", "2", "--data-dir", str(tmp_path / "moved"), "--no-verify", "--no-progress"]) == 0
    assert (run / "metrics.jsonl").read_text().count("\n") == 2


def test_a_full_disk_while_writing_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    import errno

    import fedistill.runner as runner

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x" / "partition.png"))

    monkeypatch.setattr(runner, "plot_partition", full)
    assert main(["run", *FAST, "--set", "run.figures=true", "--out", str(tmp_path), "--name", "x"]) == 1  # the last --set wins
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "No space left on device" in err and "partition.png" in err and "Traceback" not in err


def test_a_server_model_a_weight_averaging_method_does_not_train_is_said_not_claimed(tmp_path, capsys):
    """FedAvg with model.server: a warning that it is unused, and the run's header names only the model it trains."""
    run = _run(tmp_path, "--set", "model.server=fd_server_mlp")
    assert "model.server (fd_server_mlp) is not used" in capsys.readouterr().err
    assert "fd_server_mlp" not in (run / "run.log").read_text()


def test_a_run_name_too_long_for_a_directory_is_a_config_error(tmp_path, capsys):
    """Issue 27: a 300-character name used to end with exit 1 and the operating system's message after the
    checks; it is refused with the others (exit 2, one line), and 200 bytes (with "-seedN" to come) still pass."""
    assert main(["run", *FAST, "--out", str(tmp_path), "--name", "x" * 300]) == 2
    _one_line_error(capsys, "run.name", "300 bytes", "at most 200")
    assert not any(tmp_path.iterdir())
    assert main(["run", *FAST, "--out", str(tmp_path), "--name", "é" * 101]) == 2  # 202 bytes in UTF-8
    _one_line_error(capsys, "202 bytes")
    assert main(["run", *FAST, "--out", str(tmp_path), "--name", "x" * 200]) == 0
