"""A run records the CPU as far as its speed depends on it (environment.json ``cpu_id``), and a leaderboard whose
cells ran on more than one CPU says so: two hosts both named "AMD EPYC" differed 3-3.6x in a round of the same run
(one with AVX-512 and bf16, one with AVX2 only), which the name alone did not show."""

from __future__ import annotations

import json
import shutil

from fedistill.report.environment import cpu_identity
from fedistill.report.leaderboard import leaderboard_markdown, timing_note
from fedistill.studies.bench import bench, load_suite
from fedistill.studies.bench_results import UNRECORDED_CPU

# /proc/cpuinfo's first block of the two hosts (abridged: the fields cpu_identity reads, and flags around them)
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512_bf16 avx512_vnni

processor\t: 1
model name\t: Another CPU
"""
ZEN3 = ZEN4.replace("model\t\t: 17", "model\t\t: 1").replace(" avx512f avx512dq avx512_bf16 avx512_vnni", "")


def test_two_hosts_of_one_name_have_two_identities():
    assert cpu_identity(ZEN4) == "AMD EPYC (family 25 model 17; avx2 avx512f avx512_bf16)"
    assert cpu_identity(ZEN3) == "AMD EPYC (family 25 model 1; avx2)"
    # only the first processor's block is read; a CPU without any of the flags says so
    assert cpu_identity("model name\t: Old\ncpu family\t: 6\nmodel\t\t: 2\nflags\t\t: fpu sse2\n") == "Old (family 6 model 2; no avx2)"
    assert cpu_identity("model name\t: Bare\n") == "Bare"


def _row(method: str, cpus: dict[str, int] | None) -> dict:
    row = {"setting": "lda", "label": "digits", "method": method, "final_accuracy": 90.0, "seeds": 3}
    return row if cpus is None else {**row, "cpus": cpus}


def test_a_board_on_one_cpu_has_no_note_and_a_mixed_one_counts_its_cells_by_cpu():
    assert timing_note([_row("a", {"zen4": 3}), _row("b", {"zen4": 3})]) is None
    assert timing_note([_row("a", None), _row("b", None)]) is None  # a leaderboard.json from before cpus
    note = timing_note([_row("a", {"zen4": 3}), _row("b", {"zen3": 2, "zen4": 1}), _row("c", {UNRECORDED_CPU: 3})])
    assert note.startswith("Timings from 3 CPUs: 9 cells, 4 on zen4, 3 on unrecorded, 2 on zen3.")


SUITE = {
    "name": "tiny-cpus", "title": "tiny suite on digits",
    "protocol": {"rounds": 1, "clients_per_round": 2, "dataset": {"name": "digits"},
                 "partition": {"num_clients": 4, "seed": 3, "scheme": "lda", "alpha": 0.5},
                 "local": {"epochs": 1, "batch_size": 32, "lr": 0.05}, "run": {"figures": False}},
    "settings": {"lda": {"label": "digits LDA 0.5", "config": {}}},
    "methods": {"FedAvg": {"config": {"algorithm": {"name": "fedavg"}}}, "FedProx": {"config": {"algorithm": {"name": "fedprox", "mu": 0.1}}}},
    "seeds": [0, 1],
}  # fmt: skip


def test_a_bench_records_each_rows_cpus_and_notes_cells_from_another(tmp_path):
    import yaml

    path = tmp_path / "tiny-cpus.yaml"
    path.write_text(yaml.safe_dump(SUITE, sort_keys=False))
    suite = load_suite(str(path))
    rows = bench(suite, tmp_path / "out", overrides=["run.threads=1"])
    here = cpu_identity()
    assert [r["cpus"] for r in rows] == [{here: 2}, {here: 2}]
    root = tmp_path / "out" / "tiny-cpus"
    cells = json.loads((root / "cells.json").read_text())
    assert {e["cpu_id"] for e in cells["environments"].values()} == {here}
    assert "Timings from" not in (root / "leaderboard.md").read_text()
    # one FedProx cell finished on another host (its environment.json says so): the board is written again, and
    # says which cells ran where; a cell from before cpu_id counts as unrecorded
    env_path = root / "lda" / "FedProx" / "seed1" / "environment.json"
    env = json.loads(env_path.read_text())
    env_path.write_text(json.dumps({**env, "cpu_id": "Elsewhere (family 1 model 1; avx2)"}))
    old = root / "lda" / "FedAvg" / "seed0" / "environment.json"
    old.write_text(json.dumps({k: v for k, v in json.loads(old.read_text()).items() if k != "cpu_id"}))
    rows = bench(suite, tmp_path / "out", overrides=["run.threads=1"])
    by_method = {r["method"]: r["cpus"] for r in rows}
    assert by_method == {"FedAvg": {UNRECORDED_CPU: 1, here: 1}, "FedProx": {"Elsewhere (family 1 model 1; avx2)": 1, here: 1}}
    text = (root / "leaderboard.md").read_text()
    assert f"Timings from 3 CPUs: 4 cells, 2 on {here}, " in text
    assert "Timings from 3 CPUs" in (root / "leaderboard.html").read_text()
    assert leaderboard_markdown(suite, rows).count("Timings from") == 1
    shutil.rmtree(tmp_path / "out")
