"""``fedistill bench``: suites, cells, n/a methods, resume, --jobs, --cell, and the leaderboard's numbers."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import yaml

from conftest import child_processes, live_processes

from fedistill.engine.flops import best_bf16_peak, peak_matmul_size
from fedistill.studies.bench import available_suites, bench, estimate_remaining, load_suite, suite_cells
from fedistill.cli import main
from fedistill.errors import ConfigError
from fedistill.registry import ALGORITHMS

TINY = {
    "name": "tiny-bench",
    "title": "tiny bench on digits",
    "protocol": {
        "rounds": 2, "clients_per_round": 3, "dataset": {"name": "digits"},
        "partition": {"num_clients": 6, "seed": 3}, "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
        "run": {"figures": False, "checkpoint_every": 1},
    },
    "settings": {
        "iid": {"label": "digits iid", "config": {"partition": {"scheme": "iid"}}},
        "lda": {"label": "digits LDA 0.3", "config": {"partition": {"scheme": "lda", "alpha": 0.3}}},
    },
    "methods": {
        "FedAvg": {"config": {"algorithm": {"name": "fedavg"}}},
        "FedProx mu=0": {"config": {"algorithm": {"name": "fedprox", "mu": 0.0}}},
        "pFedMe momentum": {"config": {"algorithm": {"name": "pfedme"}, "local": {"momentum": 0.9}}},  # refused by its config
        "FedGKT on a CNN": {"config": {"algorithm": {"name": "fedgkt"}, "model": {"name": "digits_cnn"}}},  # refused at set-up
    },
    "seeds": [0, 1],
    "target_accuracy": 15.0,
}


def _suite(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "tiny-bench.yaml"
    path.write_text(yaml.safe_dump({**TINY, **changes}, sort_keys=False, allow_unicode=True))
    return path


def _finals(cell_dir: Path) -> float:
    rows = [json.loads(line) for line in (cell_dir / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["test_accuracy"]


CLAIMS = [
    {"claim": "FedProx mu=0 ~ FedAvg", "margin": 0.5, "paper": "an equivalence of the cards"},
    {"claim": "FedAvg > FedProx mu=0", "columns": ["lda"]},
    {"claim": "FedProx mu=0 ~ FedAvg", "metric": "mb", "margin": 0.001},
    {"claim": "FedAvg > pFedMe momentum", "columns": ["iid"]},
]


@pytest.mark.measure_peak
def test_bench_runs_every_cell_and_ranks_the_methods(tmp_path, capsys):
    suite = load_suite(str(_suite(tmp_path, claims=CLAIMS)))
    rows = bench(suite, tmp_path / "out", overrides=["run.threads=1"])
    root = tmp_path / "out" / "tiny-bench"
    # this machine's one-thread peak, measured (not the tests' stand-in) and kept beside the leaderboard; a machine
    # whose bf16 is emulated (slower than fp32: an AVX2-only CPU) has none, and the leaderboard says so
    import torch

    from fedistill.engine.flops import _probe_rate

    if _probe_rate(torch.bfloat16) >= _probe_rate(torch.float32):
        peak = json.loads((root / "bf16_peak.json").read_text())["by_threads"]["1"]
        assert peak > 0 and peak != 100.0 and all(r["bf16_peak_gflops_per_s"] == peak for r in rows if r["status"] == "ok")
    else:
        assert not (root / "bf16_peak.json").exists() and all(r.get("percent_of_bf16_peak") is None for r in rows)
        assert "none here" in (root / "leaderboard.md").read_text()
    for setting in ("iid", "lda"):
        part = [r for r in rows if r["setting"] == setting]
        by = {r["method"]: r for r in part}
        # the leaderboard's mean ± std, recomputed from the cells' own metric files
        finals = [_finals(root / setting / "FedAvg" / f"seed{s}") for s in (0, 1)]
        assert by["FedAvg"]["final_accuracy"] == pytest.approx(statistics.fmean(finals))
        assert by["FedAvg"]["final_accuracy_std"] == pytest.approx(statistics.stdev(finals))
        # FedProx with mu 0 is FedAvg step for step: the same numbers, so the same rank (ties share the best,
        # issue 62), listed by name
        assert by["FedProx mu=0"]["final_accuracy"] == by["FedAvg"]["final_accuracy"]
        assert [r["method"] for r in part[:2]] == ["FedAvg", "FedProx mu=0"] and [r["rank"] for r in part[:2]] == [1, 1]
        # methods that cannot run the setting are n/a with the reason, refused by config or at set-up
        assert "local.momentum" in by["pFedMe momentum"]["why"] and by["pFedMe momentum"]["status"] == "n/a"
        assert "extractor/predictor split" in by["FedGKT on a CNN"]["why"]
        assert by["FedAvg"]["mb_per_round"] > 0 and by["FedAvg"]["seconds_per_round"] > 0
    table = (root / "leaderboard.md").read_text()
    assert "## digits iid" in table and "| 1 | FedAvg |" in table and "n/a: " in table
    with open(root / "leaderboard.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 8
    page = (root / "leaderboard.html").read_text()
    assert page.count("<table>") == 3 and page.count("data:image/png;base64,") == 2  # self-contained
    assert "http" not in page.replace("http-equiv", "")  # nothing to fetch
    assert "<td class='m'>FedAvg</td>" in page and "n/a: local.momentum" in page
    assert (root / "leaderboard_iid.png").stat().st_size > 20_000
    out = capsys.readouterr().out
    assert "cell 0 iid / FedAvg / seed 0: final" in out and "ETA" in out
    # the suite's claims, tested on its cells beside the tables: FedProx with mu 0 is FedAvg on every seed, so the
    # paired differences are exactly 0 (inside any margin, never on one side); an n/a method's claim is not run
    claims = json.loads((root / "claims.json").read_text())
    by = {(c["claim"], c["metric"], c["column"]): c for c in claims}
    assert len(claims) == 2 + 1 + 2 + 1
    for setting in ("iid", "lda"):
        same = by[("FedProx mu=0 ~ FedAvg", "final", setting)]
        finals = [_finals(root / setting / "FedAvg" / f"seed{s}") for s in (0, 1)]
        assert same["verdict"] == "holds" and same["means"]["FedAvg"]["mean"] == pytest.approx(statistics.fmean(finals))
        assert same["links"][0]["a_values"] == same["links"][0]["b_values"] and same["links"][0]["n"] == 2
        assert by[("FedProx mu=0 ~ FedAvg", "mb", setting)]["verdict"] == "holds"
    assert by[("FedAvg > FedProx mu=0", "final", "lda")]["verdict"] == "inconclusive"
    not_run = by[("FedAvg > pFedMe momentum", "final", "iid")]
    assert not_run["verdict"] == "not run" and not_run["why"] == "pFedMe momentum is n/a on iid"
    assert "## The papers' claims on this suite" in table and "| FedAvg > FedProx mu=0 | digits LDA 0.3 |" in table
    assert "<h2 id='claims'>" in page and "<b>holds</b>" in page
    assert "claims (paired over seeds" in out and "beside the tables in leaderboard.md" in out


def test_diverged_seeds_are_counted_in_both_tables(tmp_path):
    """A method whose seeds diverged shows how many beside the seeds that finished, in leaderboard.md and in
    the HTML alike (the mean is over the others: 62.84 alone with no std would read as one good seed)."""
    from types import SimpleNamespace

    from fedistill.report.leaderboard import leaderboard_markdown, write_html

    row = {
        "setting": "lda", "label": "digits LDA", "method": "pFedMe", "seeds": 3, "metric": "personal", "status": "ok",
        "finished": 3, "diverged": 2, "final_accuracy": 62.84, "final_accuracy_std": None, "best_accuracy": 66.18,
        "best_accuracy_std": None, "rounds_to_target": None, "reached_target": 0, "mb_per_round": 17.23,
        "seconds_per_round": 10.2, "why": None, "gflops_per_round": None, "achieved_gflops_per_s": None,
        "percent_of_bf16_peak": None, "bf16_peak_gflops_per_s": None, "rank": 1,
    }  # fmt: skip
    suite = SimpleNamespace(title="t", description="", seeds=[0, 1, 2], target_accuracy=90.0, all_notes=lambda: [],
                            settings={"lda": SimpleNamespace(label="digits LDA")})  # fmt: skip
    assert "| 3/3, 2 diverged |" in leaderboard_markdown(suite, [row])
    page = write_html("t", "", [], {"lda": "digits LDA"}, [row], {}, 90.0, tmp_path / "page.html").read_text()
    assert "<td>3/3, 2 diverged</td>" in page


def test_the_leaderboard_says_on_how_many_threads_its_peak_was_measured():
    """% of peak is relative to the rate of the threads each cell has; a leaderboard.json from before says all cores."""
    from types import SimpleNamespace

    from fedistill.report.leaderboard import leaderboard_markdown

    suite = SimpleNamespace(title="t", description="", seeds=[0], target_accuracy=None, all_notes=lambda: [], settings={})
    one = {"bf16_peak_gflops_per_s": 205.6, "bf16_peak_threads": 1}
    assert "matmul rate on 1 thread, as each cell runs (206 GFLOP/s" in leaderboard_markdown(suite, [one])
    assert "matmul rate on 2 threads, as each cell runs" in leaderboard_markdown(suite, [{**one, "bf16_peak_threads": 2}])
    assert "matmul rate on all cores (181 GFLOP/s" in leaderboard_markdown(suite, [{"bf16_peak_gflops_per_s": 181.0}])
    # counted FLOPs but no peak: a machine without bf16 in hardware, said so instead of a blank column
    no_peak = leaderboard_markdown(suite, [{"gflops_per_round": 12.0, "bf16_peak_gflops_per_s": None}])
    assert "bf16 matmul rate: none here (measure_bf16_peak: this machine's bf16 matmuls are slower" in no_peak


def test_one_cell_at_a_time_then_the_rest_reuses_it(tmp_path, capsys):
    path = _suite(tmp_path, claims=CLAIMS[:1])
    out = tmp_path / "out"
    assert main(["bench", str(path), "--cell", "1", "--out", str(out), "--set", "run.threads=1"]) == 0
    capsys.readouterr()
    # the leaderboard of what finished: a claim whose cells are not all done says which are missing
    claim = json.loads((out / "tiny-bench" / "claims.json").read_text())[0]
    assert claim["verdict"] == "not run" and claim["column"] == "iid"
    assert claim["why"] == "FedProx mu=0 has 0/2 seeds finished on iid; FedAvg has 1/2 seeds finished on iid"
    assert main(["bench", str(path), "--cells", "--out", str(out)]) == 0
    states = [line.split("\t")[4].split()[0] for line in capsys.readouterr().out.splitlines()]
    assert states[:4] == ["todo", "done", "todo", "todo"] and states[4] == "n/a"  # pFedMe refused by its config
    cell = out / "tiny-bench" / "iid" / "FedAvg" / "seed1"
    stamp = (cell / "metrics.jsonl").stat().st_mtime_ns
    assert main(["bench", str(path), "--out", str(out), "--set", "run.threads=1"]) == 0
    assert (cell / "metrics.jsonl").stat().st_mtime_ns == stamp  # the finished cell was reused, not rerun
    # FLOPs an earlier version could not count are counted by the next bench; the run itself is reused
    first = out / "tiny-bench" / "iid" / "FedAvg" / "seed0"
    counted = json.loads((first / "flops.json").read_text())["flops_per_round"]
    assert counted > 0
    (first / "flops.json").write_text(json.dumps({"flops_per_round": None, "error": "RuntimeError: older counter"}))
    stamp = (first / "metrics.jsonl").stat().st_mtime_ns
    assert main(["bench", str(path), "--out", str(out), "--set", "run.threads=1"]) == 0
    assert json.loads((first / "flops.json").read_text())["flops_per_round"] == counted
    assert (first / "metrics.jsonl").stat().st_mtime_ns == stamp
    assert main(["bench", str(path), "--cell", "99", "--out", str(out)]) == 2


def test_a_stopped_bench_continues_and_a_changed_cell_is_refused(tmp_path):
    out = tmp_path / "out"
    one = {"FedAvg": TINY["methods"]["FedAvg"]}
    # a bench stopped after round 1 of every cell, then the same suite continued to round 2 from the checkpoints
    bench(load_suite(str(_suite(tmp_path, methods=one, protocol={**TINY["protocol"], "rounds": 1}))), out, overrides=["run.threads=1"])
    bench(load_suite(str(_suite(tmp_path, methods=one))), out, overrides=["run.threads=1"])
    fresh = tmp_path / "fresh"
    bench(load_suite(str(_suite(tmp_path, methods=one))), fresh, overrides=["run.threads=1"])
    def rows(root: Path, setting: str) -> list[tuple]:
        lines = (root / "tiny-bench" / setting / "FedAvg" / "seed0" / "metrics.jsonl").read_text().splitlines()
        return [(r["round"], r["test_accuracy"], r["train_loss"]) for r in map(json.loads, lines)]

    for setting in ("iid", "lda"):
        assert rows(out, setting) == rows(fresh, setting) and len(rows(out, setting)) == 2  # resumed = uninterrupted
    changed = {**TINY["protocol"], "local": {**TINY["protocol"]["local"], "lr": 0.01}}
    with pytest.raises(ConfigError, match=r"^bench: .*another configuration \(the suite or --set changed\)"):
        bench(load_suite(str(_suite(tmp_path, methods=one, protocol=changed))), out, overrides=["run.threads=1"])


def test_jobs_run_cells_in_parallel_processes_with_the_same_numbers(tmp_path):
    suite = load_suite(str(_suite(tmp_path, methods={"FedAvg": TINY["methods"]["FedAvg"]})))
    serial = bench(suite, tmp_path / "serial", jobs=1, overrides=["run.threads=1"])
    parallel = bench(suite, tmp_path / "parallel", jobs=2, overrides=["run.threads=1"])
    assert [(r["method"], r["final_accuracy"], r["best_accuracy"]) for r in serial] == [
        (r["method"], r["final_accuracy"], r["best_accuracy"]) for r in parallel
    ]
    with pytest.raises(ConfigError, match="oversubscribe"):
        bench(suite, tmp_path / "x", jobs=10_000)


def test_bad_suites_are_one_clear_error(tmp_path):
    for changes, message in [
        ({"settings": {}}, "settings is empty"),
        ({"seeds": [0, 0]}, "seeds must be distinct"),
        ({"methods": {"FedAvg": {"per_setting": {"cifar": {}}}}}, "unknown settings"),
        ({"protocol": "fedavg"}, "protocol"),
        ({"extra": 1}, "extra"),
        ({"claims": [{"claim": "FedAvg > FedNope"}]}, "claim 'FedAvg > FedNope' names methods FedNope the suite does not have"),
        ({"claims": [{"claim": "FedAvg > FedProx mu=0", "columns": ["cifar"]}]}, "names settings cifar"),
        ({"claims": [{"claim": "FedAvg ~ FedProx mu=0"}]}, "'~' needs a positive margin"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_suite(str(_suite(tmp_path, **changes)))
    with pytest.raises(ConfigError, match="no suite 'nope'"):
        load_suite("nope")


def test_shipped_suites_validate_every_cell():
    """fd-mnist and fd-fmnist (run here), the paper-scale CIFAR suites (for GPUs) and the heterogeneous-model
    suites: every method, every setting, every seed builds its configuration; methods left out mean every
    registered one on its card defaults; the fd-hetero suites list the methods that train a model group."""
    names = [name for name, _ in available_suites()]
    assert {"fd-mnist", "fd-fmnist", "fd-cifar10", "fd-cifar100", "fd-hetero-mnist", "fd-hetero-fmnist"} <= set(names)
    for name in names:
        suite = load_suite(name)
        cells = suite_cells(suite, Path("unused"))
        assert cells and all(c.why_not is None for c in cells), [(c.method, c.why_not) for c in cells if c.why_not]
        if name.startswith("fd-hetero"):
            assert {c.method for c in cells} == {"local_only", "fd", "fedproto", "fedgh", "fedtgp", "lg_fedavg", "fedgen", "fml", "fedkd", "fedmrl"}
            assert all(c.config.model.group == "mixed4" and c.config.clients_per_round == 20 for c in cells)
            assert {c.config.algorithm.variant for c in cells if c.method == "fedgen"} == {"htfllib"}
            continue
        pfedme = next(c for c in cells if c.method == "pfedme")
        assert pfedme.config.local.momentum == 0.0  # the card's value wins over the protocol's momentum
        fedict = next(c for c in cells if c.method == "fedict")
        assert fedict.config.model.name == "fd_resnet8" and fedict.config.model.server == "fd_server_resnet56"


def test_a_method_that_swaps_the_model_drops_the_protocols_model_options(tmp_path):
    """A suite narrows its CNN with model.kwargs; FedGKT's card swaps in its split fd_resnet8, which has none of
    those options: the cell runs fd_resnet8 on its own defaults instead of being n/a, and FedAvg keeps them."""
    protocol = {**TINY["protocol"], "model": {"name": "digits_cnn", "kwargs": {"channels": [8, 16], "hidden": 32}}}
    suite = load_suite(str(_suite(tmp_path, protocol=protocol, methods=None)))
    cells = {c.method: c for c in suite_cells(suite, tmp_path / "out") if c.seed == 0 and c.setting == "iid"}
    assert cells["fedgkt"].why_not is None and cells["fedgkt"].config.model.name == "fd_resnet8"
    assert cells["fedgkt"].config.model.kwargs == {}
    assert cells["fedavg"].config.model.name == "digits_cnn"
    assert cells["fedavg"].config.model.kwargs == {"channels": [8, 16], "hidden": 32}


def test_method_settings_change_a_cards_defaults_and_are_stated(tmp_path):
    """With methods left out, method_settings changes named methods' card defaults (and only theirs), over the
    card's own needs; the leaderboard lists each change. Unknown names and a suite that lists its methods are refused."""
    protocol = {**TINY["protocol"], "rounds": 1}
    settings = {"fedgkt": {"model": {"server_kwargs": {"blocks_per_stage": 1}}}, "fedprox": {"algorithm": {"mu": 0.5}}}
    suite = load_suite(str(_suite(tmp_path, protocol=protocol, methods=None, method_settings=settings)))
    cells = {c.method: c for c in suite_cells(suite, tmp_path / "out") if c.seed == 0 and c.setting == "iid"}
    assert cells["fedgkt"].config.model.server == "fd_server_resnet56"  # the card's need is kept
    assert cells["fedgkt"].config.model.server_kwargs == {"blocks_per_stage": 1}
    assert cells["fedprox"].config.algorithm.params_dict()["mu"] == 0.5
    assert cells["feddkc"].config.model.server_kwargs == {}  # not named: card defaults
    assert "fedgkt departs from its card defaults here: model.server_kwargs.blocks_per_stage=1." in suite.all_notes()
    with pytest.raises(ConfigError, match="method_settings names unknown methods \\['fedmagic'\\]"):
        load_suite(str(_suite(tmp_path, methods=None, method_settings={"fedmagic": {}})))
    with pytest.raises(ConfigError, match="with methods listed"):
        load_suite(str(_suite(tmp_path, method_settings={"fedprox": {"algorithm": {"mu": 0.5}}})))


def test_round_flops_match_the_logistic_models_count_by_hand():
    """One round of FedAvg with logistic regression (60 -> 10, no hidden layer) on 10 synthetic clients: each
    training sample costs a forward matmul (2 * 60 * 10) and the weight gradient's (2 * 60 * 10; the input needs
    no gradient), each of the 500 held-out samples one forward: 2400 * n * E + 1200 * 500."""
    from fedistill.studies.bench import count_round_flops
    from fedistill.config import build_config
    from fedistill.data.synthetic import SyntheticClients, SyntheticSpec

    base = {
        "dataset": {"name": "synthetic", "synthetic": {"max_samples": 100, "test_samples": 500}},
        "partition": {"scheme": "natural", "num_clients": 10}, "clients_per_round": 10,
        "run": {"figures": False, "progress": False, "threads": 1},
    }  # fmt: skip
    cfg = build_config(base)
    n = int(SyntheticClients(SyntheticSpec(num_clients=10, seed=cfg.partition_seed(), max_samples=100, test_samples=500)).sizes.sum())
    for epochs in (1, 3):
        tree = build_config({**base, "local": {"epochs": epochs, "batch_size": 10, "momentum": 0.0}}).resolved_dict()
        assert count_round_flops(tree)["flops_per_round"] == 2400 * n * epochs + 1200 * 500


def test_flops_are_counted_through_autograd_grad_on_a_module():
    """DaFKD's gradient penalty calls torch.autograd.grad: FlopCounterMode's module tracker fails on it, so the
    bench counts without it. x (2x3, a leaf) through a 3->4 linear layer: the forward matmul 2*2*3*4 = 48 and
    the input gradient (2x4 @ 4x3) 48 more; the weight's gradient is not asked for."""
    import torch

    from fedistill.studies.bench import counted_flops

    layer = torch.nn.Linear(3, 4, bias=False)
    x = torch.randn(2, 3, requires_grad=True)
    assert counted_flops(lambda: torch.autograd.grad(layer(x).sum(), x, create_graph=True)) == 96


def test_ray_runs_the_cells_as_tasks_on_a_local_instance(tmp_path):
    """``--ray local``: the same cells as Ray tasks (one CPU each), the same numbers as in this process."""
    pytest.importorskip("ray")
    one_cell = {"methods": {"FedAvg": TINY["methods"]["FedAvg"]}, "seeds": [0], "settings": {"lda": TINY["settings"]["lda"]}}
    suite = load_suite(str(_suite(tmp_path, **one_cell)))
    serial = bench(suite, tmp_path / "serial", overrides=["run.threads=1"])
    on_ray = bench(suite, tmp_path / "ray", overrides=["run.threads=1"], ray_address="local")
    assert [(r["setting"], r["final_accuracy"]) for r in on_ray] == [(r["setting"], r["final_accuracy"]) for r in serial]
    assert (tmp_path / "ray" / "tiny-bench" / "lda" / "FedAvg" / "seed0" / "flops.json").is_file()


def test_a_terminated_or_killed_bench_stops_its_cells_and_continues(tmp_path):
    """SIGTERM (a scheduler's stop): exit 143 at once with the command to continue, the running cells stopped rather
    than waited for (each is a whole run). SIGKILL: the cell processes end with the bench instead of writing on,
    orphaned, into the directories the next bench resumes. Either way the next bench continues the cells."""
    import os
    import signal
    import subprocess
    import sys
    import time

    long = {**TINY["protocol"], "rounds": 400, "run": {"figures": False, "checkpoint_every": 1}}
    path = _suite(tmp_path, methods={"FedAvg": TINY["methods"]["FedAvg"]}, protocol=long)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "fedistill.cli", "bench", str(path), "--jobs", "2", "--out", str(out), "--set", "run.threads=1"]
    cells = [out / "tiny-bench" / "iid" / "FedAvg" / f"seed{s}" / "metrics.jsonl" for s in (0, 1)]

    def start_and_wait_for_rounds(rounds: int) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not all(c.exists() and c.read_text().count("\n") >= rounds for c in cells):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        return proc

    def assert_gone(pids: set[int]) -> None:
        deadline = time.monotonic() + 15
        while live_processes(pids):
            assert time.monotonic() < deadline, "cell processes outlived the bench"
            time.sleep(0.2)

    started: list[int] = []
    try:
        proc = start_and_wait_for_rounds(1)
        workers = child_processes(proc.pid)
        started += [proc.pid, *workers]
        assert workers
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)  # a cell has 399 rounds left: not waited for
        assert proc.returncode == 143 and "run the same fedistill bench command again to continue" in err and "Traceback" not in err, err
        assert_gone(workers)
        done = [c.read_text().count("\n") for c in cells]

        proc = start_and_wait_for_rounds(max(done) + 1)  # resumed: the cells go on from their checkpoints
        workers = child_processes(proc.pid)
        started += [proc.pid, *workers]
        proc.kill()
        proc.communicate(timeout=30)
        assert_gone(workers)
    finally:  # a failing check must not leave 400-round cells running
        for pid in live_processes(set(started)):
            os.kill(pid, signal.SIGKILL)
    rows = [json.loads(line)["round"] for line in cells[0].read_text().splitlines()]
    assert rows == list(range(1, len(rows) + 1))  # one run, continued, no round written twice


def test_eta_expects_each_cell_to_take_its_methods_mean():
    """By hand: method a took 10 and 20 s (mean 15), b 60 s, the overall mean is 30 s; four cells left (a, b and
    two of c, which has none finished), two at a time: (15 + 60 + 30 + 30) / 2 = 67.5 s (one mean over every cell
    would say 30 * 4 / 2 = 60)."""
    finished = [("a", 10.0), ("a", 20.0), ("b", 60.0)]
    assert estimate_remaining(finished, ["a", "b", "c", "c"], jobs=2) == 67.5
    assert estimate_remaining(finished, [], jobs=2) == 0.0
    assert estimate_remaining([], ["a"], jobs=1) == 0.0


def test_the_peak_matmuls_keep_2048_where_bf16_is_fast_and_shrink_where_it_is_emulated():
    """Wherever a 2048-square matmul takes at most 1 s (17.2 GFLOP/s and up: every CPU with bf16 in hardware)
    the peak is measured on 2048 as before; at 0.9 GFLOP/s (an AVX2-only CPU) on the side whose matmul takes
    0.1 s, int((0.9e9·0.1/2)^(1/3)) = 355; never below 256."""
    assert peak_matmul_size(200.0) == 2048 and peak_matmul_size(17.2) == 2048
    assert peak_matmul_size(0.9) == 355
    assert peak_matmul_size(0.001) == 256


def test_the_peak_is_the_best_rate_of_its_matmuls_on_the_threads_asked_for():
    """A rate in GFLOP/s from square bf16 matmuls (256-square here, for a twentieth of a second); torch's thread
    count is set for the measurement and given back."""
    import torch

    from fedistill.engine.flops import measure_bf16_peak

    threads = torch.get_num_threads()
    rate = measure_bf16_peak(1, size=256, seconds=0.05)
    assert (rate is None or 0.01 < rate < 10_000) and torch.get_num_threads() == threads  # None: no bf16 here


@pytest.mark.measure_peak
def test_a_machine_whose_bf16_is_slower_than_its_fp32_has_no_bf16_peak(monkeypatch, tmp_path):
    """An AVX2-only CPU emulates bf16 (1.2 GFLOP/s against 44 in fp32): a "% of bf16 peak" against that rate would
    read hundreds of percent, so there is none; where bf16 is the faster, the 256-square matmuls are measured."""
    import torch

    from fedistill.engine import flops

    monkeypatch.setattr(flops, "_probe_rate", lambda dtype, **_: 1.2 if dtype == torch.bfloat16 else 44.0)
    assert flops.measure_bf16_peak(1, size=256, seconds=0.05) is None
    assert best_bf16_peak(tmp_path, None) is None  # nothing measured before: no peak
    assert best_bf16_peak(tmp_path, 180.0) == 180.0
    assert best_bf16_peak(tmp_path, None) == 180.0  # an earlier reading of this directory stands
    monkeypatch.setattr(flops, "_probe_rate", lambda dtype, **_: 200.0 if dtype == torch.bfloat16 else 44.0)
    rate = flops.measure_bf16_peak(1, size=256, seconds=0.05)
    assert rate is not None and rate > 0


def test_the_bf16_peak_is_the_best_any_bench_of_the_directory_measured(tmp_path):
    """A reading taken while other work held the cores never lowers the peak every "% of peak" is relative to."""
    assert best_bf16_peak(tmp_path, 180.0) == 180.0
    assert best_bf16_peak(tmp_path, 82.0) == 180.0  # a loaded machine's reading
    assert best_bf16_peak(tmp_path, 195.0) == 195.0
    assert best_bf16_peak(tmp_path, 400.0, threads=2) == 400.0  # kept per thread count:
    assert best_bf16_peak(tmp_path, 150.0, threads=1) == 195.0  # a two-thread rate is not a one-thread peak
    (tmp_path / "bf16_peak.json").write_text("not json")
    assert best_bf16_peak(tmp_path, 90.0) == 90.0  # unreadable: the fresh measurement stands
    (tmp_path / "bf16_peak.json").write_text('{"bf16_peak_gflops_per_s": 414.0}')  # an old file's all-core reading
    assert best_bf16_peak(tmp_path, 205.0) == 205.0


# Work cut for the flop-counter test only: what it checks (the counter watches, never moves a number) does not depend
# on how many steps the server takes, how deep its model is or how many local epochs run.
LIGHTER = {
    "dafkd": {"algorithm": {"distill_samples": 64, "distill_epochs": 2}, "local": {"epochs": 1}},
    "feddf": {"algorithm": {"distill_steps": 20, "generator_steps": 5, "student_steps": 5}},
    "fedftg": {"algorithm": {"iterations": 2}},
    **{name: {"model": {"server_kwargs": {"blocks_per_stage": 1}}} for name in ("fedgkt", "feddkc", "fedict")},
}


def _one_round_rows(name: str, digits, count: bool) -> tuple[list[dict], "torch.Tensor", list[int]]:
    from fedistill.config import build_config
    import torch

    from fedistill.models.flat import get_flat, num_flat
    from fedistill.simulation import Simulation

    # 12 clients of about 120 digits each, 3 of them in the round: every method's code path at half the samples
    # (the heavy methods with the lighter settings above)
    lighter = LIGHTER.get(name, {})
    cfg = build_config({**lighter, "algorithm": {"name": name, **lighter.get("algorithm", {})}, "rounds": 1, "clients_per_round": 3,
                        "partition": {"num_clients": 12}, "run": {"progress": False, "threads": 1, "workers": 1}})  # fmt: skip
    simulation = Simulation(cfg, digits)
    counted: list[int] = []
    if count:
        simulation.count_first_round = counted.append
    try:
        rows = simulation.run()
        if num_flat(simulation.server.model) == 0:  # a method whose clients keep their own models: those are the weights
            store = simulation.server_runtime.client_store
            owned = [store.load(cid)["model"] for cid in range(12) if "model" in store.load(cid)]
            return rows, torch.cat(owned), counted
        return rows, get_flat(simulation.server.model).clone(), counted
    finally:
        simulation.close()


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_method_trains_bit_for_bit_the_same_under_the_flop_counter(name, digits):
    """The bench counts round 1 of a first-seed cell inside the run itself (engine/flops.py): the counter is a
    dispatch mode that must only watch. For every registered method, round 1 with and without it leaves the
    same global weights (to the bit) and the same metrics but the seconds, and the counted row is marked."""
    import torch

    assert len(ALGORITHMS.names()) >= 25  # the parametrisation saw every method, not an empty registry
    plain_rows, plain_weights, none = _one_round_rows(name, digits, count=False)
    counted_rows, counted_weights, counted = _one_round_rows(name, digits, count=True)
    assert none == [] and len(counted) == 1 and counted[0] > 0
    assert torch.equal(plain_weights, counted_weights), "the counter moved the weights"
    plain, marked = plain_rows[0], counted_rows[0]
    assert marked.pop("flops_counted") is True and "flops_counted" not in plain
    untimed = lambda row: {k: v for k, v in row.items() if k != "seconds" and not k.endswith("_seconds")}  # noqa: E731
    assert untimed(plain) == untimed(marked)


def _synthetic_cell(rounds: int, clients_per_round: int) -> dict:
    """A bench cell's resolved config on FedAvg with logistic regression over 10 synthetic clients (the hand count of
    test_round_flops_match_the_logistic_models_count_by_hand)."""
    from fedistill.config import build_config

    return build_config({
        "dataset": {"name": "synthetic", "synthetic": {"max_samples": 100, "test_samples": 500}}, "rounds": rounds,
        "partition": {"scheme": "natural", "num_clients": 10}, "clients_per_round": clients_per_round,
        "local": {"epochs": 1, "batch_size": 10, "momentum": 0.0}, "run": {"progress": False, "threads": 1, "workers": 1},
    }).resolved_dict()  # fmt: skip


def test_the_runs_own_round_one_is_counted_and_left_out_of_its_seconds(tmp_path):
    """FedAvg with logistic regression on synthetic clients (the hand count of
    test_round_flops_match_the_logistic_models_count_by_hand): a bench cell's first seed counts round 1 inside
    the run, the same number as the one-round copy, and its s/round is round 2's seconds alone."""
    from fedistill.studies.bench import _run_cell, count_round_flops
    from fedistill.config import build_config
    from fedistill.studies.reproduce import run_result
    from fedistill.runs import read_saved

    tree = _synthetic_cell(rounds=2, clients_per_round=10)
    path = tmp_path / "cell"
    _run_cell(tree, str(path), count_flops=True)
    flops = json.loads((path / "flops.json").read_text())
    assert flops["counted"] == "in the run"
    assert flops["flops_per_round"] == count_round_flops(tree)["flops_per_round"]
    _, rows, _ = read_saved(path)
    assert [bool(r.get("flops_counted")) for r in rows] == [True, False]
    result = run_result(build_config(tree), "s", "FedAvg", 0, rows, False)
    assert result.seconds_per_round == rows[1]["seconds"]


def test_a_counter_that_fails_inside_the_run_costs_the_cell_nothing(tmp_path, monkeypatch):
    """If the counter cannot follow a method inside the run, the cell runs again without it and the
    one-round copy counts (or records why not): the cell's numbers are the plain run's."""
    import fedistill.engine.flops as flops_module
    from fedistill.studies.bench import _run_cell
    from fedistill.config import build_config
    from fedistill.runs import read_saved

    tree = build_config({**{k: TINY["protocol"][k] for k in ("dataset", "partition", "local", "clients_per_round")},
                         "rounds": 2, "run": {"progress": False, "threads": 1, "workers": 1}}).resolved_dict()  # fmt: skip
    _run_cell(tree, str(tmp_path / "plain"))

    def broken(work):
        work()
        raise RuntimeError("the counter cannot follow this method")

    monkeypatch.setattr(flops_module, "counted_flops", broken)
    _run_cell(tree, str(tmp_path / "counted"), count_flops=True)
    _, plain, _ = read_saved(tmp_path / "plain")
    _, rows, summary = read_saved(tmp_path / "counted")
    assert summary["status"] == "finished" and len(rows) == 2 and not any(r.get("flops_counted") for r in rows)
    assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in plain]
    flops = json.loads((tmp_path / "counted" / "flops.json").read_text())
    assert flops["flops_per_round"] > 0 and "counted" not in flops  # the one-round copy's count


def test_a_round_the_process_was_stopped_in_is_marked_and_left_out_of_its_seconds(tmp_path, monkeypatch):
    """A real stop: in round 2 the run stops itself (SIGSTOP) and a child process continues it (SIGCONT) 0.4 s later,
    as `kill -STOP` / `kill -CONT` on a bench, Ctrl-Z then `fg`, or a scheduler's suspend would. Round 2's row is
    marked ``paused``, its seconds hold the stop, and s/round is the mean of rounds 1 and 3 alone."""
    import os
    import signal
    import subprocess
    import sys

    from fedistill.config import build_config
    from fedistill.engine.server import ServerRuntime
    from fedistill.runs import read_saved
    from fedistill.studies.bench import _run_cell
    from fedistill.studies.reproduce import run_result

    original = ServerRuntime.broadcast
    stopped = []

    def broadcast_then_stop_once(self, info, cid):
        if info.round == 2 and not stopped:
            stopped.append(cid)
            subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep(0.4); os.kill({os.getpid()}, signal.SIGCONT)"])
            os.kill(os.getpid(), signal.SIGSTOP)  # continued by the child
        return original(self, info, cid)

    monkeypatch.setattr(ServerRuntime, "broadcast", broadcast_then_stop_once)
    tree = _synthetic_cell(rounds=3, clients_per_round=4)
    path = tmp_path / "cell"
    _run_cell(tree, str(path), count_flops=False)
    _, rows, _ = read_saved(path)
    assert stopped and [bool(r.get("paused")) for r in rows] == [False, True, False]
    assert rows[1]["seconds"] >= 0.4
    result = run_result(build_config(tree), "s", "FedAvg", 0, rows, False)
    assert result.seconds_per_round == pytest.approx((rows[0]["seconds"] + rows[2]["seconds"]) / 2)
