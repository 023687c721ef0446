"""FedAvg / FedAvgM invariants from spec/fedavg.md §7, hand-checked cases and equivalences."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_rounds

from fedistill.algorithms.aggregate import ServerMomentum, aggregation_weights, weighted_mean
from fedistill.algorithms.base import Message
from fedistill.engine.seeding import INIT
from fedistill.simulation import Simulation, build_model_for
from fedistill.models.flat import get_flat, num_flat, set_flat


def test_weights_sum_to_one_and_follow_sample_counts():
    p = aggregation_weights([10, 30, 60])
    assert math.isclose(float(p.sum()), 1.0, abs_tol=1e-12)
    assert torch.allclose(p, torch.tensor([0.1, 0.3, 0.6], dtype=torch.float64))
    assert torch.equal(aggregation_weights([7, 7, 7]), aggregation_weights([7, 7, 7], "uniform"))


def test_client_without_data_is_excluded_and_rest_renormalised():
    p = aggregation_weights([0, 5, 15])
    assert p[0] == 0 and torch.allclose(p[1:], torch.tensor([0.25, 0.75], dtype=torch.float64))
    assert aggregation_weights([0, 4, 4], "uniform").tolist() == [0.0, 0.5, 0.5]


def test_identical_client_vectors_aggregate_to_themselves():
    v = torch.randn(1000)
    out = weighted_mean([v, v.clone(), v.clone()], aggregation_weights([3, 5, 11]))
    assert torch.allclose(out, v, rtol=1e-7, atol=1e-7)


def test_aggregation_is_linear_in_client_updates():
    g = torch.randn(500)
    clients = [g + 0.01 * torch.randn(500) for _ in range(4)]
    p = aggregation_weights([5, 10, 20, 40])
    direct = weighted_mean(clients, p)
    via_deltas = g - sum(float(pk) * (g - wk) for pk, wk in zip(p, clients))
    assert torch.allclose(direct, via_deltas, atol=1e-6)


def test_server_momentum_hand_computed():
    opt, state = ServerMomentum(momentum=0.5), {}
    g0 = torch.tensor([1.0, 2.0])
    g1 = opt.step(state, g0, torch.tensor([0.0, 1.0]))  # Δ1 = [1, 1], m1 = Δ1
    assert torch.equal(g1, torch.tensor([0.0, 1.0]))
    g2 = opt.step(state, g1, torch.tensor([-1.0, 1.0]))  # Δ2 = [1, 0], m2 = 0.5*[1,1] + [1,0]
    assert torch.allclose(g2, torch.tensor([-1.5, 0.5]))


def test_fedavgm_with_zero_momentum_is_fedavg_bit_for_bit(make_config, digits):
    cfg_m = make_config(**{"algorithm.name": "fedavgm", "algorithm.server_momentum": 0.0})
    assert_same_rounds(make_config(algorithm="fedavg"), cfg_m, digits, rounds=3)


def test_fedavgm_round_one_equals_fedavg_and_round_two_differs_by_beta_delta(make_config, digits):
    beta = 0.7
    cfg = make_config(**{"algorithm.name": "fedavgm", "algorithm.server_momentum": beta})
    sim = Simulation(cfg, digits)
    w0 = get_flat(sim.server.model)
    ref = Simulation(make_config(algorithm="fedavg"), digits)
    sim.run_round(1)
    ref.run_round(1)
    w1 = get_flat(sim.server.model)
    assert torch.equal(w1, get_flat(ref.server.model))
    delta1 = w0.double() - w1.double()
    # Round 2 from the same global model: FedAvgM's new model = FedAvg's aggregate - β Δ1.
    set_flat(ref.server.model, w1)
    sim.run_round(2)
    ref.run_round(2)
    expected = get_flat(ref.server.model).double() - beta * delta1
    assert torch.allclose(get_flat(sim.server.model).double(), expected, atol=1e-6)
    assert not torch.equal(get_flat(sim.server.model), get_flat(ref.server.model))


def test_zero_learning_rate_or_zero_epochs_leaves_global_model_unchanged(make_config, digits):
    for override in ({"local.lr": 0.0}, {"local.epochs": 0}):
        sim = Simulation(make_config(**override), digits)
        before = get_flat(sim.server.model)
        sim.run_round(1)
        assert torch.allclose(get_flat(sim.server.model), before, atol=1e-7)


def test_number_of_local_steps_is_epochs_times_batches(make_config, digits, monkeypatch):
    from fedistill.algorithms import local as local_mod

    cfg = make_config(**{"local.epochs": 3, "local.batch_size": 7})
    sim = Simulation(cfg, digits)
    seen = {}
    real = local_mod.local_sgd

    def spy(client, **kw):
        result = real(client, **kw)
        seen[client.cid] = (result.steps, client.num_samples)
        return result

    monkeypatch.setattr("fedistill.algorithms.fedavg.local_sgd", spy)
    sim.run_round(1)
    assert seen
    for steps, n in seen.values():
        assert steps == 3 * math.ceil(n / 7)


def test_learning_rate_decays_once_per_round(make_config, digits):
    sim = Simulation(make_config(**{"local.lr": 0.1, "local.lr_decay": 0.9}), digits)
    assert sim.round_info(1).lr == 0.1
    assert math.isclose(sim.round_info(5).lr, 0.1 * 0.9**4)


def test_bytes_per_round_are_counted_from_messages(make_config, digits):
    cfg = make_config()
    sim = Simulation(cfg, digits)
    row = sim.run_round(1)
    model_bytes = 4 * num_flat(sim.server.model)
    m = cfg.clients_per_round
    assert row["bytes_down"] == m * model_bytes
    # uplink: the model plus two 8-byte scalars (n_k and the train loss reported as a metric)
    assert row["bytes_up"] == m * (model_bytes + 16)


def test_one_client_one_full_batch_step_equals_centralised_sgd(make_config, digits):
    cfg = make_config(
        **{
            "partition.num_clients": 1,
            "partition.scheme": "iid",
            "clients_per_round": 1,
            "local.epochs": 1,
            "local.batch_size": 10_000,
            "local.lr": 0.1,
            "local.momentum": 0.9,
            "local.weight_decay": 1e-3,
            "run.channels_last": False,
        }
    )
    sim = Simulation(cfg, digits)
    model = build_model_for(cfg, digits, (INIT,))
    assert torch.equal(get_flat(model), get_flat(sim.server.model))
    x = sim.pipeline.normalise(digits.train_x)
    loss = F.cross_entropy(model(x), digits.train_y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= 0.1 * (g + 1e-3 * p)  # first momentum step: buf = g
    sim.run_round(1)
    assert torch.allclose(get_flat(sim.server.model), get_flat(model), atol=1e-6)


def test_message_rejects_nested_values_and_counts_bytes():
    msg = Message(w=torch.zeros(10), n=3, name="ab")
    assert msg.nbytes() == 40 + 8 + 2
    with pytest.raises(TypeError):
        Message(bad={"a": 1})
