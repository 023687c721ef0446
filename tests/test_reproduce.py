"""``fedistill reproduce``: presets, resumable runs, the comparison table (reproduce.py)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedistill.cli import main
from fedistill.errors import ConfigError
from fedistill.studies.reproduce import Preset, RunResult, comparison_rows, load_preset, reproduce, run_config

TINY = {
    "name": "tiny",
    "title": "Tiny table on digits",
    "source": "test",
    "paper_rounds": 50,
    "base": {
        "clients_per_round": 3,
        "dataset": {"name": "digits"},
        "partition": {"num_clients": 6, "seed": 3},
        "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
        "run": {"figures": False, "progress": False, "checkpoint_every": 1},
    },
    "columns": {
        "lda": {"label": "digits LDA α=0.3", "config": {"partition": {"scheme": "lda", "alpha": 0.3}}},
        "iid": {"label": "digits iid", "config": {"partition": {"scheme": "iid"}}},
    },
    "methods": {
        "FedAvg": {"config": {"algorithm": {"name": "fedavg"}}},
        "FedProx": {"config": {"algorithm": {"name": "fedprox"}}, "per_column": {"iid": {"algorithm": {"mu": 0.01}}}},
        "Exploding": {"config": {"algorithm": {"name": "fedavg"}, "local": {"lr": 1.0e6}}},
    },
    "published": {"lda": {"FedAvg": {"accuracy": 80.0, "speedup": 1.0}, "FedProx": {"accuracy": 79.5}}},
}


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY, sort_keys=False))
    return load_preset(str(path))


def test_per_column_hyperparameters_override_the_method_and_the_base(tiny):
    assert run_config(tiny, "iid", "FedProx", 4, 7, []).algorithm.params_dict() == {"mu": 0.01}
    assert run_config(tiny, "lda", "FedProx", 4, 7, []).algorithm.params_dict() == {}
    cfg = run_config(tiny, "lda", "Exploding", 4, 7, ["local.epochs=2"])
    assert (cfg.seed, cfg.rounds, cfg.local.lr, cfg.local.epochs, cfg.partition.alpha) == (4, 7, 1.0e6, 2, 0.3)


def test_speedup_is_rounds_to_the_reference_best():
    preset = Preset.model_validate({**TINY, "columns": {"lda": TINY["columns"]["lda"]}})
    curve = lambda accs: [(i + 1, a) for i, a in enumerate(accs)]  # noqa: E731
    results = {
        ("lda", "FedAvg", 0): RunResult("lda", "FedAvg", 0, curve([10, 50, 40, 60]), 2.0),
        ("lda", "FedProx", 0): RunResult("lda", "FedProx", 0, curve([20, 61, 30, 30]), 3.0),
        ("lda", "Exploding", 0): RunResult("lda", "Exploding", 0, curve([20, 30]), 1.0, diverged_after=2),
    }
    rows = {r["method"]: r for r in comparison_rows(preset, results, ["lda"], ["FedAvg", "FedProx", "Exploding"], [0], 4)}
    assert rows["FedAvg"]["speedup"] == 1.0 and rows["FedAvg"]["best_accuracy"] == 60
    assert rows["FedProx"]["speedup"] == 2.0  # reaches 60 at round 2; FedAvg at round 4
    assert rows["FedProx"]["seconds_vs_reference"] == 1.5
    assert rows["Exploding"]["speedup"] is None and "diverged after round 2" in rows["Exploding"]["failed"]
    assert rows["FedProx"]["published_accuracy"] == 79.5 and rows["FedProx"]["published_speedup"] is None


def test_reproduce_runs_writes_the_table_then_continues_and_reuses(tiny, tmp_path):
    out = tmp_path / "out"
    rows = reproduce(tiny, out, rounds=2, seeds=[0])
    root = out / "tiny"
    assert (root / "table.md").is_file() and (root / "table.csv").is_file()
    assert len(rows) == 6
    by = {(r["column"], r["method"]): r for r in rows}
    assert by[("lda", "FedAvg")]["speedup"] == 1.0
    assert by[("lda", "FedAvg")]["published_accuracy"] == 80.0
    assert by[("iid", "FedProx")]["published_note"] == "not in the paper's table"
    assert by[("lda", "Exploding")]["failed"] is not None  # lr 1e6 diverges: a "Failed" row, not a crash
    assert 10 < by[("iid", "FedAvg")]["best_accuracy"] <= 100
    with open(root / "table.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 6
    md = (root / "table.md").read_text()
    assert "| FedAvg |" in md and "80.00 (1.00×)" in md and "Failed" in md

    def first_rows(method):
        return [json.loads(line) for line in (root / "lda" / method / "seed0" / "metrics.jsonl").read_text().splitlines()]

    before = first_rows("FedAvg")
    reproduce(tiny, out, rounds=3, seeds=[0], methods=["FedAvg"], columns=["lda"])
    after = first_rows("FedAvg")
    assert len(after) == 3 and after[:2] == before  # continued from the checkpoint, not restarted
    again = reproduce(tiny, out, rounds=2, seeds=[0], methods=["FedAvg"], columns=["lda"])
    assert first_rows("FedAvg") == after  # reused: nothing ran
    assert again[0]["best_accuracy"] == max(r["test_accuracy"] for r in after[:2])


def test_a_changed_configuration_is_not_mixed_with_old_runs(tiny, tmp_path):
    reproduce(tiny, tmp_path, rounds=1, methods=["FedAvg"], columns=["iid"])
    with pytest.raises(ConfigError, match="another configuration"):
        reproduce(tiny, tmp_path, rounds=1, methods=["FedAvg"], columns=["iid"], overrides=["local.lr=0.01"])


def test_a_run_saved_before_a_setting_existed_is_reused_not_refused(tiny, tmp_path):
    """A config written before ``dataset.resize`` existed holds its default; reproduce must reuse it."""
    reproduce(tiny, tmp_path, rounds=1, methods=["FedAvg"], columns=["iid"])
    config_path = tmp_path / "tiny" / "iid" / "FedAvg" / "seed0" / "config.yaml"
    saved = yaml.safe_load(config_path.read_text())
    assert saved["dataset"].pop("resize") is None
    config_path.write_text(yaml.safe_dump(saved, sort_keys=False))
    metrics = (config_path.parent / "metrics.jsonl").read_text()
    reproduce(tiny, tmp_path, rounds=1, methods=["FedAvg"], columns=["iid"])
    assert (config_path.parent / "metrics.jsonl").read_text() == metrics  # reused: nothing ran again


def test_bad_presets_and_selections_are_reported(tiny, tmp_path):
    with pytest.raises(ConfigError, match="no preset 'nope'; choose one of: .*fedlmd_table3_mnist"):
        load_preset("nope")
    with pytest.raises(ConfigError, match="--methods: FedLMD not in preset tiny"):
        reproduce(tiny, tmp_path, rounds=1, methods=["FedLMD"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**TINY, "methods": {"FedAvg": {"config": {}, "per_column": {"cifar": {}}}}}, sort_keys=False))
    with pytest.raises(ConfigError, match="unknown columns"):
        load_preset(str(bad))
    bad.write_text(yaml.safe_dump({**TINY, "base": {**TINY["base"], "local": {"lr": -1}}}, sort_keys=False))
    with pytest.raises(ConfigError, match=r"reproduce tiny \[lda / FedAvg\]: local.lr"):
        reproduce(load_preset(str(bad)), tmp_path, rounds=1)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"seeds": [0, 0]}, "--seeds: seed 0 is given 2 times"),  # one run counted as two seeds, ± 0.00
        ({"overrides": ["seed=5"]}, "--set seed: .*use --seeds"),  # every "seed" the same run
        ({"overrides": ["rounds=1"]}, "--set rounds: .*use --rounds"),  # the table claiming rounds that did not run
        ({"methods": []}, "--methods: empty"),  # an empty --methods ran every method of the preset
        ({"columns": ["iid", "iid"]}, "--columns: iid given more than once"),
    ],
)
def test_selections_that_would_misreport_the_table_are_refused_before_any_run(tiny, tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        reproduce(tiny, tmp_path, rounds=1, **{"methods": ["FedAvg"], "columns": ["iid"], **kwargs})
    assert not (tmp_path / "tiny").exists()


def test_a_method_parameter_goes_to_the_methods_that_have_it_and_not_to_the_reference(tiny, tmp_path):
    """A variant of one method beside the reference: ``--set algorithm.mu=...`` reaches FedProx, not FedAvg (which
    has no ``mu`` and used to stop the whole command), and a key that no selected method has is still refused."""
    from fedistill.studies.reproduce import changed_by_set, method_overrides

    lines: list[str] = []
    console = type("Console", (), {"print": lambda self, line: lines.append(line)})()
    taken = method_overrides(tiny, ["FedAvg", "FedProx"], ["lda"], ["algorithm.mu=0.3", "local.epochs=2"], console)
    assert taken == {"FedAvg": ["local.epochs=2"], "FedProx": ["algorithm.mu=0.3", "local.epochs=2"]}
    assert lines == ["--set algorithm.mu: applied to FedProx; not to FedAvg (no such parameter)"]
    # The reference is added to --methods FedProx; its run is the plain one, FedProx's has mu = 0.3.
    reproduce(tiny, tmp_path, rounds=1, methods=["FedProx"], columns=["lda"], overrides=["algorithm.mu=0.3"])
    saved = lambda m: yaml.safe_load((tmp_path / "tiny" / "lda" / m / "seed0" / "config.yaml").read_text())  # noqa: E731
    assert saved("FedProx")["algorithm"]["mu"] == 0.3 and "mu" not in saved("FedAvg")["algorithm"]
    asked = ["partition.alpha=0.05", "dataset.data_dir=/data", "algorithm.mu=0.3"]
    per_method = {"FedAvg": asked[:2], "FedProx": asked}
    assert changed_by_set(asked, per_method) == ["partition.alpha=0.05", "algorithm.mu=0.3 (FedProx)"]  # where the data is: no change
    # The table's setting labels are the preset's: table.md says what --set changed, and for which methods.
    table = (tmp_path / "tiny" / "table.md").read_text()
    assert "**Changed by `--set`** (the setting labels below are the preset's): `algorithm.mu=0.3 (FedProx)`." in table
    with pytest.raises(ConfigError, match="--set algorithm.importance: none of the selected methods .*'importance'"):
        reproduce(tiny, tmp_path, rounds=1, methods=["FedProx"], columns=["lda"], overrides=["algorithm.importance=uniform"])
    # In a fresh interpreter, as `fedistill reproduce` starts: no algorithm is registered until one is asked for.
    fresh = subprocess.run(
        [sys.executable, "-c", "import sys; from fedistill.studies.reproduce import load_preset, method_overrides; "
         "print(method_overrides(load_preset(sys.argv[1]), ['FedAvg', 'FedProx'], ['lda'], ['algorithm.mu=0.3']))",
         str(tmp_path / "tiny.yaml")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert fresh.stdout.strip() == "{'FedAvg': [], 'FedProx': ['algorithm.mu=0.3']}"


def test_an_empty_methods_flag_is_not_every_method(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY, sort_keys=False))
    assert main(["reproduce", str(path), "--out", str(tmp_path), "--rounds", "1", "--methods", ""]) == 2
    assert "--methods: empty" in capsys.readouterr().err


def test_an_output_that_cannot_be_a_directory_is_one_line(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="reproduce --out .*cannot create"):
        reproduce(tiny, blocker, rounds=1, methods=["FedAvg"], columns=["iid"])


def test_a_moved_data_directory_still_reuses_and_resumes_the_runs(tiny, tmp_path):
    """Where the dataset files are (and fetching, checking them) does not change a run's numbers."""
    reproduce(tiny, tmp_path, rounds=1, methods=["FedAvg"], columns=["iid"])
    metrics = tmp_path / "tiny" / "iid" / "FedAvg" / "seed0" / "metrics.jsonl"
    before = metrics.read_text()
    moved = ["dataset.data_dir=" + str(tmp_path / "elsewhere"), "dataset.verify=false"]
    reproduce(tiny, tmp_path, rounds=2, methods=["FedAvg"], columns=["iid"], overrides=moved)
    assert metrics.read_text().startswith(before) and metrics.read_text().count("\n") == 2


def test_unreadable_preset_files_are_one_line(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("a: [\n")
    (tmp_path / "bin.yaml").write_bytes(bytes(range(256)))
    for name, words in (("bad.yaml", "not valid YAML at line 2"), ("bin.yaml", "binary data")):
        assert main(["reproduce", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err and "Traceback" not in err, err


def test_jobs_run_the_runs_in_parallel_processes_with_the_serial_numbers(tiny, tmp_path, capsys):
    """--jobs 2: the same table as one run at a time (the diverging method included), each run finished once."""
    serial = reproduce(tiny, tmp_path / "serial", rounds=2, seeds=[0, 1], columns=["lda"], overrides=["run.threads=1"])
    parallel = reproduce(tiny, tmp_path / "parallel", rounds=2, seeds=[0, 1], columns=["lda"], jobs=2)
    keys = ("method", "best_accuracy", "best_accuracy_std", "final_accuracy", "failed")
    assert [tuple(r[k] for k in keys) for r in serial] == [tuple(r[k] for k in keys) for r in parallel]
    out = capsys.readouterr().out
    assert "6 runs to do, 2 at a time" in out and "(6/6)" in out
    saved = yaml.safe_load((tmp_path / "parallel" / "tiny" / "lda" / "FedAvg" / "seed1" / "config.yaml").read_text())
    assert saved["run"]["threads"] is None and saved["run"]["workers"] == 1  # one-thread, one-process runs (engine/cores.py)
    reproduce(tiny, tmp_path / "parallel", rounds=2, seeds=[0, 1], columns=["lda"], jobs=2)
    assert "runs to do" not in capsys.readouterr().out  # every run reused
    with pytest.raises(ConfigError, match="oversubscribe"):
        reproduce(tiny, tmp_path / "x", rounds=1, jobs=10_000)
    with pytest.raises(ConfigError, match="holds a run with another configuration"):
        reproduce(tiny, tmp_path / "parallel", rounds=2, seeds=[0], columns=["lda"], jobs=2, overrides=["local.lr=0.01"])


def test_runs_go_seed_by_seed_so_a_stopped_reproduce_leaves_whole_seeds(tiny, tmp_path, monkeypatch):
    """A claim whose runs outlast a session is stopped and continued: every column and method of seed s is
    submitted before any run of seed s + 1, so the runs finished so far pair up into whole seeds."""
    import fedistill.studies.reproduce as reproduce_module

    submitted = []

    class Stopped(Exception):
        pass

    def record(runs, jobs, console, name, root):
        submitted.extend(label for label, _cfg, _path in runs)
        raise Stopped

    monkeypatch.setattr(reproduce_module, "run_in_parallel", record)
    with pytest.raises(Stopped):
        reproduce(tiny, tmp_path, rounds=1, seeds=[0, 1, 2], methods=["FedAvg", "FedProx"], jobs=2)
    seeds = [int(label.rsplit("seed ", 1)[1]) for label in submitted]
    assert len(submitted) == 3 * 2 * 2 and seeds == sorted(seeds)  # 3 seeds x 2 columns x 2 methods
    assert submitted[:4] == [
        "digits LDA α=0.3 / FedAvg / seed 0", "digits LDA α=0.3 / FedProx / seed 0",
        "digits iid / FedAvg / seed 0", "digits iid / FedProx / seed 0",
    ]  # fmt: skip


def test_every_shipped_preset_validates_for_every_run():
    from fedistill.studies.reproduce import available_presets

    names = available_presets()
    assert "fedlmd_table3_mnist" in names
    # The reduced presets behind benchmarks/RESULTS.md (and their claims) must not rot either.
    reduced = sorted(str(p) for p in (Path(__file__).parents[1] / "benchmarks" / "presets").glob("*.yaml"))
    assert len(reduced) >= 4
    for name in [*names, *reduced]:
        preset = load_preset(name)
        for column in preset.columns:
            for method in preset.methods:
                run_config(preset, column, method, 0, 1, [])


def test_cli_lists_presets_and_runs_one(tiny, tmp_path, capsys):
    assert main(["reproduce"]) == 0
    assert "fedlmd_table3_mnist" in capsys.readouterr().out
    path = tmp_path / "tiny.yaml"
    code = main(["reproduce", str(path), "--rounds", "1", "--methods", "FedAvg", "--columns", "iid", "--out", str(tmp_path / "o")])
    assert code == 0
    assert (tmp_path / "o" / "tiny" / "table.md").is_file()
    assert main(["reproduce", str(path), "--rounds", "0"]) == 2


def test_without_rounds_a_reduced_preset_runs_its_own_rounds_not_the_papers(tmp_path):
    """A reduced preset's base rounds (dafkd_reduced: 15 of the paper's 60) are its protocol; --rounds still wins."""
    path = tmp_path / "reduced.yaml"
    path.write_text(yaml.safe_dump({**TINY, "name": "reduced", "base": {**TINY["base"], "rounds": 2}}, sort_keys=False))
    rows = reproduce(load_preset(str(path)), tmp_path / "out", seeds=[0], methods=["FedAvg"], columns=["lda"])
    run = tmp_path / "out" / "reduced" / "lda" / "FedAvg" / "seed0"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2 and rows
    assert "over **2** rounds (the paper ran 50)" in (tmp_path / "out" / "reduced" / "table.md").read_text()


def test_status_runs_nothing_and_reads_the_claims_over_the_seeds_finished(tmp_path, capsys):
    """A 10-seed claim outlasts a session: --status says which runs finished and which are part way, tabulates the
    seeds whose every run finished, marks the verdicts provisional and prints the command that continues."""
    spec = {**TINY, "claims": [{"claim": "FedAvg > FedProx"}]}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    preset, out = load_preset(str(path)), tmp_path / "out"
    chosen = {"methods": ["FedAvg", "FedProx"], "columns": ["iid"]}
    assert reproduce(preset, out, rounds=2, seeds=[0, 2], status=True, **chosen) == []  # nothing has run
    assert "no seed has finished every run yet" in capsys.readouterr().out and not (out / "tiny" / "table.md").exists()
    full = reproduce(preset, out, rounds=2, seeds=[0, 2], **chosen)
    reproduce(preset, out, rounds=1, seeds=[1], **chosen)  # seed 1 stopped after round 1 of 2
    root = out / "tiny" / "iid"
    before = {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    capsys.readouterr()

    code = main(["reproduce", str(path), "--rounds", "2", "--seeds", "0", "1", "2", "3", "--methods", "FedAvg,FedProx",
                 "--columns", "iid", "--out", str(out), "--status"])  # fmt: skip
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} == before  # no run moved
    assert not (root / "FedAvg" / "seed3").exists()
    assert "seed 1 at round 1/2" in printed and "4 of 8 runs remain" in printed
    continues = f"fedistill reproduce {path} --rounds 2 --seeds 0 1 2 3 --methods FedAvg,FedProx --columns iid --out {out}"
    assert f"continue them with: {continues}" in printed
    claim = json.loads((out / "tiny" / "claims.json").read_text())[0]
    assert claim["seeds_finished"] == [0, 2] and claim["seeds_planned"] == [0, 1, 2, 3]
    link = claim["links"][0]
    assert link["n"] == 2 and sorted(link["a_values"]) == ["0", "2"]  # seed 1 (part way) and 3 (not started) left out
    md = (out / "tiny" / "table.md").read_text()
    assert "**Provisional**: seeds [0, 2] of the 4 planned" in md and continues in md
    assert "(provisional: 2 of 4 planned seeds)" in md
    # The finished seeds' table is the one a run of those seeds alone writes.
    status_rows = reproduce(preset, out, rounds=2, seeds=[0, 1, 2, 3], status=True, **chosen)
    assert [(r["method"], r["best_accuracy"], r["final_accuracy"]) for r in status_rows] == [
        (r["method"], r["best_accuracy"], r["final_accuracy"]) for r in full
    ]
    # Every planned seed finished: the same verdict, no longer provisional.
    reproduce(preset, out, rounds=2, seeds=[0, 1, 2, 3], **chosen)
    capsys.readouterr()
    reproduce(preset, out, rounds=2, seeds=[0, 1, 2, 3], status=True, **chosen)
    printed = " ".join(capsys.readouterr().out.split())
    assert "every run has finished" in printed and "provisional" not in printed
    assert "Provisional" not in (out / "tiny" / "table.md").read_text()
    # A --set that changes the runs' numbers is refused, as a run would refuse it.
    with pytest.raises(ConfigError, match="another configuration"):
        reproduce(preset, out, rounds=2, seeds=[0], status=True, overrides=["local.lr=0.01"], **chosen)


def test_a_finished_run_travels_as_three_files_and_is_reused_not_rerun(tmp_path, monkeypatch):
    """A claim continued on another machine (benchmarks/keep_finished_runs.py): a finished run's config.yaml,
    metrics.jsonl and summary.json, without checkpoint or plots, are a finished run to reproduce: the same table,
    and nothing trains again."""
    import shutil

    import fedistill.runner as runner_module

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY, sort_keys=False))
    preset, chosen = load_preset(str(path)), {"methods": ["FedAvg", "FedProx"], "columns": ["iid"]}
    first = reproduce(preset, tmp_path / "here", rounds=2, seeds=[0, 1], **chosen)
    moved = tmp_path / "there"
    for summary in (tmp_path / "here").rglob("summary.json"):
        target = moved / summary.parent.relative_to(tmp_path / "here")
        target.mkdir(parents=True)
        for name in ("config.yaml", "metrics.jsonl", "summary.json"):
            shutil.copy(summary.parent / name, target / name)
    assert len(list(moved.rglob("summary.json"))) == 4 and not list(moved.rglob("checkpoint.pt"))

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(runner_module, "run_experiment", no_training)
    again = reproduce(preset, moved, rounds=2, seeds=[0, 1], **chosen)
    assert [(r["method"], r["best_accuracy"], r["final_accuracy"]) for r in again] == [
        (r["method"], r["best_accuracy"], r["final_accuracy"]) for r in first
    ]
    with pytest.raises(AssertionError, match="run again"):  # the stand-in is in place: a missing run would train
        reproduce(preset, moved, rounds=2, seeds=[2], **chosen)
