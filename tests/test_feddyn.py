"""FedDyn invariants from spec/feddyn.md §7."""

from __future__ import annotations

import time

import torch

from fedistill.engine.simulation import Simulation
from fedistill.models.flat import get_flat


def test_h_is_the_mean_of_all_client_g_and_unsampled_g_are_untouched(make_config, digits):
    sim = Simulation(make_config(rounds=3, algorithm="feddyn"), digits)
    k = sim.federation.num_clients
    for rnd in (1, 2, 3):
        before = {c: s["feddyn_g"].clone() for c, s in sim.state.client_states.items() if "feddyn_g" in s}
        selected = set(sim.server_runtime.select_clients(rnd))
        sim.run_round(rnd)
        for c, g in before.items():
            if c not in selected:
                assert torch.equal(sim.state.client_states[c]["feddyn_g"], g)
        total = sum(s["feddyn_g"].double() for s in sim.state.client_states.values())
        assert torch.allclose(sim.server.state["feddyn_h"].double(), total / k, atol=1e-6)


def test_round_one_local_weights_equal_fedprox_with_mu_alpha(make_config, digits):
    dyn = Simulation(make_config(**{"algorithm.name": "feddyn", "algorithm.alpha": 0.3}), digits)
    prox = Simulation(make_config(**{"algorithm.name": "fedprox", "algorithm.mu": 0.3}), digits)
    info = dyn.round_info(1)
    a = dyn.client_runtime.update(1, info, dyn.server_runtime.broadcast(info, 1), {})
    b = prox.client_runtime.update(1, info, prox.server_runtime.broadcast(info, 1), {})
    assert torch.allclose(a["weights"], b["weights"], atol=1e-7)


def test_single_client_round_one_gives_two_w1_minus_w0(make_config, digits):
    cfg = make_config(
        algorithm="feddyn", clients_per_round=1, **{"partition.num_clients": 1, "partition.scheme": "iid"}
    )
    sim = Simulation(cfg, digits)
    w0 = get_flat(sim.server.model)
    info = sim.round_info(1)
    reply = sim.client_runtime.update(0, info, sim.server_runtime.broadcast(info, 0), {})
    sim.server_runtime.complete_round(info, {0: reply}, 0, 0, time.perf_counter())
    assert torch.allclose(get_flat(sim.server.model), 2 * reply["weights"] - w0, atol=1e-6)


def test_feddyn_resumes_exactly_and_learns(make_config, digits, tmp_path):
    full = Simulation(make_config(rounds=4, algorithm="feddyn"), digits, run_dir=tmp_path / "a")
    full.run()
    Simulation(make_config(rounds=2, algorithm="feddyn"), digits, run_dir=tmp_path / "b").run()
    resumed = Simulation(make_config(rounds=4, algorithm="feddyn"), digits, run_dir=tmp_path / "b")
    resumed.run(resume=True)
    assert torch.equal(get_flat(full.server.model), get_flat(resumed.server.model))
    assert torch.equal(full.server.state["feddyn_h"], resumed.server.state["feddyn_h"])
    cfg = make_config(rounds=15, clients_per_round=5, **{"algorithm.name": "feddyn", "partition.num_clients": 10,
                                                          "partition.alpha": 0.3, "local.epochs": 2})
    assert Simulation(cfg, digits).run()[-1]["test_accuracy"] > 70.0
