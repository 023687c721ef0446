"""FedNova invariants from spec/fednova.md §7."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_learns

from fedistill.algorithms.base import Message
from fedistill.algorithms.fednova import FedNova, nova_normaliser  # = local.effective_local_steps
from fedistill.config import LocalConfig
from fedistill.engine.simulation import Simulation
from fedistill.models.flat import get_flat


def test_normaliser_hand_values_and_closed_form_matches_the_accumulator():
    assert nova_normaliser(1, 0.9) == pytest.approx(1.0)
    assert nova_normaliser(2, 0.9) == pytest.approx(2.9)
    assert nova_normaliser(7, 0.0) == 7.0
    for rho in (0.5, 0.9, 0.99):
        cnt = acc = 0.0
        previous = 0.0
        for tau in range(1, 1001):
            cnt = rho * cnt + 1
            acc += cnt
            a = nova_normaliser(tau, rho)
            assert math.isclose(a, acc, rel_tol=1e-9)
            assert tau <= a + 1e-9 and a <= tau / (1 - rho) + 1e-9 and a > previous
            previous = a


def _equal_steps_config(make_config, momentum, algorithm):
    # iid over 6 clients of 1,500 digits: 250 samples each, so every client takes the same number of steps.
    return make_config(
        rounds=2,
        **{"algorithm.name": algorithm, "partition.scheme": "iid", "local.momentum": momentum, "local.batch_size": 25},
    )


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_equal_local_steps_make_fednova_fedavg(make_config, digits, momentum):
    results = []
    for algorithm in ("fedavg", "fednova"):
        sim = Simulation(_equal_steps_config(make_config, momentum, algorithm), digits)
        assert len({int(ix.numel()) for ix in sim.federation.train_indices}) == 1
        sim.run()
        results.append(get_flat(sim.server.model))
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_doubling_a_clients_steps_does_not_double_its_pull():
    """Two clients with the same update direction; client 1 takes twice the steps (and moves twice as far)."""
    algo = FedNova(FedNova.Params(), LocalConfig(momentum=0.0))
    g = torch.zeros(4)
    direction = torch.tensor([1.0, 0.0, 0.0, 0.0])
    other = torch.tensor([0.0, 1.0, 0.0, 0.0])

    def reply(w, steps):
        return Message(weights=g - w, num_samples=10, local_steps=steps)

    base = algo.combine(g, [reply(direction, 10), reply(other, 10)])
    doubled = algo.combine(g, [reply(2 * direction, 20), reply(other, 10)])
    # FedAvg would double client 0's share of the step; FedNova keeps the per-step directions equal and
    # only grows the overall scale through tau_eff (10 -> 15).
    assert torch.allclose(base, torch.tensor([-0.5, -0.5, 0.0, 0.0]))
    assert torch.allclose(doubled, torch.tensor([-0.75, -0.75, 0.0, 0.0]))


def test_clients_without_steps_are_skipped():
    algo = FedNova(FedNova.Params(), LocalConfig(momentum=0.9))
    g = torch.ones(3)
    out = algo.combine(g, [Message(weights=torch.zeros(3), num_samples=5, local_steps=0)])
    assert torch.equal(out, g)


def test_fednova_reports_steps_and_learns(make_config, digits):
    sim = Simulation(make_config(algorithm="fednova"), digits)
    row = sim.run_round(1)
    # uplink = weights + num_samples + train_loss + local_steps
    assert row["bytes_up"] == sim.cfg.clients_per_round * (4 * get_flat(sim.server.model).numel() + 24)
    assert_learns(digits, "fednova")
