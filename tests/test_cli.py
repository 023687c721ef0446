"""The `fedistill` command end to end, its run directory, and its one-line errors (exit code 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedistill.cli import main

# run.figures=false except where a test reads the run's figures (test_run_writes_the_whole_run_directory)
FAST = ["--rounds", "3", "--clients", "6", "--clients-per-round", "3", "--epochs", "1", "--no-progress", "--set", "run.figures=false"]


def _run(tmp_path: Path, *extra: str, name: str = "r") -> Path:
    assert main(["run", *FAST, "--out", str(tmp_path), "--name", name, *extra]) == 0
    return tmp_path / name


def test_run_writes_the_whole_run_directory(tmp_path, capsys):
    run = _run(tmp_path, "--target", "30", "--set", "run.figures=true")  # the last --set wins
    for name in ("config.yaml", "metrics.jsonl", "metrics.csv", "summary.json", "partition_counts.csv", "accuracy.png", "partition.png", "checkpoint.pt"):
        assert (run / name).is_file(), name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    for key in ("test_accuracy", "test_loss", "train_loss", "bytes_down", "bytes_up", "seconds", "lr"):
        assert key in rows[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_accuracy"] == max(r["test_accuracy"] for r in rows)
    assert summary["status"] == "finished"
    csv_lines = (run / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].startswith("round,") and len(csv_lines) == 4
    assert len((run / "partition_counts.csv").read_text().splitlines()) == 7  # header + 6 clients
    out = capsys.readouterr().out
    assert "summary" in out and "best" in out


def test_set_overrides_and_yaml_config_are_applied(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("algorithm: fedavgm\nlocal:\n  lr: 0.02\n")
    run = _run(tmp_path, "--config", str(cfg), "--set", "algorithm.server_momentum=0.5", "--set", "local.batch_size=16")
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())
    # every parameter written out: the one set, and the defaults (issue 14: a self-describing run directory)
    assert saved["algorithm"] == {"name": "fedavgm", "server_momentum": 0.5, "server_lr": 1.0, "weighting": "samples", "grad_clip": None}
    assert saved["local"]["lr"] == 0.02 and saved["local"]["batch_size"] == 16


def test_resume_continues_to_the_numbers_of_an_uninterrupted_run(tmp_path):
    full = _run(tmp_path, "--rounds", "4", name="full")
    part = _run(tmp_path, "--rounds", "2", name="part")
    assert main(["run", "--resume", str(part), "--rounds", "4", "--no-progress"]) == 0
    load = lambda p: [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    a, b = load(full), load(part)
    assert [r["round"] for r in b] == [1, 2, 3, 4]
    assert [r["test_accuracy"] for r in a] == [r["test_accuracy"] for r in b]
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]


@pytest.mark.draw_figures  # the curves' file is checked for its size
def test_compare_prints_a_table_and_saves_curves(tmp_path, capsys):
    a = _run(tmp_path, name="a")
    b = _run(tmp_path, "--algorithm", "fedavgm", name="b")
    out_png = tmp_path / "cmp.png"
    assert main(["compare", str(a), str(b), "--out", str(out_png), "--target", "20"]) == 0
    text = capsys.readouterr().out
    assert "a" in text and "b" in text and out_png.is_file() and out_png.stat().st_size > 1000


def test_partition_command_prints_counts_and_saves_heatmap(tmp_path, capsys):
    png = tmp_path / "p.png"
    assert main(["partition", "--partition", "shards", "--shards", "2", "--clients", "10", "--out", str(png)]) == 0
    text = capsys.readouterr().out
    assert "client" in text and "statistics" in text and png.is_file()


def test_list_names_every_registry(capsys):
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    for name in ("fedavg", "fedavgm", "digits", "mnist", "cnn", "lda", "shards", "client_dirichlet"):
        assert name in text


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--algorithm", "fedmagic"], "algorithm.name: unknown algorithm 'fedmagic'"),
        (["--alpha", "0"], "partition.alpha"),
        (["--alpha", "-1"], "partition.alpha"),
        (["--clients", "4", "--clients-per-round", "5"], "clients_per_round"),
        (["--set", "local.lrr=0.1"], "local.lrr: unknown key"),
        (["--set", "algorithm.server_momentum=0.5"], "algorithm.server_momentum: not a parameter of fedavg"),
        (["--dataset", "imagenet"], "dataset.name: unknown dataset"),
        (["--set", "local.epochs=-1"], "local.epochs"),
        (["--set", "run.precision=fp8"], "run.precision"),
        (["--set", "dataset.augment=[rotate]"], "dataset.augment"),
        (["--model", "vgg"], "model.name"),
        (["--set", "partition.min_size=1000"], "partition"),
        (["--set", "dataset.train_samples=100000"], "dataset.train_samples: 100000 is more than the"),
        (["--set", "dataset.train_samples=0"], "dataset.train_samples"),
    ],
)
def test_bad_input_gives_a_one_line_error_and_exit_code_2(tmp_path, capsys, args, expected):
    code = main(["run", *FAST, "--out", str(tmp_path), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert expected in err


def test_missing_dataset_files_name_the_files_and_the_directory(tmp_path, capsys):
    code = main(["run", *FAST, "--dataset", "mnist", "--data-dir", str(tmp_path), "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and "train-images-idx3-ubyte" in err and str(tmp_path) in err


def test_bad_config_file_is_reported(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    assert main(["run", "--config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["run", "--config", str(tmp_path / "nope.yaml")]) == 2


def test_existing_run_directory_is_not_overwritten(tmp_path, capsys):
    _run(tmp_path, name="same")
    assert main(["run", *FAST, "--out", str(tmp_path), "--name", "same"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_console_script_exit_code_in_a_real_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "fedistill.cli", "run", "--alpha", "-3", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: partition.alpha")


def test_progress_bar_shows_round_and_accuracy(tmp_path, capsys):
    args = [a for a in FAST if a != "--no-progress"]
    assert main(["run", *args, "--out", str(tmp_path), "--name", "p"]) == 0
    out = capsys.readouterr().out
    assert "round 3/3" in out and "acc " in out and "%" in out
