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
