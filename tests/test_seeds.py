"""Seeds as a first-class axis (issue 14 item 3): `run --seeds` writes one run directory per seed and a
group summary; `compare` takes groups beside runs (mean ± std, a mean curve with a ±1 std band)."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from rich.console import Console

from fedistill import runner
from fedistill.cli import main
from fedistill.errors import TrainingDiverged
from fedistill.report.groups import format_stat, format_to_target, group_members, group_summary, mean_curve

# run.figures=false: the groups' own figures (drawn from the seeds' metrics) are what these tests read, not each seed's
TINY = ["--rounds", "2", "--clients", "4", "--clients-per-round", "2", "--epochs", "1", "--no-progress", "--set", "run.threads=1", "--set", "run.figures=false"]


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """`run --seeds 0 1` once for the module (target 1%: every seed reaches it in round 1)."""
    out = tmp_path_factory.mktemp("seeds")
    assert main(["run", "--seeds", "0", "1", *TINY, "--target", "1", "--out", str(out), "--name", "grp"]) == 0
    return out / "grp"


def _summary(path):
    return json.loads((path / "summary.json").read_text())


def test_group_summary_by_hand():
    summaries = {
        0: {"final_accuracy": 80.0, "best_accuracy": 84.0, "rounds_to_target": 5, "seconds": 10.0, "target_accuracy": 75.0},
        1: {"final_accuracy": 90.0, "best_accuracy": 90.0, "rounds_to_target": None, "seconds": 20.0, "target_accuracy": 75.0},
        2: {"final_accuracy": 100.0, "best_accuracy": 96.0, "rounds_to_target": 7, "seconds": 30.0, "target_accuracy": 75.0},
    }
    g = group_summary(summaries)
    assert g["seeds"] == [0, 1, 2] and g["counted"] == "3/3" and g["target_accuracy"] == 75.0
    assert g["final_accuracy"] == {"mean": 90.0, "std": 10.0, "n": 3}
    assert g["best_accuracy"] == {"mean": 90.0, "std": 6.0, "n": 3}
    assert g["seconds"] == {"mean": 20.0, "std": 10.0, "n": 3}
    # over the seeds that reached the target: 5 and 7 -> mean 6, std sqrt(2)
    rtt = g["rounds_to_target"]
    assert rtt["mean"] == 6.0 and rtt["std"] == pytest.approx(2**0.5) and rtt["n"] == 2 and rtt["reached"] == "2/3"
    assert [e["dir"] for e in g["runs"]] == ["seed0", "seed1", "seed2"]
    assert format_stat(g["final_accuracy"]) == "90.00 ± 10.00" and format_to_target(g) == "6.0 ± 1.4 (2/3)"
    # a diverged seed is listed but left out of the statistics
    g = group_summary({**summaries, 3: {"final_accuracy": 10.0, "status": "diverged", "target_accuracy": 75.0}})
    assert g["final_accuracy"]["mean"] == 90.0 and g["counted"] == "3/4" and g["runs"][3]["status"] == "diverged"
    # one seed: no standard deviation; no target: no count of seeds reaching it
    g = group_summary({4: {"final_accuracy": 80.0, "best_accuracy": 84.0, "target_accuracy": None}})
    assert g["final_accuracy"] == {"mean": 80.0, "std": None, "n": 1} and format_stat(g["final_accuracy"]) == "80.00 ± n/a"
    assert g["rounds_to_target"]["reached"] is None and format_to_target(g) == "-"


def test_mean_curve_takes_only_the_rounds_every_seed_has():
    rounds, mean, std = mean_curve([[(1, 10.0), (2, 20.0), (3, 30.0)], [(1, 20.0), (2, 40.0)]])
    assert rounds == [1, 2] and mean == [15.0, 30.0] and std == pytest.approx([np.std([10, 20], ddof=1), np.std([20, 40], ddof=1)])
    assert mean_curve([[(1, 5.0)]]) == ([1], [5.0], None)  # one seed: no standard deviation (issue 62), no band


def test_run_seeds_writes_a_run_per_seed_and_the_group_summary(group):
    assert sorted(p.name for p in group.iterdir()) == ["group.json", "group.md", "seed0", "seed1"]
    runs = {s: group / f"seed{s}" for s in (0, 1)}
    for s, path in runs.items():
        assert yaml.safe_load((path / "config.yaml").read_text())["seed"] == s
        assert (path / "checkpoint.pt").is_file() and _summary(path)["status"] == "finished"
    g = json.loads((group / "group.json").read_text())
    assert g["name"] == "grp" and g["complete"] and g["seeds"] == [0, 1] and g["counted"] == "2/2"
    for key in ("final_accuracy", "best_accuracy", "seconds"):
        values = [_summary(p)[key] for p in runs.values()]
        assert g[key]["mean"] == pytest.approx(np.mean(values)) and g[key]["std"] == pytest.approx(np.std(values, ddof=1)), key
    assert [e["final_accuracy"] for e in g["runs"]] == [_summary(p)["final_accuracy"] for p in runs.values()]
    # different seeds: different runs
    rows = {s: [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()] for s, p in runs.items()}
    assert [r["test_accuracy"] for r in rows[0]] != [r["test_accuracy"] for r in rows[1]]
    # rounds to target: every seed reached 1% in round 1
    assert g["target_accuracy"] == 1.0 and g["rounds_to_target"] == {"mean": 1.0, "std": 0.0, "n": 2, "reached": "2/2"}
    md = (group / "group.md").read_text()
    assert "| mean ± std |" in md and format_stat(g["final_accuracy"]) in md


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--seeds", "0", "1", "--seed", "3"], "--seeds and --seed"),
        (["--seeds", "0", "1", "--set", "seed=3"], "--seeds and --seed"),
        (["--seeds", "0", "--resume", "somewhere"], "--resume GROUP_DIR/seedN"),
        (["--seeds", "0", "1", "0"], "seed 0 is given 2 times"),
        (["--seeds"], "at least one seed"),
        (["--seeds", "0", "-1"], "seed: "),  # the second seed is invalid: refused before the first runs
        (["--seeds", "0", "--set", "local.lr=-1"], "local.lr"),
    ],
)
def test_seeds_refusals_are_one_line_and_write_nothing(tmp_path, capsys, args, expected):
    assert main(["run", *TINY, "--out", str(tmp_path), "--name", "g", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and expected in err and "\n" not in err
    assert not any(tmp_path.iterdir())


def test_an_existing_group_directory_is_refused(tmp_path, capsys):
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "notes.txt").write_text("x")
    assert main(["run", "--seeds", "0", *TINY, "--out", str(tmp_path), "--name", "g"]) == 2
    err = capsys.readouterr().err
    assert "group directory" in err and "--name" in err
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["notes.txt"]


def test_print_config_with_seeds_shows_the_first_seed_and_runs_nothing(tmp_path, capsys):
    assert main(["run", "--seeds", "3", "4", *TINY, "--out", str(tmp_path), "--name", "g", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# seed 3, the first of --seeds 3 4")
    cfg = yaml.safe_load(text)
    assert cfg["seed"] == 3 and cfg["run"]["name"] == "seed3" and cfg["run"]["out_dir"] == str(tmp_path / "g")
    assert not any(tmp_path.iterdir())


def _fake_runs(monkeypatch, fail_seed, error):
    """run_experiment replaced: seeds write a summary.json at once; ``fail_seed`` raises ``error``."""

    def fake(cfg, console=None, quiet=False, **_):
        path = runner.Path(cfg.run.out_dir) / cfg.run.name
        path.mkdir(parents=True)
        summary = {"final_accuracy": 50.0 + cfg.seed, "best_accuracy": 60.0 + cfg.seed, "target_accuracy": None, "run_dir": str(path)}
        if cfg.seed == fail_seed:
            (path / "summary.json").write_text(json.dumps({**summary, "status": "diverged"}))
            raise error
        (path / "summary.json").write_text(json.dumps({**summary, "status": "finished"}))
        return {**summary, "status": "finished"}

    monkeypatch.setattr(runner, "run_experiment", fake)


def test_the_group_summary_is_written_after_every_seed(tmp_path, monkeypatch, capsys):
    _fake_runs(monkeypatch, 1, KeyboardInterrupt())
    assert main(["run", "--seeds", "0", "1", "2", *TINY, "--out", str(tmp_path), "--name", "g"]) == 130
    g = json.loads((tmp_path / "g" / "group.json").read_text())
    assert g["seeds"] == [0] and g["planned_seeds"] == [0, 1, 2] and not g["complete"] and g["final_accuracy"]["mean"] == 50.0
    assert "seeds 2 did not run" in " ".join(capsys.readouterr().out.split())  # wrapped at the console width


def test_a_diverged_seed_is_recorded_the_others_run_and_the_exit_code_is_1(tmp_path, monkeypatch, capsys):
    _fake_runs(monkeypatch, 1, TrainingDiverged("non-finite"))
    assert main(["run", "--seeds", "0", "1", "2", *TINY, "--out", str(tmp_path), "--name", "g"]) == 1
    g = json.loads((tmp_path / "g" / "group.json").read_text())
    assert g["complete"] and g["counted"] == "2/3" and [e["status"] for e in g["runs"]] == ["finished", "diverged", "finished"]
    assert g["final_accuracy"]["mean"] == 51.0  # seeds 0 and 2
    assert "seed(s) 1 of group" in capsys.readouterr().err


@pytest.mark.draw_figures  # the curves' file is checked for its size
def test_compare_takes_a_group_beside_a_run(group, tmp_path, capsys):
    png = tmp_path / "cmp.png"
    assert main(["compare", str(group), str(group / "seed1"), "--out", str(png), "--target", "100"]) == 0
    text = capsys.readouterr().out
    g = json.loads((group / "group.json").read_text())
    assert format_stat(g["final_accuracy"]) in text and " ± " in text
    assert "not reached (0/2)" in text and "seed1" in text and "seeds" in text
    assert png.is_file() and png.stat().st_size > 1000
    assert (tmp_path / "cmp_class_distributions.png").is_file()  # the group's heatmaps are its first seed's
    # a group directory without group.json (a group still running) is found by its seed directories
    copy = tmp_path / "copy"
    shutil.copytree(group, copy)
    (copy / "group.json").unlink()
    assert [p.name for p in group_members(copy)] == ["seed0", "seed1"]
    assert main(["compare", str(copy), "--out", str(tmp_path / "c2.png")]) == 0
    assert format_stat(g["final_accuracy"]) in capsys.readouterr().out
    assert group_members(group / "seed0") is None


def test_compare_curve_is_the_mean_with_a_band(group, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(runner, "plot_accuracy", lambda curves, path, target=None, **kw: seen.update(curves=curves, **kw))
    runner.compare_runs([str(group)], out=tmp_path / "c.png", console=Console(file=io.StringIO(), width=150))
    (label,) = seen["curves"]
    assert label == "grp (2 seeds, mean ± 1 std)" and list(seen["bands"]) == [label]
    acc = [[json.loads(x)["test_accuracy"] for x in (group / f"seed{s}" / "metrics.jsonl").read_text().splitlines()] for s in (0, 1)]
    assert [a for _, a in seen["curves"][label]] == pytest.approx(np.mean(acc, axis=0))
    rounds, low, high = seen["bands"][label]
    assert list(rounds) == [1, 2] and list(high) == pytest.approx(np.mean(acc, axis=0) + np.std(acc, axis=0, ddof=1))


def test_the_group_table_fits_80_columns(group):
    g = json.loads((group / "group.json").read_text())
    buffer = io.StringIO()
    runner.print_group_summary(Console(file=buffer, width=80), g, "group summary: grp")
    lines = buffer.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines) and any(format_stat(g["final_accuracy"]) in line for line in lines)


def test_resuming_a_seed_of_a_group_rewrites_the_group_summary(group, tmp_path):
    """What an interrupted group says to do (`run --resume GROUP/seedN`) completes its group.json: it was left
    with the seeds that had finished before the interruption."""
    copy = tmp_path / "grp"
    shutil.copytree(group, copy)
    stale = json.loads((copy / "group.json").read_text())
    stale.update({"seeds": [0], "complete": False})
    (copy / "group.json").write_text(json.dumps(stale))
    assert main(["run", "--resume", str(copy / "seed1"), "--rounds", "3", "--no-progress"]) == 0
    g = json.loads((copy / "group.json").read_text())
    assert g["seeds"] == [0, 1] and g["complete"] and g["planned_seeds"] == [0, 1]
    finals = [_summary(copy / f"seed{s}")["final_accuracy"] for s in (0, 1)]
    assert g["final_accuracy"]["mean"] == pytest.approx(sum(finals) / 2)
    assert "seed1" in (copy / "group.md").read_text()


def test_cpu_seeded_draws_the_seeds_stream_and_puts_the_global_generator_back():
    """Module initialisation inside the block is a function of the seed; the caller's stream continues untouched."""
    from fedistill.engine.seeding import cpu_seeded

    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    with cpu_seeded(7):
        inside = torch.rand(4)
    assert torch.equal(inside, torch.rand(4, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(torch.rand(3), expected_next)  # as if the block had not drawn
    with cpu_seeded(7):
        assert torch.equal(torch.rand(4), inside)
