"""The round loop: determinism, exact resume, divergence handling, client sampling."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_learns, assert_resume_is_exact

from fedistill.engine.seeding import derive_seed, sample_clients
from fedistill.simulation import Simulation, summarise
from fedistill.errors import ConfigError, TrainingDiverged
from fedistill.models.flat import get_flat


def test_client_sampling_depends_only_on_seed_and_round():
    a = [sample_clients(100, 10, seed=3, rnd=r) for r in range(1, 6)]
    b = [sample_clients(100, 10, seed=3, rnd=r) for r in range(1, 6)]
    assert a == b
    assert all(len(set(s)) == 10 and s == sorted(s) for s in a)
    assert len({tuple(s) for s in a}) > 1  # rounds differ
    assert sample_clients(100, 10, seed=4, rnd=1) != a[0]


def test_derived_seeds_differ_across_coordinates():
    seeds = {derive_seed(0, 2, r, c) for r in range(5) for c in range(5)}
    assert len(seeds) == 25


def test_two_runs_with_the_same_seed_are_identical(make_config, digits):
    cfg = make_config(rounds=3)
    a, b = Simulation(cfg, digits), Simulation(cfg, digits)
    for rnd in (1, 2, 3):
        ra, rb = a.run_round(rnd), b.run_round(rnd)
        assert torch.equal(get_flat(a.server.model), get_flat(b.server.model))
        assert ra["test_accuracy"] == rb["test_accuracy"]


@pytest.mark.parametrize("algorithm, server_keys", [("fedavg", ()), ("fedavgm", ("server_momentum",))])
def test_resume_equals_uninterrupted_bitwise(digits, tmp_path, algorithm, server_keys):
    assert_resume_is_exact(digits, tmp_path, algorithm, server_keys=server_keys)


def test_resume_refuses_a_changed_configuration(make_config, digits, tmp_path):
    Simulation(make_config(rounds=2), digits, run_dir=tmp_path).run()
    changed = Simulation(make_config(rounds=4, **{"local.lr": 0.5}), digits, run_dir=tmp_path)
    with pytest.raises(ConfigError, match="local"):
        changed.run(resume=True)


def test_non_finite_global_model_stops_the_run_and_keeps_last_good_checkpoint(make_config, digits, tmp_path):
    sim = Simulation(make_config(rounds=5), digits, run_dir=tmp_path)
    real = sim.algorithm.aggregate

    def poisoned(server, info, replies):
        out = real(server, info, replies)
        if info.round == 3:
            with torch.no_grad():
                next(server.model.parameters()).fill_(float("nan"))
        return out

    sim.algorithm.aggregate = poisoned
    with pytest.raises(TrainingDiverged, match="round 3.*in the server's step .every upload was finite.*round 2"):
        sim.run()
    good = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert good["round"] == 2
    assert all(torch.isfinite(v).all() for v in good["global_model"].values())


def test_a_non_finite_upload_names_the_client_and_the_entry(make_config, digits):
    """The divergence error says which step went non-finite: here one client's local update (its weights)."""
    from fedistill.protocol import Message

    sim = Simulation(make_config(rounds=2), digits)
    runtime = sim.client_runtime
    real = runtime.algorithm.local_update
    chosen = []

    def poisoned(client, info, msg):
        reply = real(client, info, msg)
        if not chosen:
            chosen.append(client.cid)
            return Message({**reply, "weights": torch.full_like(reply["weights"], float("inf"))})
        return reply

    runtime.algorithm.local_update = poisoned
    with pytest.raises(TrainingDiverged) as caught:
        sim.run()
    assert f"in the clients' local updates: non-finite uploads from client {chosen[0]} (weights)" in str(caught.value)
    assert "round 1" in str(caught.value) and "local.lr" in str(caught.value)


def test_summary_reports_best_final_and_rounds_to_target():
    rows = [
        {"round": 1, "test_accuracy": 50.0, "test_loss": 1.0, "bytes_down": 10, "bytes_up": 11, "seconds": 1.0, "train_loss": 2.0},
        {"round": 2, "test_accuracy": None, "test_loss": None, "bytes_down": 10, "bytes_up": 11, "seconds": 1.0, "train_loss": 1.5},
        {"round": 3, "test_accuracy": 80.0, "test_loss": 0.5, "bytes_down": 10, "bytes_up": 11, "seconds": 1.0, "train_loss": 1.0},
        {"round": 4, "test_accuracy": 70.0, "test_loss": 0.6, "bytes_down": 10, "bytes_up": 11, "seconds": 1.0, "train_loss": 0.9},
    ]
    s = summarise(rows, target=75.0)
    assert (s["final_accuracy"], s["best_accuracy"], s["best_round"], s["rounds_to_target"]) == (70.0, 80.0, 3, 3)
    assert (s["bytes_down"], s["bytes_up"]) == (40, 44)
    assert summarise(rows, target=90.0)["rounds_to_target"] is None


def test_evaluation_every_n_rounds_and_always_after_the_last(make_config, digits):
    sim = Simulation(make_config(rounds=5, **{"eval.every": 2}), digits)
    history = sim.run()
    assert [r["round"] for r in history if r["test_accuracy"] is not None] == [2, 4, 5]


def test_fedavg_and_fedavgm_learn_on_label_skewed_digits(digits):
    assert_learns(digits, "fedavg")
    assert_learns(digits, "fedavgm")


def test_oversubscribed_workers_are_refused(make_config, digits, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    sim = Simulation(make_config(**{"run.workers": 2, "run.threads": 2}), digits)
    with pytest.raises(ConfigError, match="exceed the 2 CPU cores"):
        sim.run()


def test_building_and_running_never_reseeds_the_global_generators(make_config, digits, monkeypatch):
    """Models, generators and DaFKD's discriminators are initialised from their own seeded CPU stream inside
    fork_rng(devices=[]); torch.manual_seed there would also reseed CUDA's generator, which fork_rng does not
    restore (tests/test_cuda.py checks the CUDA side on a GPU)."""
    def refuse(seed):
        raise AssertionError("torch.manual_seed reseeds every device's generator")

    monkeypatch.setattr(torch, "manual_seed", refuse)
    quick = {"algorithm.distill_samples": 64, "algorithm.distill_epochs": 1, "algorithm.generator_width": 16, "algorithm.noise_dim": 16}
    for algorithm, extra in (("fedavg", {}), ("dafkd", quick), ("fedftg", {"algorithm.iterations": 1, "algorithm.generator_width": 16})):
        history = Simulation(make_config(rounds=2, **{"algorithm.name": algorithm}, **extra), digits).run()  # DaFKD distils from round 2
        assert len(history) == 2


# -- issue 61: the server step's own effect and the collapse warning ---------------------------------------


def test_a_server_refiners_step_is_measured_against_the_aggregate_it_started_from(make_config, digits):
    """Every evaluated round of a method whose server changes ŵ after aggregation records ŵ's accuracy and the
    step's change; the expected values come from evaluating a copy of ŵ taken inside the round by hand. A method
    without such a step (FedAvg) records neither: its model is ŵ."""
    from fedistill.engine.evaluation import evaluate
    from fedistill.models.flat import set_flat

    sim = Simulation(make_config(rounds=2, **{"algorithm.name": "fedavg"}), digits)
    plain = sim.run_round(1)
    assert "aggregate_accuracy" not in plain and "server_step_accuracy_change" not in plain

    sim = Simulation(make_config(rounds=2, **{"algorithm.name": "fedavg"}), digits)
    algorithm, runtime, kept = sim.algorithm, sim.server_runtime, {}

    def refine(server, info, replies, cids):  # a server step that scales the last layer: changes predictions
        kept[info.round] = get_flat(server.model)
        with torch.no_grad():
            list(server.model.parameters())[-2].mul_(-1.0)
        return {}

    algorithm.refine = refine
    for rnd in (1, 2):
        row = sim.run_round(rnd)
        after = get_flat(runtime.server.model)
        probe = runtime.server.model
        set_flat(probe, kept[rnd])
        expected = evaluate(probe, runtime.test_pipeline.test_batches(100), "fp32")
        set_flat(probe, after)
        assert row["aggregate_accuracy"] == pytest.approx(100.0 * expected.accuracy)
        assert row["aggregate_loss"] == pytest.approx(expected.loss)
        assert row["server_step_accuracy_change"] == pytest.approx(row["test_accuracy"] - 100.0 * expected.accuracy)
        assert row["server_step_accuracy_change"] != 0.0  # the flipped layer must show
        assert torch.equal(get_flat(runtime.server.model), after)  # the measurement leaves the refined model alone


@pytest.mark.parametrize("culprit", ["server_step", "aggregate"])
def test_a_round_thrown_to_chance_is_warned_about_naming_its_step_and_counted(make_config, digits, culprit, caplog):
    """Issue 61's rule: accuracy within a point of 100/C after an earlier round 20 points above chance. The model
    is zeroed (every logit 0: class 0, 27 of the 297 digits, 9.09 %) from round 3 on, by the server's step or in
    the aggregate itself; the warning names that step, the row marks it and the summary counts both rounds.
    A rule that looked at the model after the server's step only could not tell the two apart."""
    import logging

    sim = Simulation(make_config(rounds=4, **{"local.epochs": 2}), digits)
    algorithm = sim.algorithm
    real_aggregate = algorithm.aggregate

    def aggregate(server, info, replies):
        out = real_aggregate(server, info, replies)
        if info.round >= 3:
            with torch.no_grad():
                for tensor in server.model.state_dict().values():
                    if tensor.is_floating_point():
                        tensor.zero_()
            if culprit == "aggregate":
                server.aggregate = get_flat(server.model)  # as if the clients' average itself were at chance
        return out

    algorithm.aggregate = aggregate
    with caplog.at_level(logging.WARNING, logger="fedistill.engine"):
        history = sim.run()
    accuracies = [r["test_accuracy"] for r in history]
    assert max(accuracies[:2]) >= 30.0 and accuracies[2:] == [pytest.approx(100 * 27 / 297)] * 2, accuracies
    # Round 4's clients start from the zeroed model, which cannot train (every ReLU is dead): from then on
    # the aggregate itself is at chance, whichever step zeroed it in round 3.
    assert [r.get("collapse") for r in history] == [None, None, culprit, "aggregate"]
    warnings = [m for m in caplog.messages if "collapsed to chance" in m]
    assert len(warnings) == 2 and "round 3 " in warnings[0] and "round 4 " in warnings[1]
    named = "the server's step" if culprit == "server_step" else "the clients' aggregate"
    assert named in warnings[0] and "the clients' aggregate" in warnings[1], warnings
    assert summarise(history, None)["collapsed_rounds"] == 2


def test_a_model_that_never_rose_above_chance_is_not_called_collapsed(make_config, digits, caplog):
    """At chance from the first round on (never 20 points above it): no warning, nothing counted."""
    sim = Simulation(make_config(rounds=2, **{"local.lr": 1e-9}), digits)
    history = sim.run()
    assert all(r["test_accuracy"] < 30.0 for r in history)
    assert not [m for m in caplog.messages if "collapsed" in m]
    assert summarise(history, None)["collapsed_rounds"] == 0
