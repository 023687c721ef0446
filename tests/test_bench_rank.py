"""``bench SUITE --methods NAME``: a method of your own ranked against a suite's published cells (issue 44)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedistill.studies.bench import bench, load_suite
from fedistill.studies.bench_rank import CELLS_FILE, competition_ranks
from fedistill.errors import ConfigError

SUITE = {
    "name": "tiny-rank",
    "title": "tiny ranking suite on digits",
    "protocol": {
        "rounds": 2, "clients_per_round": 3, "dataset": {"name": "digits"},
        "partition": {"num_clients": 6, "seed": 3, "scheme": "lda", "alpha": 0.3},
        "local": {"epochs": 1, "batch_size": 32, "lr": 0.05}, "run": {"figures": False, "checkpoint_every": 1},
    },
    "settings": {"lda": {"label": "digits LDA 0.3", "config": {}}},
    "methods": {
        "FedAvg": {"config": {"algorithm": {"name": "fedavg"}}},
        "FedProx": {"config": {"algorithm": {"name": "fedprox", "mu": 1.0}}},
        "FedAvgM": {"config": {"algorithm": {"name": "fedavgm", "server_momentum": 0.9}}},
    },
    "seeds": [0, 1, 2],
}  # fmt: skip
TWIN = '''
import fedistill
from fedistill.algorithms.fedavg import FedAvg


@fedistill.register_algorithm("fedavg_twin", help="FedAvg under another name")
class FedAvgTwin(FedAvg):
    pass
'''


def _write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return path


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The tiny suite run in full once: its leaderboard directory, with cells.json."""
    tmp = tmp_path_factory.mktemp("published")
    suite = load_suite(str(_write(tmp, "tiny-rank.yaml", SUITE)))
    bench(suite, tmp / "out", overrides=["run.threads=1"])
    return tmp / "out" / "tiny-rank"


def test_published_cells_hold_every_cell_with_its_rounds_and_where_it_ran(published):
    data = json.loads((published / CELLS_FILE).read_text())
    assert data["suite"] == "tiny-rank" and data["seeds"] == [0, 1, 2] and len(data["cells"]) == 9
    for record in data["cells"]:
        rows = [json.loads(line) for line in (published / "lda" / record["method"] / f"seed{record['seed']}" / "metrics.jsonl").read_text().splitlines()]
        assert record["accuracy"] == [r["test_accuracy"] for r in rows]  # every round, full floats
        assert record["final"] == rows[-1]["test_accuracy"] and record["best"] == max(r["test_accuracy"] for r in rows)
        assert record["last5"] == pytest.approx(statistics.fmean(r["test_accuracy"] for r in rows[-5:]))
        env = data["environments"][record["environment"]]
        assert env["torch"] and env["cpu"]
    # FedAvg, FedProx and FedAvgM share the protocol (only the method differs): one fingerprint
    assert len({r["protocol"] for r in data["cells"]}) == 1


def test_a_plugin_that_is_fedavg_gets_fedavgs_rank_and_a_tie_against_it(published, tmp_path):
    plugin = tmp_path / "twin.py"
    plugin.write_text(TWIN)
    suite_file = _write(tmp_path, "tiny-rank.yaml", SUITE)
    out = tmp_path / "mine"
    done = subprocess.run(
        [sys.executable, "-c", "from fedistill.cli import main; raise SystemExit(main())", "bench", str(suite_file),
         "--plugin", str(plugin), "--methods", "fedavg_twin", "--published", str(published / CELLS_FILE),
         "--out", str(out), "--set", "run.threads=1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    ranking = json.loads((out / "tiny-rank" / "ranking.json").read_text())
    rows = {r["method"]: r for r in ranking["settings"]["lda"]}
    assert set(rows) == {"FedAvg", "FedProx", "FedAvgM", "fedavg_twin"}
    assert rows["fedavg_twin"]["yours"] and rows["fedavg_twin"]["rank"] == rows["FedAvg"]["rank"]
    assert rows["fedavg_twin"]["final_accuracy"] == rows["FedAvg"]["final_accuracy"]
    verdicts = {v["against"]: v for v in ranking["verdicts"]}
    assert set(verdicts) == {"FedAvg", "FedProx", "FedAvgM"}  # one verdict per published method
    tie = verdicts["FedAvg"]
    assert tie["symbol"] == "~" and tie["mean"] == 0.0 and tie["ahead"] == 0 and tie["n"] == 3
    # against another method: the paired difference by seed, computed here from the published cells
    data = json.loads((published / CELLS_FILE).read_text())
    final = {(r["method"], r["seed"]): r["final"] for r in data["cells"]}
    differences = [final[("FedAvg", s)] - final[("FedProx", s)] for s in (0, 1, 2)]
    assert verdicts["FedProx"]["mean"] == pytest.approx(statistics.fmean(differences))
    assert verdicts["FedProx"]["ahead"] == sum(d > 0 for d in differences)
    assert "fedavg_twin ~ FedAvg: +0.00" in done.stdout and "ranks" in done.stdout


def test_a_published_method_rerun_lands_on_its_published_cells(published, tmp_path):
    suite = load_suite(str(_write(tmp_path, "tiny-rank.yaml", SUITE)))
    rows = bench(suite, tmp_path / "again", overrides=["run.threads=1"], methods=["FedProx"], published=published / CELLS_FILE)
    ranking = json.loads((tmp_path / "again" / "tiny-rank" / "ranking.json").read_text())
    assert "FedProx: 3 of 3 re-run cells equal to the published ones to the last bit" in ranking["notes"]
    again = next(r for r in rows if r["method"] == "FedProx")
    data = json.loads((published / CELLS_FILE).read_text())
    assert again["final_accuracy"] == statistics.fmean(r["final"] for r in data["cells"] if r["method"] == "FedProx")
    assert not (tmp_path / "again" / "tiny-rank" / "FedAvg").exists()  # only the named method's cells ran


def test_a_changed_protocol_or_a_missing_file_is_refused_in_one_line(published, tmp_path):
    changed = {**SUITE, "protocol": {**SUITE["protocol"], "local": {**SUITE["protocol"]["local"], "lr": 0.01}}}
    suite = load_suite(str(_write(tmp_path, "tiny-rank.yaml", changed)))
    with pytest.raises(ConfigError, match=r"runs another protocol than the published cells \(local.lr 0.01 \(published: 0.05\)\)"):
        bench(suite, tmp_path / "x", methods=["FedAvg"], published=published / CELLS_FILE)
    assert not (tmp_path / "x" / "tiny-rank" / "lda").exists()  # refused before anything ran
    with pytest.raises(ConfigError, match="no published cells at"):
        bench(suite, tmp_path / "x", methods=["FedAvg"], published=tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        bench(suite, tmp_path / "x", methods=["nope"], published=published / CELLS_FILE)


def test_the_published_cells_ship_with_the_package_and_are_found_from_any_directory(tmp_path, monkeypatch):
    """Issue 62: ranking a method of your own against fd-mnist from outside a clone. From an empty directory the
    default cells are the ones that ship with fedistill (the checkout's benchmarks/leaderboards here; the wheel's
    package data in tests/test_packaging.py), byte for byte the committed file."""
    from fedistill.studies.bench_rank import load_published, published_cells_path

    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "leaderboards" / "fd-mnist" / CELLS_FILE
    monkeypatch.chdir(tmp_path)
    suite = load_suite("fd-mnist")
    assert published_cells_path("fd-mnist").read_bytes() == committed.read_bytes()
    data = load_published(suite, None)
    assert data["suite"] == "fd-mnist" and data["cells"] == json.loads(committed.read_text())["cells"]
    with pytest.raises(ConfigError, match="no published cells at .*nope"):
        load_published(suite, tmp_path / "nope" / CELLS_FILE)  # --published still overrides


def test_ties_share_a_rank():
    assert competition_ranks({"a": 90.0, "b": 80.0, "c": 90.0, "d": 70.0}) == {"a": 1, "c": 1, "b": 3, "d": 4}
    assert competition_ranks({"x": 50.0, "y": 50.0, "z": 50.0}) == {"x": 1, "y": 1, "z": 1}
    assert competition_ranks({}) == {}


def test_the_leaderboard_and_the_ranking_share_the_rule_and_the_one_seed_convention(tmp_path):
    """Issue 62: bench_results.leaderboard_rows numbered tied methods 1, 2, 3 by name, bench_rank 1, 1, 3; and a
    one-seed standard deviation was 0.0 in one and None in the other. Both now: ties share the best rank, and one
    seed has no standard deviation (None, shown "n/a")."""
    from types import SimpleNamespace

    from fedistill.studies.bench_results import leaderboard_rows
    from fedistill.report.groups import format_stat

    class OneSeedCell:  # what leaderboard_rows reads of a finished bench cell
        def __init__(self, method: str, final: float):
            self.setting, self.method, self.why_not, self.path = "s", method, None, tmp_path
            self.config = SimpleNamespace(accuracy_metric=lambda: "global")
            self.final = final

        def state(self):
            return "done"

        def result(self):
            return SimpleNamespace(final=self.final, best=self.final, diverged_after=None, bytes_per_round=None,
                                   seconds_per_round=None)  # fmt: skip

    suite = SimpleNamespace(settings={"s": SimpleNamespace(label="S")}, target_accuracy=None, method_specs=lambda: ["b", "a", "c"])
    rows = leaderboard_rows(suite, [OneSeedCell("b", 80.0), OneSeedCell("a", 80.0), OneSeedCell("c", 90.0)])
    assert [(r["method"], r["rank"]) for r in rows] == [("c", 1), ("a", 2), ("b", 2)]
    assert all(r["final_accuracy_std"] is None for r in rows)
    assert format_stat({"mean": 80.0, "std": None}) == "80.00 ± n/a"


def test_update_published_replaces_one_methods_cells_and_keeps_the_others_as_published(published, tmp_path):
    """A method whose default changed (here FedProx's μ, 1.0 -> 0.1: the protocol is the same) is re-run alone and
    published into the whole leaderboard: its rows and cells are the new runs', every other method's rows equal the
    published leaderboard's (the mean and std of the same records) and their cell records are copied unchanged."""
    changed = {**SUITE, "methods": {**SUITE["methods"], "FedProx": {"config": {"algorithm": {"name": "fedprox", "mu": 0.1}}}}}
    suite = load_suite(str(_write(tmp_path, "tiny-rank.yaml", changed)))
    out = tmp_path / "update"
    bench(suite, out, overrides=["run.threads=1"], methods=["FedProx"], published=published / CELLS_FILE, update_published=True)
    root = out / "tiny-rank"
    old_cells = json.loads((published / CELLS_FILE).read_text())
    new_cells = json.loads((root / CELLS_FILE).read_text())
    old_rows = {r["method"]: r for r in json.loads((published / "leaderboard.json").read_text())}
    new_rows = {r["method"]: r for r in json.loads((root / "leaderboard.json").read_text())}
    strip = lambda record: {k: v for k, v in record.items() if k != "environment"}  # noqa: E731  (ids are renumbered)
    for method in ("FedAvg", "FedAvgM"):
        assert [strip(r) for r in new_cells["cells"] if r["method"] == method] == [strip(r) for r in old_cells["cells"] if r["method"] == method]
        for key in ("final_accuracy", "final_accuracy_std", "best_accuracy", "mb_per_round", "seconds_per_round", "percent_of_bf16_peak"):
            assert new_rows[method][key] == old_rows[method][key], (method, key)
    finals = []
    for seed in SUITE["seeds"]:
        rows = [json.loads(line) for line in (root / "lda" / "FedProx" / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()]
        finals.append(rows[-1]["test_accuracy"])
        record = next(r for r in new_cells["cells"] if r["method"] == "FedProx" and r["seed"] == seed)
        assert record["accuracy"] == [r["test_accuracy"] for r in rows]
    assert new_rows["FedProx"]["final_accuracy"] == statistics.fmean(finals)
    assert new_rows["FedProx"]["final_accuracy"] != old_rows["FedProx"]["final_accuracy"]  # it was re-run, not copied
    assert (root / "leaderboard.md").is_file() and (root / "ranking.md").is_file()
    assert not (root / "lda" / "FedAvg").exists()  # the other methods did not run


def test_published_and_update_published_need_methods(tmp_path, capsys):
    from fedistill.cli import main

    suite_file = _write(tmp_path, "tiny-rank.yaml", SUITE)
    for flags, message in ((["--published", "x.json"], "bench --published: only with --methods"),
                           (["--update-published"], "bench --update-published: only with --methods")):  # fmt: skip
        assert main(["bench", str(suite_file), "--out", str(tmp_path / "o"), *flags]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_setting_added_since_the_cells_were_published_counts_only_when_set(published, tmp_path):
    """Cells published before ``local.batch_order`` existed ran it at its default: a cell of today at that default
    has their protocol (fingerprinted in their form), one that sets another value does not."""
    from fedistill.studies.bench_rank import fingerprint

    data = json.loads((published / CELLS_FILE).read_text())
    old = {**data["protocols"]["lda"], "local": {k: v for k, v in data["protocols"]["lda"]["local"].items() if k != "batch_order"}}
    data["protocols"]["lda"] = old
    for record in data["cells"]:
        record["protocol"] = fingerprint(old)
    older = _write(tmp_path, "older-cells.json", data)
    older.write_text(json.dumps(data))
    suite = load_suite(str(_write(tmp_path, "tiny-rank.yaml", SUITE)))
    bench(suite, tmp_path / "ok", overrides=["run.threads=1"], methods=["FedAvg"], published=older)
    ranking = json.loads((tmp_path / "ok" / "tiny-rank" / "ranking.json").read_text())
    assert "FedAvg: 3 of 3 re-run cells equal to the published ones to the last bit" in ranking["notes"]
    with pytest.raises(ConfigError, match=r"local.batch_order 'sequential' \(published: None\)"):
        bench(suite, tmp_path / "no", overrides=["local.batch_order=sequential"], methods=["FedAvg"], published=older)


def test_update_published_leaves_out_methods_the_published_cells_do_not_have(published, tmp_path):
    """A method registered since the cells were published (here FedNova, added to the suite) is not run and not
    listed: the leaderboard written again is the published one with the re-run method changed."""
    grown = {**SUITE, "methods": {**SUITE["methods"], "FedNova": {"config": {"algorithm": {"name": "fednova"}}}}}
    suite = load_suite(str(_write(tmp_path, "tiny-rank.yaml", grown)))
    out = tmp_path / "grown"
    bench(suite, out, overrides=["run.threads=1"], methods=["FedProx"], published=published / CELLS_FILE, update_published=True)
    rows = json.loads((out / "tiny-rank" / "leaderboard.json").read_text())
    assert sorted(r["method"] for r in rows) == ["FedAvg", "FedAvgM", "FedProx"]
    assert {r["method"] for r in json.loads((out / "tiny-rank" / CELLS_FILE).read_text())["cells"]} == {"FedAvg", "FedAvgM", "FedProx"}


HETERO_SUITE = {
    "name": "tiny-hetero-rank",
    "title": "tiny heterogeneous-model ranking suite on digits",
    "protocol": {
        "rounds": 2, "clients_per_round": 4, "dataset": {"name": "digits"},
        "model": {"clients": ["digits_cnn", "logistic"]},
        "partition": {"num_clients": 4, "seed": 3, "scheme": "lda", "alpha": 0.3, "per_client_test": True},
        "local": {"epochs": 1, "batch_size": 32, "lr": 0.05}, "run": {"figures": False},
    },
    "settings": {"lda": {"label": "digits LDA 0.3, two architectures", "config": {}}},
    "methods": {
        "FedProto": {"config": {"algorithm": {"name": "fedproto"}}},
        "FD": {"config": {"algorithm": {"name": "fd"}}},
    },
    "seeds": [0, 1],
}  # fmt: skip
PROTO_TWIN = '''
import fedistill
from fedistill.algorithms.fedproto import FedProto


@fedistill.register_algorithm("fedproto_twin", help="FedProto under another name")
class FedProtoTwin(FedProto):
    pass
'''


def test_a_heterogeneous_plugin_is_ranked_on_the_clients_own_test_splits(tmp_path):
    """Issue 65: ``bench fd-hetero-* --plugin FILE --methods NAME`` on a suite whose clients hold two architectures:
    a plugin that is FedProto lands on FedProto's published cells (a tie, +0.00 on every seed), and the verdict
    against FD is the paired difference of the published per-client-split accuracies, computed here."""
    suite_file = _write(tmp_path, "tiny-hetero-rank.yaml", HETERO_SUITE)
    bench(load_suite(str(suite_file)), tmp_path / "published", overrides=["run.threads=1"])
    cells = tmp_path / "published" / "tiny-hetero-rank" / CELLS_FILE
    plugin = tmp_path / "proto_twin.py"
    plugin.write_text(PROTO_TWIN)
    out = tmp_path / "mine"
    done = subprocess.run(
        [sys.executable, "-c", "from fedistill.cli import main; raise SystemExit(main())", "bench", str(suite_file),
         "--plugin", str(plugin), "--methods", "fedproto_twin", "--published", str(cells), "--out", str(out),
         "--set", "run.threads=1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    ranking = json.loads((out / "tiny-hetero-rank" / "ranking.json").read_text())
    verdicts = {v["against"]: v for v in ranking["verdicts"]}
    assert verdicts["FedProto"]["symbol"] == "~" and verdicts["FedProto"]["mean"] == 0.0
    data = json.loads(cells.read_text())
    final = {(r["method"], r["seed"]): r["final"] for r in data["cells"]}
    differences = [final[("FedProto", s)] - final[("FD", s)] for s in (0, 1)]
    assert verdicts["FD"]["mean"] == pytest.approx(statistics.fmean(differences))
    # the metric is the clients' own splits: a cell's final is its last round's mean over the clients' accuracies
    run = out / "tiny-hetero-rank" / "lda" / "fedproto_twin" / "seed0"
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["personal_accuracy"] == final[("FedProto", 0)]


def test_kept_cells_are_a_finished_bench_on_another_machine(published, tmp_path, monkeypatch):
    """benchmarks/keep_finished_runs.py on a bench's cells (a suite longer than one session): the kept files,
    flops.json included, are finished cells to the next bench, which trains nothing and counts no FLOPs again,
    and writes the same leaderboard rows."""
    import importlib.util

    import fedistill.studies.bench as bench_module

    spec = importlib.util.spec_from_file_location("keep_finished_runs", Path(__file__).resolve().parents[1] / "benchmarks" / "keep_finished_runs.py")
    keeper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(keeper)
    moved = tmp_path / "kept" / "tiny-rank"
    copied, _, _ = keeper.keep(published, moved)
    assert copied == 9 and len(list(moved.rglob("flops.json"))) == 3 and not list(moved.rglob("checkpoint.pt"))

    def no_training(*args, **kwargs):
        raise AssertionError("a kept cell was run again")

    monkeypatch.setattr(bench_module, "_run_cell", no_training)
    bench(load_suite(str(_write(tmp_path, "tiny-rank.yaml", SUITE))), tmp_path / "kept", overrides=["run.threads=1"])
    again = json.loads((moved / CELLS_FILE).read_text())["cells"]
    first = json.loads((published / CELLS_FILE).read_text())["cells"]
    assert [(r["method"], r["seed"], r["accuracy"]) for r in again] == [(r["method"], r["seed"], r["accuracy"]) for r in first]
