"""FedDyn invariants from spec/feddyn.md §7."""

from __future__ import annotations

import time

import torch
from conftest import assert_learns, assert_resume_is_exact

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


def test_feddyn_resumes_exactly_and_learns(digits, tmp_path):
    assert_resume_is_exact(digits, tmp_path, "feddyn", server_keys=("feddyn_h",), client_keys=("feddyn_g",))
    assert_learns(digits, "feddyn")


def test_extra_terms_have_gradient_minus_g_at_the_anchor():
    from fedistill.losses import dynamic_regulariser

    w = [torch.randn(3, 2, requires_grad=True), torch.randn(4, requires_grad=True)]
    anchors = [t.detach().clone() for t in w]
    g = [torch.randn(3, 2), torch.randn(4)]
    grads = torch.autograd.grad(dynamic_regulariser(w, anchors, g, 0.1), w)
    for gr, gk in zip(grads, g):
        assert torch.allclose(gr, -gk, atol=1e-7)
