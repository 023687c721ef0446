"""FedNova invariants from spec/fednova.md §7."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_learns, assert_resume_is_exact

from fedistill.algorithms.base import Message
from fedistill.algorithms.fednova import FedNova, nova_normaliser  # = local.effective_local_steps
from fedistill.config import LocalConfig
from fedistill.simulation import Simulation
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


# -- ccvr="fedntd_quirk" (card §3 "Optional variant", ambiguity 1) ---------------------------------------
def _quirk_config(make_config, **extra):
    return make_config(**{"algorithm.name": "fednova", "algorithm.ccvr": "fedntd_quirk", **extra})


def _round_by_hand(sim, rnd):
    """One round through the runtimes, keeping the broadcasts and replies (the engine's loop, unrolled)."""
    info = sim.round_info(rnd)
    store = sim.server_runtime.client_store
    msgs, replies = {}, {}
    for cid in sim.server_runtime.select_clients(rnd):
        msgs[cid] = sim.server_runtime.broadcast(info, cid)
        state = store.load(cid)
        replies[cid] = sim.client_runtime.update(cid, info, msgs[cid], state)
        store.save(cid, state, rnd)
    sim.server_runtime.complete_round(info, replies, 0, 0, 0.0)
    return info, msgs, replies


def test_ccvr_is_off_by_default_and_rejects_unknown_values(make_config):
    from fedistill.errors import ConfigError

    assert FedNova.Params().ccvr == "none"
    with pytest.raises(ConfigError, match="algorithm.ccvr"):
        make_config(**{"algorithm.name": "fednova", "algorithm.ccvr": "on"})


def test_ccvr_quirk_round_one_is_plain_fednova_and_stores_d_k(make_config, digits):
    """First participation: zero shift, so round 1 is bit-identical; then d_k = (w_g − w_k)/(η a_k)."""
    from conftest import global_vectors

    plain = global_vectors(make_config(algorithm="fednova"), digits, 1)
    sim = Simulation(_quirk_config(make_config), digits)
    info, msgs, replies = _round_by_hand(sim, 1)
    assert torch.equal(get_flat(sim.server.model), plain[0])
    momentum, batch = sim.cfg.local.momentum, sim.cfg.local.batch_size
    for cid, reply in replies.items():
        n = sim.federation.train_indices[cid].numel()
        steps = sim.cfg.local.epochs * -(-n // batch)
        a = sum((1 - momentum**s) / (1 - momentum) for s in range(1, steps + 1))  # card §3, by hand
        # digits_cnn has no buffers: the flat vector is exactly the trainable parameters
        expected = (msgs[cid]["weights"].double() - reply["weights"].double()) / (info.lr * a)
        stored = sim.state.client_states[cid]["fednova_d"]
        assert stored.dtype == torch.float32
        assert torch.allclose(stored.double(), expected, rtol=1e-5, atol=1e-7)


def test_ccvr_quirk_subtracts_the_previous_d_from_every_gradient(make_config, digits):
    """A returning client's local training equals SGD on (∇CE − d_k^prev), written out independently here."""
    from fedistill.engine.seeding import INIT
    from fedistill.simulation import build_model_for
    from fedistill.models.flat import set_flat

    cfg = _quirk_config(make_config)
    sim = Simulation(cfg, digits)
    _round_by_hand(sim, 1)
    rnd = 2
    info = sim.round_info(rnd)
    returning = [c for c in sim.server_runtime.select_clients(rnd) if c in sim.state.client_states]
    assert returning, "pick a seed where some client of round 1 comes back in round 2"
    cid = returning[0]
    state = sim.server_runtime.client_store.load(cid)
    d_prev = state["fednova_d"].clone()
    assert float(d_prev.abs().max()) > 0
    msg = sim.server_runtime.broadcast(info, cid)
    ctx = sim.client_runtime.context(cid, rnd, {})  # the same (seed, round, client) stream as the update
    reply = sim.client_runtime.update(cid, info, msg, state)

    model = build_model_for(cfg, digits, (INIT,))
    set_flat(model, msg["weights"])
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=info.lr, momentum=cfg.local.momentum, weight_decay=cfg.local.weight_decay)
    shifts = [d.view_as(p) for d, p in zip(d_prev.split([p.numel() for p in params]), params)]
    for _ in range(cfg.local.epochs):
        for x, y in ctx.data.epoch_batches(ctx.train_indices, cfg.local.batch_size, ctx.generator):
            grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
            for p, g, d in zip(params, grads, shifts):
                p.grad = g - d
            opt.step()
    assert torch.allclose(reply["weights"], get_flat(model), atol=1e-5)
    # and the shift mattered: without it the client ends elsewhere
    plain = Simulation(make_config(algorithm="fednova"), digits)
    plain_reply = plain.client_runtime.update(cid, info, msg, {})
    assert float((plain_reply["weights"] - reply["weights"]).abs().max()) > 1e-4


def test_ccvr_quirk_resumes_exactly_with_its_client_state(digits, tmp_path):
    quirk = {"algorithm.ccvr": "fedntd_quirk"}
    assert_resume_is_exact(digits, tmp_path, "fednova", client_keys=("fednova_d",), **quirk)
