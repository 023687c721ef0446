"""FedDyn invariants from spec/feddyn.md §7."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import assert_learns, assert_resume_is_exact

from fedistill.simulation import Simulation
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


# -- adaptive_alpha (card §3 and ambiguity 2) -----------------------------------------------------------
def _adaptive(make_config, digits, **extra):
    """A simulation with the flag on; the engine tells the server every client's n_j."""
    cfg = make_config(**{"algorithm.name": "feddyn", "algorithm.alpha": 0.2, "algorithm.adaptive_alpha": True, **extra})
    sim = Simulation(cfg, digits)
    assert sim.server.client_num_samples == tuple(int(ix.numel()) for ix in sim.federation.train_indices)
    return sim


def test_adaptive_alpha_is_off_by_default_and_needs_the_population_sizes(make_config, digits):
    from fedistill.algorithms.feddyn import FedDyn
    from fedistill.errors import ConfigError

    assert FedDyn.Params().adaptive_alpha is False
    plain = Simulation(make_config(algorithm="feddyn"), digits)
    assert "feddyn_alpha" not in plain.server_runtime.broadcast(plain.round_info(1), 0)
    sim = Simulation(make_config(**{"algorithm.name": "feddyn", "algorithm.adaptive_alpha": True}), digits)
    sim.server.client_num_samples = None  # a deployment that does not tell the server the client sizes
    with pytest.raises(ConfigError, match="adaptive_alpha"):
        sim.server_runtime.broadcast(sim.round_info(1), 0)


def test_adaptive_alpha_k_is_alpha_times_n_over_n_k_times_k(make_config, digits):
    sim = _adaptive(make_config, digits)
    sizes = [int(ix.numel()) for ix in sim.federation.train_indices]
    assert len(set(sizes)) > 1  # lda: unequal clients, so α_k differs from α
    mean_size = sum(sizes) / len(sizes)
    for cid, n_k in enumerate(sizes):
        sent = sim.server_runtime.broadcast(sim.round_info(1), cid)["feddyn_alpha"]
        assert abs(sent - 0.2 * mean_size / n_k) < 1e-12


def test_adaptive_round_one_equals_fedprox_with_mu_alpha_k(make_config, digits):
    """Round 1 (g_k = 0): client k's loss is FedProx's with μ = α_k = α·N/(n_k·K), computed here by hand."""
    sim = _adaptive(make_config, digits)
    sizes = [int(ix.numel()) for ix in sim.federation.train_indices]
    cid = 1
    alpha_k = 0.2 * sum(sizes) / (sizes[cid] * len(sizes))
    prox = Simulation(make_config(**{"algorithm.name": "fedprox", "algorithm.mu": alpha_k}), digits)
    info = sim.round_info(1)
    state = {}
    a = sim.client_runtime.update(cid, info, sim.server_runtime.broadcast(info, cid), state)
    b = prox.client_runtime.update(cid, info, prox.server_runtime.broadcast(info, cid), {})
    assert torch.allclose(a["weights"], b["weights"], atol=1e-7)
    w0 = get_flat(sim.server.model)
    # g_k ← g_k − α_k (w_k − w_anchor), with α_k and not α
    assert torch.allclose(state["feddyn_g"].double(), -alpha_k * (a["weights"].double() - w0.double()), atol=1e-7)


def test_adaptive_server_adds_the_mean_accumulated_drift_like_the_official_code(make_config, digits):
    """Official server: w_g = mean_{S_t} w_k + (1/K) Σ_all λ_k, λ_k = Σ_t (w_k − w_anchor) kept here by hand."""
    sim = _adaptive(make_config, digits, rounds=3)
    k = sim.federation.num_clients
    sizes = sim.server.client_num_samples
    drifts = {}  # λ_k, the official code's local_param_list
    for rnd in (1, 2, 3):
        info = sim.round_info(rnd)
        store = sim.server_runtime.client_store
        anchor = get_flat(sim.server.model).double()
        replies = {}
        for cid in sim.server_runtime.select_clients(rnd):
            state = store.load(cid)
            replies[cid] = sim.client_runtime.update(cid, info, sim.server_runtime.broadcast(info, cid), state)
            store.save(cid, state, rnd)
            drifts[cid] = drifts.get(cid, 0) + (replies[cid]["weights"].double() - anchor)
        sim.server_runtime.complete_round(info, replies, 0, 0, time.perf_counter())
        mean_w = sum(r["weights"].double() for r in replies.values()) / len(replies)
        expected = mean_w + sum(drifts.values()) / k
        assert torch.allclose(get_flat(sim.server.model).double(), expected, atol=1e-5)
        for cid, lam in drifts.items():  # g_k = −α_k λ_k for every client that has trained
            alpha_k = 0.2 * sum(sizes) / (sizes[cid] * k)
            assert torch.allclose(sim.state.client_states[cid]["feddyn_g"].double(), -alpha_k * lam, atol=1e-6)
