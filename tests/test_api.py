"""The public Python API (issue 27): fedistill.run / load_run / make_config, and a method of one's own registered
from outside the package."""

from __future__ import annotations

import pytest

import fedistill
from fedistill.registry import ALGORITHMS

TINY = {"rounds": 2, "clients_per_round": 3, "partition": {"num_clients": 6}, "local": {"epochs": 1}}


def test_the_package_exports_the_api():
    for name in ("run", "load_run", "compare", "make_config", "Config", "RunResult", "Algorithm", "Message",
                 "register_algorithm", "register_dataset", "register_model", "register_partition"):  # fmt: skip
        assert name in dir(fedistill) and getattr(fedistill, name) is not None
    with pytest.raises(AttributeError):
        fedistill.not_a_thing  # noqa: B018


def test_run_is_silent_and_returns_what_the_run_directory_holds(tmp_path, capsys):
    result = fedistill.run(TINY, out_dir=str(tmp_path), name="api", threads=1, local={"lr": 1e-2})
    assert capsys.readouterr().out == ""
    assert result.run_dir == tmp_path / "api" and len(result.history) == 2
    assert result.final_accuracy == result.history[-1]["test_accuracy"] == result.summary["final_accuracy"]
    assert result.config["local"]["lr"] == 0.01 and result.config["run"]["threads"] == 1
    again = fedistill.load_run(result.run_dir)
    assert again.history == result.history and again.summary == result.summary


def test_make_config_reads_paths_dicts_and_keyword_overrides():
    cfg = fedistill.make_config("digits_fedavg", rounds=3, local__batch_size=16, algorithm={"name": "fedprox", "mu": 0.5})
    assert (cfg.rounds, cfg.local.batch_size, cfg.algorithm.name, cfg.algorithm.params_dict()["mu"]) == (3, 16, "fedprox", 0.5)
    assert cfg.partition.alpha == 0.1  # from the shipped file
    with pytest.raises(fedistill.ConfigError, match="local.lr"):
        fedistill.make_config(TINY, local={"lr": -1})


PLUGIN = '''
import torch
import fedistill
from fedistill.algorithms.fedavg import FedAvg


@fedistill.register_algorithm("plugin_frozen", help="FedAvg that keeps the initial global model")
class PluginFrozen(FedAvg):
    def aggregate(self, server, info, replies):
        before = [p.detach().clone() for p in server.model.parameters()]
        super().aggregate(server, info, replies)
        with torch.no_grad():
            for p, old in zip(server.model.parameters(), before):
                p.copy_(old)
        return {}
'''


def test_a_method_of_ones_own_registered_from_outside_runs_by_name(tmp_path, monkeypatch):
    """A user's code: subclass, register, run by name (the plugin file below, executed here as a script would
    run it). It keeps the global model (no aggregation), so every round's accuracy is the initial model's: a run
    that used FedAvg instead would change it."""
    monkeypatch.setattr(ALGORITHMS, "_entries", dict(ALGORITHMS._entries))
    monkeypatch.setattr(ALGORITHMS, "_help", dict(ALGORITHMS._help))
    namespace: dict = {}
    exec(compile(PLUGIN, "my_method.py", "exec"), namespace)  # noqa: S102  (the test's own source)
    assert namespace["PluginFrozen"].name == "plugin_frozen" and "plugin_frozen" in ALGORITHMS
    frozen = fedistill.run(TINY, algorithm="plugin_frozen", out_dir=str(tmp_path), name="frozen", threads=1)
    moving = fedistill.run(TINY, algorithm="fedavg", out_dir=str(tmp_path), name="fedavg", threads=1)
    accuracies = [row["test_accuracy"] for row in frozen.history]
    assert accuracies[0] == accuracies[1] and moving.history[1]["test_accuracy"] != accuracies[1]
    assert frozen.config["algorithm"]["name"] == "plugin_frozen"


def test_cli_plugin_file_registers_a_method_for_the_run_and_its_child_processes(tmp_path, monkeypatch, capsys):
    """``fedistill run --plugin FILE.py``: the file's method runs by name, and $FEDISTILL_PLUGINS carries it to
    processes the run starts; a missing plugin is a one-line error with exit 2."""
    from fedistill import plugins
    from fedistill.cli import main

    monkeypatch.setattr(ALGORITHMS, "_entries", dict(ALGORITHMS._entries))
    monkeypatch.setattr(ALGORITHMS, "_help", dict(ALGORITHMS._help))
    monkeypatch.setattr(plugins, "_loaded", set())
    monkeypatch.setenv(plugins.PLUGIN_ENV, "")  # restored (unset) after the test, whatever --plugin adds
    path = tmp_path / "my_method.py"
    path.write_text(PLUGIN)
    fast = ["--rounds", "2", "--clients", "6", "--clients-per-round", "3", "--epochs", "1", "--no-progress"]
    assert main(["run", "--plugin", str(path), "--algorithm", "plugin_frozen", *fast, "--out", str(tmp_path), "--name", "p"]) == 0
    result = fedistill.load_run(tmp_path / "p")
    assert result.config["algorithm"]["name"] == "plugin_frozen"
    assert result.history[0]["test_accuracy"] == result.history[1]["test_accuracy"]
    assert str(path.resolve()) in plugins.os.environ[plugins.PLUGIN_ENV]
    capsys.readouterr()
    assert main(["run", "--plugin", str(tmp_path / "missing.py"), *fast, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: plugin") and "no such file" in err and "\n" not in err.strip()


TAKES_FEDAVG = '''
import fedistill


@fedistill.register_algorithm("fedavg")
class MyFedAvg(fedistill.Algorithm):
    """Takes a name fedistill already has; imports nothing that registers fedistill's own methods first."""
'''


def test_a_plugin_that_takes_a_built_in_name_stops_with_one_line_naming_the_plugin_and_the_name(tmp_path):
    """A fresh process, as a user's: fedistill's own names are registered before the plugin's, so the plugin is
    the one refused (not fedistill's fedavg later, with a traceback)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "my_methods.py"
    path.write_text(TAKES_FEDAVG)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "FEDISTILL_PLUGINS": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "fedistill.cli", "list", "--plugin", str(path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: plugin ") and "my_methods.py" in line and "'fedavg'" in line, line
    assert "already taken (by fedistill's built-in fedavg); rename it" in line, line


def test_the_second_of_two_plugins_that_take_one_name_is_the_one_named(tmp_path, monkeypatch, capsys):
    from fedistill import plugins
    from fedistill.cli import main

    for attribute in ("_entries", "_help", "_owners"):
        monkeypatch.setattr(ALGORITHMS, attribute, dict(getattr(ALGORITHMS, attribute)))
    monkeypatch.setattr(plugins, "_loaded", set())
    monkeypatch.setenv(plugins.PLUGIN_ENV, "")
    first, second = tmp_path / "first_methods.py", tmp_path / "second_methods.py"
    for path in (first, second):
        path.write_text(PLUGIN.replace("plugin_frozen", "plugin_twin"))
    assert main(["list", "--plugin", str(first), "--plugin", str(second)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: plugin {second.resolve()} registers algorithm 'plugin_twin'"), line
    assert line.endswith(f"already taken (by plugin {first.resolve()}); rename it"), line
    assert "plugin_twin" in ALGORITHMS  # the first plugin's registration stands


def test_registering_a_taken_name_from_python_says_the_name_is_taken():
    from fedistill.algorithms.fedavg import FedAvg

    with pytest.raises(ValueError, match=r"^algorithm 'fedavg' is already taken \(by fedistill's built-in fedavg\)"):
        fedistill.register_algorithm("fedavg")(type("MyFedAvg", (fedistill.Algorithm,), {}))
    assert ALGORITHMS.get("fedavg") is FedAvg
