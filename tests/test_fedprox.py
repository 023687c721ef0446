"""FedProx invariants from spec/fedprox.md §7."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_learns, assert_same_rounds, global_vectors

from fedistill.algorithms.base import Message
from fedistill.simulation import Simulation
from fedistill.losses import proximal_term
from fedistill.models.flat import get_flat


def test_fedprox_with_mu_zero_is_fedavg_step_for_step(make_config, digits):
    assert_same_rounds(make_config(algorithm="fedavg"), make_config(**{"algorithm.name": "fedprox", "algorithm.mu": 0.0}), digits)


def test_proximal_term_is_zero_at_the_anchor_and_its_gradient_is_mu_times_the_drift():
    w = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
    anchors = [t.detach().clone() for t in w]
    at_anchor = proximal_term(w, anchors, 0.7)
    assert float(at_anchor.detach()) == 0.0
    grads = torch.autograd.grad(at_anchor, w)
    assert all(float(g.abs().max()) == 0.0 for g in grads)
    with torch.no_grad():
        for t in w:
            t.add_(torch.randn_like(t))
    grads = torch.autograd.grad(proximal_term(w, anchors, 0.7), w)
    for g, t, a in zip(grads, w, anchors):
        assert torch.allclose(g, 0.7 * (t.detach() - a), atol=1e-6)


def test_prox_gradient_adds_mu_drift_to_the_ce_gradient_on_a_batch():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    anchors = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    ce = F.cross_entropy(model(x), y)
    g_ce = torch.autograd.grad(ce, list(model.parameters()))
    total = F.cross_entropy(model(x), y) + proximal_term(list(model.parameters()), anchors, 0.5)
    g_total = torch.autograd.grad(total, list(model.parameters()))
    for gt, gc, p, a in zip(g_total, g_ce, model.parameters(), anchors):
        assert torch.allclose(gt - gc, 0.5 * (p.detach() - a), atol=1e-6)


def test_quadratic_toy_fixed_point():
    """Minimising 0.5||w - a||^2 + (mu/2)||w - w0||^2 by GD converges to (a + mu w0) / (1 + mu)."""
    a, w0, mu = torch.tensor([2.0, -1.0]), torch.tensor([0.0, 3.0]), 0.5
    w = w0.clone().requires_grad_(True)
    step = w0 - 0.1 * (w0 - a)  # first step: the prox gradient is 0 at the anchor
    for i in range(400):
        loss = 0.5 * (w - a).pow(2).sum() + proximal_term([w], [w0], mu)
        (g,) = torch.autograd.grad(loss, [w])
        with torch.no_grad():
            w -= 0.1 * g
        if i == 0:
            assert torch.allclose(w.detach(), step)
    assert torch.allclose(w.detach(), (a + mu * w0) / (1 + mu), atol=1e-5)


def test_larger_mu_keeps_clients_closer_to_the_global_model(make_config, digits):
    drifts = []
    for mu in (0.0, 1.0, 10.0):
        cfg = make_config(**{"algorithm.name": "fedprox", "algorithm.mu": mu, "local.epochs": 2})
        sim = Simulation(cfg, digits)
        start = get_flat(sim.server.model)
        info = sim.round_info(1)
        msg = sim.server_runtime.broadcast(info, 0)
        reply = sim.client_runtime.update(0, info, msg, {})
        assert torch.equal(msg["weights"], start)  # the broadcast (and hence the anchor) is untouched
        drifts.append(float((reply["weights"] - start).norm()))
    assert drifts[0] > drifts[1] > drifts[2]


def test_fedprox_learns_on_label_skewed_digits(digits):
    assert_learns(digits, "fedprox")


def test_negative_mu_is_rejected(make_config):
    from fedistill.errors import ConfigError

    with pytest.raises(ConfigError, match="algorithm.mu"):
        make_config(**{"algorithm.name": "fedprox", "algorithm.mu": -1})


# -- implementation="grad_hook" (card §3 "Numerics", §7) ----------------------------------------------
def test_grad_hook_and_loss_term_give_the_same_weights_after_a_round(make_config, digits):
    """Card §7: adding μ(w − w_anchor) to .grad before the step equals the loss term (up to float rounding)."""
    settings = {"algorithm.name": "fedprox", "algorithm.mu": 1.0, "local.epochs": 2, "rounds": 2}
    by_loss = global_vectors(make_config(**settings), digits, 2)
    by_hook = global_vectors(make_config(**{**settings, "algorithm.implementation": "grad_hook"}), digits, 2)
    plain = global_vectors(make_config(**{**settings, "algorithm.mu": 0.0}), digits, 2)
    for a, b, c in zip(by_loss, by_hook, plain):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        assert float((a - c).abs().max()) > 1e-3  # μ = 1 moves the weights well beyond that tolerance


def test_grad_hook_adds_exactly_mu_times_the_drift_and_no_loss_term(make_config, digits):
    from fedistill.algorithms.fedprox import FedProx

    algo = FedProx(FedProx.Params(mu=0.3, implementation="grad_hook"), make_config().local)
    sim = Simulation(make_config(), digits)
    ctx = sim.client_runtime.context(0, 1, {})
    assert algo.extra_loss(ctx, Message()) is None
    hook = algo.grad_correction(ctx, Message())
    anchors = [p.detach().clone() for p in ctx.model.parameters()]
    with torch.no_grad():
        for p in ctx.model.parameters():
            p.add_(torch.randn_like(p))
            p.grad = torch.ones_like(p)
    hook(ctx.model)
    for p, a in zip(ctx.model.parameters(), anchors):
        assert torch.allclose(p.grad, 1 + 0.3 * (p.detach() - a), atol=1e-6)
    assert FedProx(FedProx.Params(mu=0.3), make_config().local).grad_correction(ctx, Message()) is None
