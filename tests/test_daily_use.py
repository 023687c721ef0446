"""A researcher's daily use (issue 14): logs off a terminal, run.log, a self-describing run directory,
--version / --print-config, a summary that fits 80 columns, TensorBoard."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
import yaml
from rich.console import Console

from conftest import small_config
from fedistill.cli import main
from fedistill.config import build_config
from fedistill.errors import ConfigError
from fedistill.report.runlog import round_line
from fedistill.runner import print_summary, run_experiment
from test_dafkd import QUICK as DAFKD_QUICK
from test_fd import fd_config
from test_fedftg import FAST as FEDFTG_FAST

RUN = ["run", "--rounds", "3", "--clients", "6", "--clients-per-round", "3", "--set", "run.threads=1"]


def only_run_dir(out):
    (path,) = [p for p in out.iterdir() if p.is_dir()]
    return path


def test_off_a_terminal_every_round_prints_one_line_at_once_and_run_log_has_them(tmp_path, capsys):
    assert main([*RUN, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()  # captured: not a terminal, as under nohup or SLURM
    rounds = [line for line in out if line.startswith("round ")]
    assert [line.split()[1] for line in rounds] == ["1/3", "2/3", "3/3"]
    assert all(re.search(r"acc \d+\.\d\d%  test loss \d\.\d{4}  train loss \d\.\d{4}  \d+\.\d s$", r) for r in rounds)
    assert out[0].startswith("fedavg on digits") and out.index(rounds[0]) == 2  # the header comes first,
    assert re.match(r"cores: \d+ cores? usable.*: .*1 thread", out[1])  # then how the run uses the cores
    log = (only_run_dir(tmp_path) / "run.log").read_text().splitlines()
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
    assert all(re.match(stamp, line) for line in log)
    assert [re.sub(stamp, "", line) for line in log[2:5]] == rounds  # the same lines, timestamped
    assert "finished: final global accuracy" in log[-1]


# Methods whose rows carry the most fields: a personal accuracy with traffic (the distillation methods), a
# generator (DaFKD, FedFTG), a personalised model (pFedMe). Tiny settings: a couple of seconds each.
ROUND_LINE_METHODS = {
    "fedavg": lambda: small_config(rounds=2),
    "pfedme": lambda: small_config(rounds=2, **{"algorithm.name": "pfedme", "local.momentum": 0.0}),
    "dafkd": lambda: small_config(rounds=2, **{"algorithm.name": "dafkd"}, **DAFKD_QUICK),
    "fedftg": lambda: small_config(rounds=2, algorithm="fedftg", **FEDFTG_FAST),
    "fedict": lambda: fd_config("fedict", rounds=2, clients=["fd_resnet2"]),
    "fedgkt": lambda: fd_config("fedgkt", rounds=2, clients=["fd_resnet2"]),
}


@pytest.mark.parametrize("method", ROUND_LINE_METHODS)
def test_off_a_terminal_a_round_line_fits_80_columns(method, tmp_path):
    cfg = ROUND_LINE_METHODS[method]()
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"out_dir": str(tmp_path), "threads": 1})})
    out = io.StringIO()
    run_experiment(cfg, console=Console(file=out, width=200))  # wider than the line: rich must not be what cuts it
    rounds = [line for line in out.getvalue().splitlines() if line.startswith("round ")]
    assert [line.split()[1] for line in rounds] == ["1/2", "2/2"]
    assert all(len(line) <= 80 for line in rounds), rounds
    assert all(re.search(r"acc \d+\.\d\d%  (test|train) loss \d+\.\d{4}  .*\d+\.\d s$", line) for line in rounds), rounds


def test_a_round_line_drops_traffic_then_the_train_loss_rather_than_pass_80_columns():
    """Long runs, big models and a diverging loss: the extras go, round/total, accuracy, loss and seconds stay."""
    row = {"round": 7, "test_accuracy": 98.12, "test_loss": 0.0567, "train_loss": 0.0123, "seconds": 12.3,
           "bytes_down": 460_000, "bytes_up": 460_000}  # fmt: skip
    roomy = round_line(row, 9, "test_accuracy", width=120)
    assert roomy == "round 7/9  acc 98.12%  test loss 0.0567  train loss 0.0123  down/up 0.46/0.46 MB  12.3 s"
    long_run = round_line(row, 200, "test_accuracy")
    assert long_run == "round   7/200  acc 98.12%  test loss 0.0567  train loss 0.0123  12.3 s"  # aligned under 100/200
    assert round_line(row, 200, "test_accuracy", width=60) == "round   7/200  acc 98.12%  test loss 0.0567  12.3 s"
    personal = {**row, "personal_accuracy": 100.0, "test_loss": None, "bytes_up": 123_456e6}  # distillation, no test loss
    assert round_line(personal, 9, "personal_accuracy", width=60) == "round 7/9  personal acc 100.00%  train loss 0.0123  12.3 s"
    worst = {**row, "round": 12345, "test_accuracy": 100.0, "test_loss": 1e12, "train_loss": float("nan"),
             "bytes_down": 1e12, "bytes_up": 1e12, "seconds": 123456.7}  # fmt: skip
    for key in ("test_accuracy", "personal_accuracy"):
        line = round_line({**worst, "personal_accuracy": 100.0}, 99999, key)
        assert len(line) <= 80 and "12345/99999" in line and "100.00%" in line, line
        assert "test loss 1e+12" in line and line.endswith("123456.7 s"), line


def test_quiet_keeps_the_rounds_out_of_the_console_but_not_out_of_run_log(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # off a terminal with no width given: rich's 80 columns
    assert main(["-q", *RUN, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "round 1/3" not in out and "summary" in out
    summary = out.splitlines()[out.splitlines().index("summary"):]
    assert len(summary) >= 3 and max(map(len, summary)) <= 80, summary  # a log file's summary fits 80 columns
    assert "final acc %" in out and "best round" in out
    assert "round 3/3" in (only_run_dir(tmp_path) / "run.log").read_text()


def test_config_yaml_is_fully_resolved_and_round_trips_to_the_same_run(tmp_path, capsys):
    args = [*RUN, "--algorithm", "fedprox", "--set", "algorithm.plus=fedavgm", "--set", "partition.alpha=0.3"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    first = only_run_dir(tmp_path / "a")
    saved = yaml.safe_load((first / "config.yaml").read_text())
    assert saved["model"]["name"] == "digits_cnn" and saved["dataset"]["augment"] == [] and saved["partition"]["seed"] == 0
    assert saved["algorithm"]["mu"] == 0.5 and saved["algorithm"]["implementation"] == "loss"  # defaults written out
    assert saved["algorithm"]["plus"]["fedavgm"] == {"weighting": "samples", "grad_clip": None, "server_momentum": 0.7, "server_lr": 1.0}
    assert build_config(saved).resolved_dict() == saved
    # the saved file alone reproduces the run's numbers
    assert main(["run", "--config", str(first / "config.yaml"), "--out", str(tmp_path / "b")]) == 0
    rows = lambda d: [(r["test_accuracy"], r["train_loss"]) for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]  # noqa: E731
    assert rows(only_run_dir(tmp_path / "b")) == rows(first)
    env = json.loads((first / "environment.json").read_text())
    assert {"fedistill", "torch", "python", "flwr", "git", "cpu", "precision", "torch_threads", "workers"} <= set(env)
    assert env["precision"] == "fp32" and env["torch"]


def test_version_and_print_config_run_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and re.fullmatch(r"fedistill \d+\.\d+\.\d+\n", capsys.readouterr().out)
    assert main(["run", "--algorithm", "fedntd", "--print-config", "--out", str(tmp_path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["algorithm"]["name"] == "fedntd" and "beta" in printed["algorithm"]
    assert not any(tmp_path.iterdir())  # nothing ran, nothing written


def test_the_summary_fits_80_columns_and_drops_nothing():
    summary = {
        "rounds": 200, "final_accuracy": 94.71, "best_accuracy": 95.02, "best_round": 138, "target_accuracy": 90.0,
        "rounds_to_target": None, "bytes_down": 12345678901, "bytes_up": 123456789, "seconds": 123456.5,
    }  # fmt: skip
    console = Console(width=80, file=io.StringIO(), record=True)
    name = "fedlmd-cifar10-a-very-long-run-directory-name-seed-2"
    print_summary(console, {name: summary})
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    flat = " ".join(text.split())
    for piece in (name, "rounds 200", "final acc % 94.71", "best acc % 95.02", "best round 138", "not reached", "12.3 GB", "123.5 MB", "123456.5"):
        assert piece in flat, piece
    wide = Console(width=150, file=io.StringIO(), record=True)
    print_summary(wide, {name: summary})
    table = wide.export_text()
    assert "best round" in table and "┃" in table  # the table on wide terminals


def test_tensorboard_gets_every_round_and_a_missing_package_is_one_clear_error(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    cfg = build_config({"rounds": 2, "run": {"tensorboard": True, "progress": False, "threads": 1, "out_dir": str(tmp_path)}})
    run_experiment(cfg, console=Console(file=io.StringIO()))
    events = list(only_run_dir(tmp_path).glob("tensorboard/events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert [e.step for e in acc.Scalars("test_accuracy")] == [1, 2]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were not installed
    with pytest.raises(ConfigError, match=r"run.tensorboard: the tensorboard package is not installed; install it with"):
        run_experiment(cfg.model_copy(update={"run": cfg.run.model_copy(update={"out_dir": str(tmp_path / "x")})}))
    assert not (tmp_path / "x").exists()  # refused before anything was written
