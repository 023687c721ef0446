"""SCAFFOLD invariants from spec/scaffold.md §7."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_learns, assert_resume_is_exact

from fedistill.models.flat import flat_parameters
from fedistill.simulation import Simulation
from fedistill.models.flat import get_flat


def test_round_one_equals_fedavg_for_any_epochs_and_momentum(make_config, digits):
    """With c = c_k = 0 the correction is zero, so round 1 is FedAvg's round 1 bit for bit."""
    for override in ({"local.epochs": 1, "local.momentum": 0.0}, {"local.epochs": 2, "local.momentum": 0.9}):
        a = Simulation(make_config(algorithm="fedavg", **override), digits)
        b = Simulation(make_config(algorithm="scaffold", **override), digits)
        a.run_round(1)
        b.run_round(1)
        assert torch.equal(get_flat(a.server.model), get_flat(b.server.model))


def test_one_full_batch_step_sets_the_client_variate_to_that_gradient(make_config, digits):
    cfg = make_config(
        algorithm="scaffold",
        **{"local.epochs": 1, "local.batch_size": 10_000, "local.momentum": 0.0, "local.weight_decay": 0.0,
           "local.lr": 0.1, "run.channels_last": False},
    )
    sim = Simulation(cfg, digits)
    info = sim.round_info(1)
    msg = sim.server_runtime.broadcast(info, 2)
    state: dict = {}
    model = sim.client_runtime.worker
    from fedistill.models.flat import set_flat

    set_flat(model, msg["weights"])
    idx = sim.federation.train_indices[2]
    x = sim.pipeline.normalise(digits.train_x[idx])
    loss = F.cross_entropy(model(x), digits.train_y[idx])
    grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])
    reply = sim.client_runtime.update(2, info, msg, state)
    assert torch.allclose(state["scaffold_c"], grad, atol=1e-5)
    assert torch.allclose(reply["control_delta"], grad, atol=1e-5)  # c_k was 0


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_server_variate_is_the_mean_of_all_client_variates_and_others_are_untouched(make_config, digits, state_dtype):
    """Card §7, also when the clients' states are stored in bf16: Δc_k is then formed from the rounded c_k the
    client keeps (forming it from the unrounded one let c drift from the mean by 2e-4 in 4 rounds)."""
    sim = Simulation(make_config(algorithm="scaffold", rounds=3, **{"run.client_state_dtype": state_dtype}), digits)
    k = sim.federation.num_clients
    for rnd in (1, 2, 3):
        before = {cid: s["scaffold_c"].clone() for cid, s in sim.state.client_states.items() if "scaffold_c" in s}
        selected = set(sim.server_runtime.select_clients(rnd))
        sim.run_round(rnd)
        for cid, c in before.items():
            if cid not in selected:
                assert torch.equal(sim.state.client_states[cid]["scaffold_c"], c)
        all_c = [s["scaffold_c"].double() for s in sim.state.client_states.values() if "scaffold_c" in s]
        mean = sum(all_c) / k
        assert torch.allclose(sim.server.state["scaffold_c"].double(), mean, atol=1e-6)


def test_control_variates_travel_both_ways_in_the_byte_count(make_config, digits):
    sim = Simulation(make_config(algorithm="scaffold"), digits)
    row = sim.run_round(1)
    w = 4 * get_flat(sim.server.model).numel()
    c = 4 * flat_parameters(sim.server.model).numel()
    m = sim.cfg.clients_per_round
    assert row["bytes_down"] == m * (w + c)
    assert row["bytes_up"] == m * (w + c + 16)


def test_resume_equals_uninterrupted(digits, tmp_path):
    assert_resume_is_exact(digits, tmp_path, "scaffold", server_keys=("scaffold_c",), client_keys=("scaffold_c",))


def test_scaffold_learns_on_label_skewed_digits(digits):
    assert_learns(digits, "scaffold")


def test_client_variate_is_kept_on_the_host_whatever_the_training_device():
    """c_k is combined with the message's host tensors (the control c, the broadcast weights): created on an
    accelerator it made the first local update fail there. ``meta`` stands in for an accelerator."""
    from test_independent_expectations import Linear, hand_client, method

    algo = method("scaffold")
    client = hand_client([((1.0,), 0)], 2, Linear(1, 2))
    client.device = torch.device("meta")
    algo.grad_correction(client, {"control": torch.zeros(2), "weights": torch.zeros(2)})
    assert client.state["scaffold_c"].device.type == "cpu"
