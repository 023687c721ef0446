"""MOON invariants from spec/moon.md §7."""

from __future__ import annotations

import math

import torch
from conftest import assert_learns, assert_resume_is_exact, assert_same_rounds, global_vectors

from fedistill.engine.simulation import Simulation
from fedistill.losses import model_contrastive


def test_mu_zero_is_fedavg_step_for_step(make_config, digits):
    assert_same_rounds(make_config(algorithm="fedavg"), make_config(**{"algorithm.name": "moon", "algorithm.mu": 0.0}), digits)


def test_previous_equal_to_global_gives_log_two_and_fedavgs_round_one(make_config, digits):
    z, zg = torch.randn(8, 5, requires_grad=True), torch.randn(8, 5)
    loss = model_contrastive(z, zg, zg.clone(), 0.5)
    assert math.isclose(float(loss.detach()), math.log(2), rel_tol=1e-6)
    (grad,) = torch.autograd.grad(loss, z)
    assert float(grad.abs().max()) < 1e-7
    a = global_vectors(make_config(algorithm="fedavg"), digits, 1)
    b = global_vectors(make_config(**{"algorithm.name": "moon", "algorithm.mu": 5.0}), digits, 1)
    assert torch.allclose(a[0], b[0], atol=1e-6)  # round 1: every client's previous model is w_g^0


def test_contrastive_loss_is_positive_decreases_toward_the_global_and_survives_zero_features():
    z, zg, zp = torch.randn(8, 5), torch.randn(8, 5), torch.randn(8, 5)
    base = model_contrastive(z, zg, zp, 1.0)
    assert float(base) > 0
    assert float(model_contrastive(zg, zg, zp, 1.0)) < float(base)
    assert math.isfinite(float(model_contrastive(torch.zeros(8, 5), zg, zp, 1.0)))


def test_previous_models_change_only_for_sampled_clients_and_equal_their_uploads(make_config, digits):
    sim = Simulation(make_config(algorithm="moon", rounds=2), digits)
    for rnd in (1, 2):
        before = {c: s["moon_prev"].clone() for c, s in sim.state.client_states.items() if "moon_prev" in s}
        selected = sim.server_runtime.select_clients(rnd)
        info = sim.round_info(rnd)
        uploads = {}
        for cid in selected:
            msg = sim.server_runtime.broadcast(info, cid)
            store = sim.server_runtime.client_store
            state = store.load(cid)
            uploads[cid] = sim.client_runtime.update(cid, info, msg, state)
            store.save(cid, state, rnd)
        sim.server_runtime.complete_round(info, uploads, 0, 0, 0.0)
        for c, prev in before.items():
            if c not in selected:
                assert torch.equal(sim.state.client_states[c]["moon_prev"], prev)
        for c in selected:
            assert torch.equal(sim.state.client_states[c]["moon_prev"], uploads[c]["weights"])


def test_moon_resumes_exactly_and_learns(digits, tmp_path):
    assert_resume_is_exact(digits, tmp_path, "moon", client_keys=("moon_prev",))
    assert_learns(digits, "moon")
