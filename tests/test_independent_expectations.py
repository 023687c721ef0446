"""Expected values computed independently of the code under test (issue 9, "Tests that catch wrong math").

Every parameter-averaging method gets at least one test whose expectation is worked out here, by hand on a
tiny model or from its card's formula written out with plain torch ops, never by calling the function that
is being checked. The models are as small as a classifier can be:

* ``Linear(1, 2)``: ``z = (w0 x, w1 x)``, two parameters. Its CE gradient is
  ``∂CE/∂w_c = (p_c − [c = y]) x`` with ``p_0 = σ((w0 − w1) x)``, written in :func:`ce_grad2`, so local SGD,
  the proximal, dynamic, curvature and control-variate terms and the server rules are checked in plain
  Python floats;
* ``Linear(2, 4)`` (and a two-layer linear net for MOON) for the distillation and logit methods, whose
  objectives are written out below and differentiated by autograd *on the written-out objective*.

Data go through the library's real pipeline (``Dataset`` + ``TensorPipeline``; mean 0, std 1, so a pixel
``p`` becomes ``p / 255``), wrapped in :class:`Recorder`, which keeps the batches the code consumed so that
the reference replays exactly those batches whatever the shuffle.

Planted bugs each test was checked to catch are listed in the docstrings ("Catches").
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import small_config
from torch import nn

from fedistill import losses
from fedistill.algorithms.base import ClientContext, Message, RoundInfo, ServerContext
from fedistill.algorithms.build import make_algorithm
from fedistill.algorithms.fedcurv import fisher_diagonal
from fedistill.data.dataset import Dataset
from fedistill.data.pipeline import TensorPipeline
from fedistill.models.flat import get_flat, set_flat

# Pixels and the inputs they become (mean 0, std 1: x = p / 255).
P1, P06, P02 = 255, 153, 51
X1, X06, X02 = 1.0, 0.6, 0.2


# -- tiny models, data and contexts ------------------------------------------------------------------
class Linear(nn.Module):
    """``z = W x`` over the flattened image, no bias: ``W`` (C×d) is the whole flat vector, row-major."""

    def __init__(self, d: int, c: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(d, c, bias=False)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)

    def classify(self, h: torch.Tensor) -> torch.Tensor:
        return self.classifier(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.extract(x))


class TwoLayer(nn.Module):
    """``z = W (A x)``: features ``A x`` that depend on the weights (MOON). Flat vector: A then W."""

    def __init__(self, d: int, c: int) -> None:
        super().__init__()
        self.body = nn.Linear(d, d, bias=False)
        self.classifier = nn.Linear(d, c, bias=False)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.flatten(1))

    def classify(self, h: torch.Tensor) -> torch.Tensor:
        return self.classifier(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.extract(x))


class Recorder:
    """The library's TensorPipeline, keeping a copy of every batch it hands out."""

    def __init__(self, dataset: Dataset) -> None:
        self.pipeline = TensorPipeline(dataset)
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __getattr__(self, name):  # dataset, num_classes, ... come from the real pipeline
        if name == "pipeline":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.pipeline, name)

    def epoch_batches(self, indices, batch_size, generator):
        for x, y in self.pipeline.epoch_batches(indices, batch_size, generator):
            self.batches.append((x.clone(), y.clone()))
            yield x, y


def hand_dataset(samples, num_classes: int) -> Dataset:
    """``samples``: ``[(pixels, label), ...]``; one-row images of ``len(pixels)`` pixels."""
    x = torch.tensor([list(p) for p, _ in samples], dtype=torch.uint8).view(len(samples), 1, 1, -1)
    y = torch.tensor([label for _, label in samples], dtype=torch.int64)
    return Dataset("hand", x, y, x.clone(), y.clone(), num_classes, (0.0,), (1.0,))


def hand_client(samples, num_classes, model, cid=0, state=None, rnd=1, initial=None) -> ClientContext:
    return ClientContext(
        cid=cid,
        train_indices=torch.arange(len(samples)),
        data=Recorder(hand_dataset(samples, num_classes)),
        model=model,
        generator=torch.Generator().manual_seed(1000 * rnd + cid),
        state={} if state is None else state,
        initial_weights=initial,
        round=rnd,
    )


def method(name, *, epochs=1, batch_size=1, momentum=0.0, weight_decay=0.0, **params):
    """The configured algorithm, built as the engine builds it; every local setting explicit."""
    settings = {
        "algorithm.name": name,
        "local.epochs": epochs,
        "local.batch_size": batch_size,
        "local.momentum": momentum,
        "local.weight_decay": weight_decay,
        **{f"algorithm.{k}": v for k, v in params.items()},
    }
    return make_algorithm(small_config(**settings))


def hand_server(algorithm, model, weights, num_clients, num_classes=2) -> ServerContext:
    set_flat(model, torch.tensor(weights, dtype=torch.float32))
    server = ServerContext(model, {}, torch.Generator().manual_seed(0), num_classes, num_clients=num_clients)
    algorithm.init_server(server)
    return server


def run_round(server_algorithm, client_algorithm, server, clients, info):
    """Broadcast, local updates, aggregation (the engine's round without the engine)."""
    replies = {}
    for ctx in clients:
        replies[ctx.cid] = client_algorithm.local_update(ctx, info, server_algorithm.broadcast(server, info, ctx.cid))
    server_algorithm.aggregate(server, info, replies)
    return replies


def upload(weights, num_samples) -> Message:
    """A client's reply as the server receives it: weights and sample count."""
    return Message(weights=torch.tensor(weights), num_samples=num_samples)


def vec(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def assert_close(actual: torch.Tensor, expected, atol=1e-6, what=""):
    expected = expected if isinstance(expected, torch.Tensor) else vec(expected)
    actual = actual.detach().double().reshape(-1)
    assert torch.allclose(actual, expected.double().reshape(-1), rtol=0.0, atol=atol), (
        f"{what}: got {actual.tolist()}, expected {expected.reshape(-1).tolist()}"
    )


# -- the 2-parameter model by hand -------------------------------------------------------------------
def sigmoid(t: float) -> float:
    return 1.0 / (1.0 + math.exp(-t))


def ce_grad2(w, x: float, y: int) -> list[float]:
    """``∇_w CE`` for ``z = (w0 x, w1 x)``: ``(p_c − [c = y]) x`` with ``p_0 = σ((w0 − w1) x)``."""
    p0 = sigmoid((w[0] - w[1]) * x)
    p = (p0, 1.0 - p0)
    return [(p[c] - (1.0 if c == y else 0.0)) * x for c in (0, 1)]


def sgd2(w, x, y, steps, lr, momentum=0.0, wd=0.0, extra=None) -> list[float]:
    """fedavg.md §3 on one repeated sample: ``d = ∇CE + extra(w) + λ_wd w``; ``buf = d`` then ``ρ buf + d``;
    ``w ← w − η buf``. ``extra`` is the gradient of a method's added term."""
    w, buf = list(w), None
    for _ in range(steps):
        g = ce_grad2(w, x, y)
        e = extra(w) if extra is not None else (0.0, 0.0)
        d = [g[i] + e[i] + wd * w[i] for i in range(2)]
        buf = d if buf is None else [momentum * b + di for b, di in zip(buf, d)]
        w = [wi - lr * bi for wi, bi in zip(w, buf)]
    return w


def combo(*terms) -> list[float]:
    """``Σ coef · vector`` for ``(coef, vector)`` pairs of 2-vectors."""
    return [sum(c * v[i] for c, v in terms) for i in range(2)]


# -- FedAvg ------------------------------------------------------------------------------------------
def test_fedavg_round_is_the_sample_weighted_mean_of_momentum_sgd_by_hand():
    """Two clients (n = 1 and 3, B = 1: 1 and 3 steps), momentum 0.9, weight decay 0.1, lr 0.5.

    Client 0's one step by hand from w = (0.2, −0.1), x = 1, y = 0: p_0 = σ(0.3) = 0.5744425,
    d = (p_0 − 1, 1 − p_0) + 0.1·w = (−0.4055575, 0.4155575), w ← w − 0.5 d = (0.4027787, −0.3077787).
    Global: p = (1/4, 3/4). Catches: wrong p_k, decoupled/missing weight decay, dampened or missing momentum.
    """
    local = dict(momentum=0.9, weight_decay=0.1)
    algo_s, algo_c = method("fedavg", **local), method("fedavg", **local)
    w_g = [0.2, -0.1]
    server = hand_server(algo_s, Linear(1, 2), w_g, num_clients=6)
    worker = Linear(1, 2)
    c0 = hand_client([((P1,), 0)], 2, worker, cid=0)
    c1 = hand_client([((P06,), 1)] * 3, 2, worker, cid=1)
    replies = run_round(algo_s, algo_c, server, [c0, c1], RoundInfo(1, 0.5))

    assert_close(replies[0]["weights"], [0.4027787, -0.3077787], atol=1e-6, what="client 0 after one step")
    w0 = sgd2(w_g, X1, 0, steps=1, lr=0.5, momentum=0.9, wd=0.1)
    w1 = sgd2(w_g, X06, 1, steps=3, lr=0.5, momentum=0.9, wd=0.1)
    assert_close(replies[1]["weights"], w1, what="client 1 after three momentum steps")
    assert (replies[0]["num_samples"], replies[1]["num_samples"]) == (1, 3)
    assert_close(get_flat(server.model), combo((0.25, w0), (0.75, w1)), what="global model")


# -- FedAvgM -----------------------------------------------------------------------------------------
def test_fedavgm_momentum_over_two_rounds_by_hand():
    """β = 0.9, η_s = 0.5, w_g = (1, 2).

    Round 1: w_agg = ¼(0, 1) + ¾(2, 1) = (1.5, 1); Δ1 = w_g − w_agg = (−0.5, 1); m1 = Δ1; w_g ← (1.25, 1.5).
    Round 2: w_agg = ½(1, 1) + ½(2, 0) = (1.5, 0.5); Δ2 = (−0.25, 1); m2 = 0.9 m1 + Δ2 = (−0.7, 1.9);
    w_g ← (1.25, 1.5) − 0.5 m2 = (1.6, 0.55).
    Catches: Δ with the wrong sign, dampening (1 − β), η_s ignored, momentum not carried to round 2.
    """
    algo = method("fedavgm", server_momentum=0.9, server_lr=0.5)
    server = hand_server(algo, Linear(1, 2), [1.0, 2.0], num_clients=4)
    algo.aggregate(server, RoundInfo(1, 0.1), {0: upload([0.0, 1.0], 1), 1: upload([2.0, 1.0], 3)})
    assert_close(get_flat(server.model), [1.25, 1.5], what="round 1")
    algo.aggregate(server, RoundInfo(2, 0.1), {0: upload([1.0, 1.0], 1), 1: upload([2.0, 0.0], 1)})
    assert_close(get_flat(server.model), [1.6, 0.55], what="round 2")


# -- FedAdam -----------------------------------------------------------------------------------------
def test_fedadam_server_steps_on_hand_made_aggregates():
    """fmtl-baselines.md §2, η = 0.1, β1 = 0.9, β2 = 0.99, τ = 1e-3, w_g = (1, 2), no bias correction.

    Round 1: Δ = (1.1, 1.8) − (1, 2) = (0.1, −0.2); m = 0.1 Δ = (0.01, −0.02); v = 0.01 Δ² = (1e-4, 4e-4);
    w_g ← w_g + 0.1 m / (√v + τ) = (1 + 0.001/0.011, 2 − 0.002/0.021) = (1.0909091, 1.9047619).
    Round 2 from a two-client aggregate ¼(1.2, 1.9) + ¾(1.0, 1.9) = (1.05, 1.9), the moments carried over.
    Catches: Δ sign, bias correction, τ inside the root, moments reset between rounds, wrong p_k.
    """
    algo = method("fedadam", server_lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    server = hand_server(algo, Linear(1, 2), [1.0, 2.0], num_clients=4)
    algo.aggregate(server, RoundInfo(1, 0.1), {3: upload([1.1, 1.8], 7)})
    w1 = [1.0 + 0.001 / 0.011, 2.0 - 0.002 / 0.021]
    assert_close(get_flat(server.model), [1.0909091, 1.9047619], atol=2e-6, what="round 1 (hand numbers)")
    assert_close(get_flat(server.model), w1, atol=1e-6, what="round 1")

    algo.aggregate(server, RoundInfo(2, 0.1), {0: upload([1.2, 1.9], 1), 2: upload([1.0, 1.9], 3)})
    m1, v1 = [0.01, -0.02], [1e-4, 4e-4]
    delta = [1.05 - w1[0], 1.9 - w1[1]]
    m2 = [0.9 * m1[i] + 0.1 * delta[i] for i in range(2)]
    v2 = [0.99 * v1[i] + 0.01 * delta[i] ** 2 for i in range(2)]
    w2 = [w1[i] + 0.1 * m2[i] / (math.sqrt(v2[i]) + 1e-3) for i in range(2)]
    assert_close(get_flat(server.model), w2, atol=1e-5, what="round 2")


# -- FedProx -----------------------------------------------------------------------------------------
def test_proximal_term_value_by_hand():
    """(μ/2) Σ ||P − P_anchor||² with μ = 0.5, P = ((1, 2), (3,)), anchors 0: 0.25 · 14 = 3.5."""
    value = losses.proximal_term([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], [torch.zeros(2), torch.zeros(1)], 0.5)
    assert float(value) == pytest.approx(3.5)


@pytest.mark.parametrize("implementation", ["loss", "grad_hook"])
def test_fedprox_two_steps_on_a_two_parameter_model(implementation):
    """μ = 0.4, lr 0.5, x = 1, y = 0, anchor w_g = (0, 0), plain SGD.

    Step 1 (prox gradient 0): g = (−0.5, 0.5), w1 = (0.25, −0.25).
    Step 2: g = (σ(0.5) − 1, 1 − σ(0.5)) = (−0.3775407, 0.3775407), μ (w1 − anchor) = (0.1, −0.1),
    w2 = w1 − 0.5 (g + prox) = (0.3887703, −0.3887703).
    Catches: prox sign, μ/2 instead of μ in the gradient, anchor updated during the round.
    """
    algo = method("fedprox", epochs=2, mu=0.4, implementation=implementation)
    ctx = hand_client([((P1,), 0)], 2, Linear(1, 2))
    reply = algo.local_update(ctx, RoundInfo(1, 0.5), Message(weights=torch.zeros(2)))
    p0 = sigmoid(0.5)
    w2 = [0.25 - 0.5 * ((p0 - 1.0) + 0.1), -0.25 - 0.5 * ((1.0 - p0) - 0.1)]
    assert_close(reply["weights"], [0.3887703, -0.3887703], atol=1e-6, what="hand numbers")
    assert_close(reply["weights"], w2, what="formula")


# -- SCAFFOLD ----------------------------------------------------------------------------------------
def test_scaffold_one_corrected_step_and_control_variates_by_hand():
    """c = (0.1, −0.2), c_i = (0.3, 0.1), w_g = (0, 0), x = 1, y = 0, lr 0.5, one plain SGD step, N = 4.

    ĝ = g − c_i + c = (−0.5, 0.5) − (0.3, 0.1) + (0.1, −0.2) = (−0.7, 0.2); y = w_g − 0.5 ĝ = (0.35, −0.1).
    c_i⁺ = c_i − c + (w_g − y)/(K η) = (0.2, 0.3) + (−0.7, 0.2) = (−0.5, 0.5) (= g after one step);
    Δc_i = (−0.8, 0.4); server c ← c + Δc_i / N = (−0.1, −0.1); w_g ← y (one client).
    Catches: correction sign (g + c_i − c), c_i⁺ sign or divisor, 1/|S_t| instead of 1/N.
    """
    algo_s, algo_c = method("scaffold"), method("scaffold")
    server = hand_server(algo_s, Linear(1, 2), [0.0, 0.0], num_clients=4)
    server.state["scaffold_c"] = torch.tensor([0.1, -0.2])
    state = {"scaffold_c": torch.tensor([0.3, 0.1])}
    ctx = hand_client([((P1,), 0)], 2, Linear(1, 2), cid=2, state=state)
    replies = run_round(algo_s, algo_c, server, [ctx], RoundInfo(1, 0.5))
    assert_close(replies[2]["weights"], [0.35, -0.1], what="corrected step")
    assert_close(state["scaffold_c"], [-0.5, 0.5], what="c_i⁺")
    assert_close(replies[2]["control_delta"], [-0.8, 0.4], what="Δc_i")
    assert_close(server.state["scaffold_c"], [-0.1, -0.1], what="server c")
    assert_close(get_flat(server.model), [0.35, -0.1], what="global model")


def test_scaffold_momentum_steps_are_corrected_and_the_variate_divides_by_k_eff():
    """Two steps with momentum 0.9 and weight decay 0.01; the correction c − c_i = (−0.2, −0.3) enters every
    gradient before weight decay and momentum; K_eff(2, 0.9) = 1 + 1.9 = 2.9 (not 2).
    Catches: correction sign, K_eff = τ (momentum ignored), correction applied after the momentum buffer."""
    algo = method("scaffold", epochs=2, momentum=0.9, weight_decay=0.01)
    c, c_i = [0.1, -0.2], [0.3, 0.1]
    state = {"scaffold_c": torch.tensor(c_i)}
    ctx = hand_client([((P1,), 0)], 2, Linear(1, 2), state=state)
    w_g = [0.2, -0.3]
    reply = algo.local_update(ctx, RoundInfo(1, 0.5), Message(weights=torch.tensor(w_g), control=torch.tensor(c)))
    correction = (c[0] - c_i[0], c[1] - c_i[1])
    y = sgd2(w_g, X1, 0, steps=2, lr=0.5, momentum=0.9, wd=0.01, extra=lambda w: correction)
    assert_close(reply["weights"], y, what="local weights")
    k_eff = 2.9
    c_new = [c_i[i] - c[i] + (w_g[i] - y[i]) / (k_eff * 0.5) for i in range(2)]
    assert_close(state["scaffold_c"], c_new, atol=2e-6, what="c_i⁺ with K_eff = 2.9")


# -- FedNova -----------------------------------------------------------------------------------------
# a(τ, ρ) = Σ_{s=1}^{τ} (1 − ρ^s)/(1 − ρ), by hand: a(2, 0.9) = 1 + 1.9 = 2.9; a(3, 0.9) = 1 + 1.9 + 2.71 = 5.61.
A2, A3 = 2.9, 5.61


def test_fednova_aggregate_with_momentum_and_unequal_steps_by_hand():
    """w_g = (1, −1); client 0: n = 2, τ = 2, w = (0.5, −0.4); client 1: n = 3, τ = 3, w = (0.2, −0.1); ρ = 0.9.

    p = (0.4, 0.6), a = (2.9, 5.61), τ_eff = 0.4·2.9 + 0.6·5.61 = 4.526,
    w_g ← w_g − τ_eff [0.4 (0.5, −0.6)/2.9 + 0.6 (0.8, −0.9)/5.61] = (0.3006107, −0.1897767).
    (With a_k = τ_k, i.e. momentum ignored: (0.324, −0.22); plain FedAvg: (0.32, −0.22).)
    Catches: a_k computed as if ρ = 0, τ_eff from unweighted a_k, p_k not normalised.
    """
    algo = method("fednova", momentum=0.9)
    server = hand_server(algo, Linear(1, 2), [1.0, -1.0], num_clients=5)
    replies = {
        0: Message(weights=torch.tensor([0.5, -0.4]), num_samples=2, local_steps=2),
        1: Message(weights=torch.tensor([0.2, -0.1]), num_samples=3, local_steps=3),
    }
    algo.aggregate(server, RoundInfo(1, 0.5), replies)
    tau_eff = 0.4 * A2 + 0.6 * A3
    assert tau_eff == pytest.approx(4.526)
    expected = [
        1.0 - tau_eff * (0.4 * 0.5 / A2 + 0.6 * 0.8 / A3),
        -1.0 - tau_eff * (0.4 * -0.6 / A2 + 0.6 * -0.9 / A3),
    ]
    assert_close(get_flat(server.model), [0.3006107, -0.1897767], atol=1e-6, what="hand numbers")
    assert_close(get_flat(server.model), expected, what="card formula")


def test_fednova_round_with_momentum_and_unequal_local_steps():
    """End to end: client 0 holds 2 copies of (x = 1, y = 0), client 1 holds 3 copies of (x = 0.6, y = 1);
    B = 1, E = 1, so τ = 2 and 3 counted steps of momentum-0.9 SGD (by hand), then the card's aggregate with
    a = 2.9 and 5.61. Catches: a_k as if ρ = 0, a wrong step count in the reply, FedAvg's plain mean."""
    algo_s, algo_c = method("fednova", momentum=0.9), method("fednova", momentum=0.9)
    w_g = [0.1, -0.2]
    server = hand_server(algo_s, Linear(1, 2), w_g, num_clients=5)
    worker = Linear(1, 2)
    clients = [hand_client([((P1,), 0)] * 2, 2, worker, cid=0), hand_client([((P06,), 1)] * 3, 2, worker, cid=1)]
    replies = run_round(algo_s, algo_c, server, clients, RoundInfo(1, 0.5))
    assert (replies[0]["local_steps"], replies[1]["local_steps"]) == (2, 3)
    w0 = sgd2(w_g, X1, 0, steps=2, lr=0.5, momentum=0.9)
    w1 = sgd2(w_g, X06, 1, steps=3, lr=0.5, momentum=0.9)
    assert_close(replies[0]["weights"], w0, what="client 0")
    assert_close(replies[1]["weights"], w1, what="client 1")
    tau_eff = 0.4 * A2 + 0.6 * A3
    expected = [w_g[i] - tau_eff * (0.4 * (w_g[i] - w0[i]) / A2 + 0.6 * (w_g[i] - w1[i]) / A3) for i in range(2)]
    fedavg = combo((0.4, w0), (0.6, w1))
    assert max(abs(e - f) for e, f in zip(expected, fedavg)) > 1e-2  # the normalisation matters here
    assert_close(get_flat(server.model), expected, atol=2e-6, what="FedNova global model")


# -- FedDyn ------------------------------------------------------------------------------------------
def test_feddyn_first_two_rounds_by_hand():
    """feddyn.md §3 with α = 0.2, K = 3 clients in the population, clients 0 and 1 in both rounds (uniform mean),
    2 full-batch plain SGD steps each, lr 0.5.

    Client gradient: ∇CE − g_k + α (w − anchor); then g_k ← g_k − α (w_k − anchor).
    Server: h ← h − (α/K) Σ_k (w_k − anchor); w_g = mean_k w_k − h/α.
    The linear term's sign is checked directly too: at the anchor of round 2 the added terms have gradient −g_k.
    Catches: linear term with the wrong sign (in the loss or in the g_k update), α/m instead of α/K, +h/α,
    size-weighted instead of uniform mean.
    """
    alpha, lr, K = 0.2, 0.5, 3
    algo_s = method("feddyn", epochs=2, batch_size=2, alpha=alpha)
    algo_c = method("feddyn", epochs=2, batch_size=2, alpha=alpha)
    anchor = [0.3, -0.2]
    server = hand_server(algo_s, Linear(1, 2), anchor, num_clients=K)
    worker = Linear(1, 2)
    data = {0: ([((P1,), 0)], X1, 0), 1: ([((P06,), 1)] * 2, X06, 1)}  # n = 1 and 2: uniform ≠ size-weighted
    states = {0: {}, 1: {}}
    g = {0: [0.0, 0.0], 1: [0.0, 0.0]}
    h = [0.0, 0.0]
    for rnd in (1, 2):
        clients = [hand_client(data[c][0], 2, worker, cid=c, state=states[c], rnd=rnd) for c in (0, 1)]
        if rnd == 2:  # the client's added terms at the anchor: gradient exactly −g_k (here g_0 ≠ 0)
            msg = algo_s.broadcast(server, RoundInfo(2, lr), 0)
            set_flat(worker, msg["weights"])
            term = algo_c.extra_loss(clients[0], msg)
            x = torch.ones(1, 1, 1, 1)
            value = term(worker, x, torch.tensor([0]), worker(x), None)
            (grad,) = torch.autograd.grad(value, [worker.classifier.weight])
            assert max(abs(v) for v in g[0]) > 1e-3
            assert_close(grad, [-g[0][0], -g[0][1]], what="gradient of the linear + proximal terms at the anchor")
        replies = run_round(algo_s, algo_c, server, clients, RoundInfo(rnd, lr))
        w = {}
        for c in (0, 1):
            gk, a = list(g[c]), list(anchor)

            def extra(v, gk=gk, a=a):  # ∇(−⟨g_k, w⟩ + (α/2)||w − anchor||²)
                return [-gk[i] + alpha * (v[i] - a[i]) for i in range(2)]

            w[c] = sgd2(a, data[c][1], data[c][2], steps=2, lr=lr, extra=extra)
            assert_close(replies[c]["weights"], w[c], what=f"round {rnd}, client {c}")
            g[c] = [gk[i] - alpha * (w[c][i] - a[i]) for i in range(2)]
            assert_close(states[c]["feddyn_g"], g[c], what=f"round {rnd}, g_{c}")
        h = [h[i] - (alpha / K) * ((w[0][i] - anchor[i]) + (w[1][i] - anchor[i])) for i in range(2)]
        anchor = [(w[0][i] + w[1][i]) / 2 - h[i] / alpha for i in range(2)]
        assert_close(server.state["feddyn_h"], h, what=f"round {rnd}, h")
        assert_close(get_flat(server.model), anchor, atol=2e-6, what=f"round {rnd}, global model")
        # card §7: h is the mean over all K clients of g_k (client 2 never trained, g_2 = 0)
        assert_close(server.state["feddyn_h"], [(g[0][i] + g[1][i]) / K for i in range(2)], what="h = mean g")


# -- FedCurv -----------------------------------------------------------------------------------------
FISHER_SAMPLES = [((P1,), 0), ((P06,), 1), ((P02,), 0)]  # n = 3; B = 2 gives batches of 2 and 1


@pytest.mark.parametrize("budget, batches, seen", [(500, 2, 3), (1, 1, 2)])
def test_fedcurv_batch_and_per_sample_fisher_by_hand(budget, batches, seen):
    """fedcurv.md §3 at w = (0.3, −0.2), B = 2 over 3 samples. Batch estimator: u = mean over BATCHES of
    (batch-mean gradient)²; per-sample: u = mean over SAMPLES of (sample gradient)²; each batch's samples are
    those the pass consumed. Budget 1 stops after the first batch (2 samples seen > 1).
    Catches: batch Fisher divided by samples (2/3 or 1/2 of the right value), per-sample divided by batches,
    gradients not squared per batch (mean then square vs square then mean swapped)."""
    w = [0.3, -0.2]
    results = {}
    for estimator in ("batch", "per_sample"):
        model = Linear(1, 2)
        set_flat(model, torch.tensor(w))
        ctx = hand_client(FISHER_SAMPLES, 2, model)
        results[estimator] = fisher_diagonal(ctx, 2, budget, estimator)
        assert len(ctx.data.batches) == batches
        per_batch = [[ce_grad2(w, float(x.flatten()[i]), int(y[i])) for i in range(y.shape[0])] for x, y in ctx.data.batches]
        assert sum(len(b) for b in per_batch) == seen
        if estimator == "batch":
            means = [[sum(gi[j] for gi in b) / len(b) for j in range(2)] for b in per_batch]
            expected = [sum(m[j] ** 2 for m in means) / batches for j in range(2)]
        else:
            expected = [sum(gi[j] ** 2 for b in per_batch for gi in b) / seen for j in range(2)]
        u, used = results[estimator]
        assert used == batches
        assert_close(u, expected, atol=1e-7, what=f"{estimator} Fisher")
    # with distinct samples the two estimators differ (per-sample ≥ batch by Jensen)
    assert bool((results["per_sample"][0] > results["batch"][0] + 1e-4).all())


def test_curvature_penalty_value_by_hand():
    """λ(⟨P, w²⟩ − 2⟨Q, w⟩), w = (1, 2), P = (2, 1), Q = (0.4, −0.3), λ = 0.5: 0.5 (6 − 2·(−0.2)) = 3.2."""
    value = losses.curvature_penalty([torch.tensor([1.0, 2.0])], [torch.tensor([2.0, 1.0])], [torch.tensor([0.4, -0.3])], 0.5)
    assert float(value) == pytest.approx(3.2)


def test_fedcurv_penalised_step_and_uploaded_statistics_by_hand():
    """One plain SGD step with the others' P = (2, 1), Q = (0.4, −0.3), λ = 0.5 from w = (0.5, −0.5), x = 1, y = 0:
    ∇CE = (σ(1) − 1, 1 − σ(1)) = (−0.2689414, 0.2689414); ∇R = 2λ (P ⊙ w − Q) = (0.6, −0.2);
    w1 = w − 0.5 (0.3310586, 0.0689414) = (0.3344707, −0.5344707). Uploaded u = (∇CE at w1)² (one batch of one
    sample), v = u ⊙ w1. Catches: penalty sign, a 1/2 factor, P and Q swapped, Fisher taken before training."""
    algo = method("fedcurv", lam=0.5)
    ctx = hand_client([((P1,), 0)], 2, Linear(1, 2))
    msg = Message(weights=torch.tensor([0.5, -0.5]), fisher_p=torch.tensor([2.0, 1.0]), fisher_q=torch.tensor([0.4, -0.3]))
    reply = algo.local_update(ctx, RoundInfo(1, 0.5), msg)
    g = ce_grad2([0.5, -0.5], X1, 0)
    penalty = [2 * 0.5 * (2.0 * 0.5 - 0.4), 2 * 0.5 * (1.0 * -0.5 + 0.3)]
    assert penalty == pytest.approx([0.6, -0.2])
    w1 = [0.5 - 0.5 * (g[0] + penalty[0]), -0.5 - 0.5 * (g[1] + penalty[1])]
    assert_close(reply["weights"], [0.3344707, -0.5344707], atol=1e-6, what="hand numbers")
    assert_close(reply["weights"], w1, what="formula")
    u = [gi**2 for gi in ce_grad2(w1, X1, 0)]
    assert_close(reply["fisher_u"], u, atol=1e-7, what="u")
    assert_close(reply["fisher_v"], [u[0] * w1[0], u[1] * w1[1]], atol=1e-7, what="v")


def test_fedcurv_server_sends_each_client_the_other_clients_sums():
    """Stored (u_j, v_j) of clients 0, 1, 2; P_0 = u_1 + u_2, Q_0 = v_1 + v_2; a client that never uploaded
    gets U = Σ u_j; a later upload replaces the client's old pair. Catches: own stats not excluded, U modified
    in place, stale pairs summed twice."""
    algo = method("fedcurv")
    server = hand_server(algo, Linear(1, 2), [0.0, 0.0], num_clients=8)
    u = {0: [1.0, 2.0], 1: [0.5, 0.25], 2: [4.0, 0.0]}
    v = {0: [0.1, -0.2], 1: [0.3, 0.0], 2: [-1.0, 2.0]}

    def statistics(uu, vv):
        return Message(weights=torch.zeros(2), num_samples=1, fisher_u=torch.tensor(uu), fisher_v=torch.tensor(vv))

    algo.aggregate(server, RoundInfo(1, 0.1), {c: statistics(u[c], v[c]) for c in u})
    to_0 = algo.broadcast(server, RoundInfo(2, 0.1), 0)
    assert_close(to_0["fisher_p"], [4.5, 0.25], what="P_0")
    assert_close(to_0["fisher_q"], [-0.7, 2.0], what="Q_0")
    assert_close(algo.broadcast(server, RoundInfo(2, 0.1), 7)["fisher_p"], [5.5, 2.25], what="P of a new client")
    assert_close(algo.broadcast(server, RoundInfo(2, 0.1), 1)["fisher_q"], [-0.9, 1.8], what="Q_1")
    algo.aggregate(server, RoundInfo(2, 0.1), {1: statistics([0.0, 1.0], [0.0, 0.5])})
    assert_close(algo.broadcast(server, RoundInfo(3, 0.1), 0)["fisher_p"], [4.0, 1.0], what="P_0 after 1 re-uploads")


# -- MOON --------------------------------------------------------------------------------------------
def test_moon_contrastive_loss_on_given_features():
    """moon.md §3, τ = 0.5. Row 1: z = (1, 0), z_g = (1, 1), z_p = (0, 1): sim_g = 1/√2, sim_p = 0.
    Row 2: z = (3, 4), z_g = (6, 8), z_p = (−4, 3): sim_g = 1, sim_p = 0.
    ℓ = −log(e^{s_g/τ} / (e^{s_g/τ} + e^{s_p/τ})) = log(1 + e^{(s_p − s_g)/τ}); loss = batch mean.
    Catches: positive and negative swapped, τ multiplied, dot product instead of cosine, sum over the batch."""
    z = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    z_g = torch.tensor([[1.0, 1.0], [6.0, 8.0]])
    z_p = torch.tensor([[0.0, 1.0], [-4.0, 3.0]])
    row1 = math.log(1.0 + math.exp((0.0 - 1.0 / math.sqrt(2.0)) / 0.5))
    row2 = math.log(1.0 + math.exp((0.0 - 1.0) / 0.5))
    assert float(losses.model_contrastive(z, z_g, z_p, 0.5)) == pytest.approx((row1 + row2) / 2, rel=1e-6)
    assert (row1, row2) == pytest.approx((0.2176, 0.1269), abs=1e-4)  # log(1 + e^-1.4142), log(1 + e^-2)


# -- FedRS -------------------------------------------------------------------------------------------
def test_fedrs_restricted_softmax_on_given_logits():
    """The client holds classes 0 and 1 of 3; α = 0.5 (binary): s = (1, 1, 0.5), ẑ = s ⊙ z.
    z = ((1, 2, 3), (0, −1, 2)) → ẑ = ((1, 2, 1.5), (0, −1, 1)); CE(ẑ, (0, 1)) = mean of
    log(e + e² + e^1.5) − 1 and log(1 + e^-1 + e) + 1. Proportional mode with counts (2, 1, 0):
    s = α + (1 − α) n_c / max n = (1, 0.75, 0.5). Catches: scaling the present classes, α on the wrong side,
    dividing instead of multiplying."""
    samples = [((P1, P02), 0), ((P02, P1), 0), ((P06, P06), 1)]
    z = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 2.0]])
    binary = method("fedrs", alpha=0.5).logit_transform(hand_client(samples, 3, Linear(2, 3)))
    restricted = binary(z)
    assert_close(restricted, [[1.0, 2.0, 1.5], [0.0, -1.0, 1.0]], what="restricted logits")
    e = math.e
    ce = ((math.log(e + e**2 + e**1.5) - 1.0) + (math.log(1.0 + 1.0 / e + e) + 1.0)) / 2
    assert float(torch.nn.functional.cross_entropy(restricted, torch.tensor([0, 1]))) == pytest.approx(ce, rel=1e-6)
    proportional = method("fedrs", alpha=0.5, mode="proportional").logit_transform(hand_client(samples, 3, Linear(2, 3)))
    assert_close(proportional(torch.ones(1, 3)), [1.0, 0.75, 0.5], what="proportional scaling")


# -- FedNTD ------------------------------------------------------------------------------------------
def test_fedntd_not_true_distillation_on_given_logits():
    """fedntd.md §3, τ = 2. Row 1: y = 0, z_s = (1, 2, 0), z_t = (0, 1, 1): not-true {1, 2},
    q̃_s = softmax((2, 0)/2) = (σ(1), 1 − σ(1)), q̃_t = (½, ½). Row 2: y = 2, z_s = (0, 0, 5), z_t = (3, 0, −1):
    q̃_s = (½, ½), q̃_t = (σ(1.5), 1 − σ(1.5)). Loss = τ² · mean_b KL(q̃_t || q̃_s); teacher-free: q̃_t uniform.
    Catches: true class kept, KL direction reversed, τ² missing, temperature not applied."""
    zs = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 5.0]])
    zt = torch.tensor([[0.0, 1.0, 1.0], [3.0, 0.0, -1.0]])
    y = torch.tensor([0, 2])

    def kl(q, p):
        return sum(qi * math.log(qi / pi) for qi, pi in zip(q, p))

    qs1, qs2 = (sigmoid(1.0), 1 - sigmoid(1.0)), (0.5, 0.5)
    qt1, qt2 = (0.5, 0.5), (sigmoid(1.5), 1 - sigmoid(1.5))
    expected = 4.0 * (kl(qt1, qs1) + kl(qt2, qs2)) / 2
    assert float(losses.not_true_distillation(zs, zt, y, 2.0)) == pytest.approx(expected, rel=1e-6)
    # teacher-free: row 2's student is uniform on {0, 1}, so only row 1 contributes
    assert float(losses.not_true_distillation(zs, None, y, 2.0)) == pytest.approx(4.0 * kl((0.5, 0.5), qs1) / 2, rel=1e-6)


# -- FedLMD ------------------------------------------------------------------------------------------
def test_fedlmd_label_masking_on_given_logits_and_majority_labels():
    """fedlmd.md §3 with C = 4, M_k = {0}, τ = 2.
    Row 1: y = 1 → A = {2, 3}, S = {0, 2, 3}; z_s = (1, 0, 2, 0), z_t = (0, 5, 2, −2):
    p_t = softmax((1, −1)) = (σ(2), 1 − σ(2)); log p_s(i) = z_{s,i}/2 − log(e^{0.5} + e + 1) on S.
    Row 2: y = 0 ∈ M_k → A = S = {1, 2, 3}; z_s = (9, 0, 0, 2), z_t = (−3, 0, 0, 0): p_t uniform,
    p_s = (1, 1, e)/(2 + e). Loss = τ² (ℓ_1 + ℓ_2)/B. Tf: p_t uniform on A.
    Catches: majority labels left in the teacher support, student normalised over A instead of S, target not
    removed, τ² or 1/B missing."""
    zs = torch.tensor([[1.0, 0.0, 2.0, 0.0], [9.0, 0.0, 0.0, 2.0]])
    zt = torch.tensor([[0.0, 5.0, 2.0, -2.0], [-3.0, 0.0, 0.0, 0.0]])
    y = torch.tensor([1, 0])
    majority = torch.tensor([True, False, False, False])
    e = math.e
    lse1 = math.log(math.exp(0.5) + e + 1.0)
    log_ps1 = {2: 1.0 - lse1, 3: 0.0 - lse1}
    log_ps2 = {1: -math.log(2 + e), 2: -math.log(2 + e), 3: 1.0 - math.log(2 + e)}

    def ell(pt, log_ps):
        return sum(p * (math.log(p) - log_ps[i]) for i, p in pt.items())

    pt1 = {2: sigmoid(2.0), 3: 1 - sigmoid(2.0)}
    pt2 = {1: 1 / 3, 2: 1 / 3, 3: 1 / 3}
    expected = 4.0 * (ell(pt1, log_ps1) + ell(pt2, log_ps2)) / 2
    assert float(losses.label_masking_distillation(zs, zt, y, majority, 2.0)) == pytest.approx(expected, rel=1e-6)
    tf = 4.0 * (ell({2: 0.5, 3: 0.5}, log_ps1) + ell(pt2, log_ps2)) / 2
    assert float(losses.label_masking_distillation(zs, None, y, majority, 2.0)) == pytest.approx(tf, rel=1e-6)


def test_fedlmd_majority_labels_are_the_clients_classes_above_n_over_c():
    """Counts (3, 1, 1, 0): n/C = 5/4, so M_k = {0} (code rule); paper rule n_c ≥ n/|Y_k| = 5/3: also {0};
    counts (2, 2, 1, 0): code {0, 1} (2 > 1.25), paper {0, 1} (2 ≥ 5/3)."""
    for samples, expected in (
        ([((P1, P1), 0)] * 3 + [((P1, P1), 1), ((P1, P1), 2)], [True, False, False, False]),
        ([((P1, P1), 0)] * 2 + [((P1, P1), 1)] * 2 + [((P1, P1), 2)], [True, True, False, False]),
    ):
        for rule in ("code", "paper"):
            algo = method("fedlmd", majority_rule=rule)
            assert algo.majority(hand_client(samples, 4, Linear(2, 4))).tolist() == expected, rule


# -- local objectives of the loss-term and logit methods, written out ---------------------------------
C4 = 4
# counts (3, 1, 1, 0): M_k = {0}; class 3 absent (FedRS scales it)
OBJECTIVE_SAMPLES = [((P1, P02), 0), ((204, 102), 0), ((P02, 204), 0), ((102, P06), 1), ((P06, 0), 2)]
W_G = [[0.3, -0.2], [0.1, 0.4], [-0.3, 0.2], [0.05, -0.1]]
A_G, A_PREV = [[1.0, 0.2], [-0.3, 0.8]], [[0.6, -0.5], [0.4, 1.1]]
BETA, TAU = 2.0, 2.0


def ce(z, y):
    return (torch.logsumexp(z, 1) - z[torch.arange(len(y)), y]).mean()


def kl_rows(log_pt, log_ps):
    return (log_pt.exp() * (log_pt - log_ps)).sum()


def ntd(zs, zt, y, tau):
    """τ² · mean_b KL(q̃_t || q̃_s) over the not-true classes, one sample at a time (fedntd.md §3)."""
    total = 0.0
    for b in range(len(y)):
        nt = [i for i in range(zs.shape[1]) if i != int(y[b])]
        log_qs = torch.log_softmax(zs[b, nt] / tau, 0)
        if zt is None:
            log_qt = torch.full((len(nt),), -math.log(len(nt)), dtype=zs.dtype)
        else:
            log_qt = torch.log_softmax(zt[b, nt] / tau, 0)
        total = total + kl_rows(log_qt, log_qs)
    return tau**2 * total / len(y)


def lmd(zs, zt, y, majority, tau):
    """τ² · mean_b Σ_{i∈A(y)} p_t(i)(log p_t(i) − log p_s(i)), A = [C] \\ (M ∪ {y}), S = [C] \\ {y} (fedlmd.md §3)."""
    total = 0.0
    for b in range(len(y)):
        a = [i for i in range(zs.shape[1]) if i != int(y[b]) and i not in majority]
        s = [i for i in range(zs.shape[1]) if i != int(y[b])]
        if not a:
            continue
        log_ps = torch.log_softmax(zs[b, s] / tau, 0)[[s.index(i) for i in a]]
        log_pt = torch.full((len(a),), -math.log(len(a)), dtype=zs.dtype) if zt is None else torch.log_softmax(zt[b, a] / tau, 0)
        total = total + kl_rows(log_pt, log_ps)
    return tau**2 * total / len(y)


def kd(zs, zt, tau):
    rows = [kl_rows(torch.log_softmax(zt[b] / tau, 0), torch.log_softmax(zs[b] / tau, 0)) for b in range(len(zs))]
    return tau**2 * sum(rows) / len(zs)


def smoothed_ce(z, y, eps):
    target = (1 - eps) * torch.nn.functional.one_hot(y, z.shape[1]).double() + eps / z.shape[1]
    return -(target * torch.log_softmax(z, 1)).sum(1).mean()


def cosine(a, b):
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))


def objective(name):
    """(params for the method, model, loss(weights, x, y) written from the card). ``weights`` are float64
    copies of the model's parameters in ``parameters()`` order; teachers use the broadcast W_G (and A_G)."""
    w_g, a_g, a_prev = vec(W_G), vec(A_G), vec(A_PREV)
    if name == "moon":
        mu, tau = 2.0, 0.5

        def loss(ws, x, y):
            a, w = ws
            z, z_g, z_p = x @ a.T, x @ a_g.T, x @ a_prev.T
            con = torch.log1p(torch.exp((cosine(z, z_p) - cosine(z, z_g)) / tau)).mean()
            return ce(z @ w.T, y) + mu * con

        return {"mu": mu, "tau": tau}, TwoLayer(2, C4), loss
    if name == "fedrs":
        scale = vec([1.0, 1.0, 1.0, 0.3])  # class 3 is absent
        return {"alpha": 0.3}, Linear(2, C4), lambda ws, x, y: ce((x @ ws[0].T) * scale, y)
    teacher = lambda x: x @ w_g.T  # noqa: E731
    terms = {
        "fedntd": lambda z, x, y: BETA * ntd(z, teacher(x), y, TAU),
        "fedntd_tf": lambda z, x, y: BETA * ntd(z, None, y, TAU),
        "fedlmd": lambda z, x, y: BETA * lmd(z, teacher(x), y, {0}, TAU),
        "fedlmd_tf": lambda z, x, y: BETA * lmd(z, None, y, {0}, TAU),
        "fedavg_kd": lambda z, x, y: BETA * kd(z, teacher(x), TAU),
    }
    if name == "fedavg_ls":
        return {"epsilon": 0.2}, Linear(2, C4), lambda ws, x, y: smoothed_ce(x @ ws[0].T, y, 0.2)
    params = {"beta": BETA, "tau": TAU, **({"teacher_free": True} if name == "fedntd_tf" else {})}
    term = terms[name]
    return params, Linear(2, C4), lambda ws, x, y: ce(x @ ws[0].T, y) + term(x @ ws[0].T, x, y)


def reference_sgd(start, batches, loss, lr, momentum, wd):
    """fedavg.md §3 SGD in float64 on the written-out objective, over the batches the code consumed."""
    ws = [t.clone().requires_grad_(True) for t in start]
    buf = None
    for x, y in batches:
        grads = torch.autograd.grad(loss(ws, x.flatten(1).double(), y), ws)
        with torch.no_grad():
            d = [g + wd * w for g, w in zip(grads, ws)]
            buf = d if buf is None else [momentum * b + di for b, di in zip(buf, d)]
            for w, b in zip(ws, buf):
                w -= lr * b
    return torch.cat([w.detach().reshape(-1) for w in ws])


LOSS_METHODS = ["moon", "fedrs", "fedntd", "fedntd_tf", "fedlmd", "fedlmd_tf", "fedavg_kd", "fedavg_ls"]


@pytest.mark.parametrize("name", LOSS_METHODS)
def test_local_training_follows_the_written_out_objective(name):
    """Three full-batch steps (B = 8 ≥ n = 5), momentum 0.9, weight decay 0.01, lr 0.5, from the broadcast W_G; the
    reference differentiates the card's objective written out above (teacher = the broadcast model, MOON's
    previous model = client state). The method's term must matter: the result is far from plain CE's.
    Catches: a wrong sign or factor in any term (β, τ², 1/τ), the wrong teacher, masks, s_k, ε convention."""
    params, model, loss = objective(name)
    algo_name = "fedntd" if name == "fedntd_tf" else name
    algo = method(algo_name, epochs=3, batch_size=8, momentum=0.9, weight_decay=0.01, **params)
    if name == "moon":
        start = [vec(A_G), vec(W_G)]
        state = {"moon_prev": torch.cat([vec(A_PREV).reshape(-1), vec(W_G).reshape(-1)]).float()}
    else:
        start, state = [vec(W_G)], {}
    weights = torch.cat([t.reshape(-1) for t in start]).float()
    ctx = hand_client(OBJECTIVE_SAMPLES, C4, model, state=state)
    reply = algo.local_update(ctx, RoundInfo(1, 0.5), Message(weights=weights))
    batches = ctx.data.batches
    assert len(batches) == 3 and all(y.shape[0] == 5 for _, y in batches)
    expected = reference_sgd(start, batches, loss, 0.5, 0.9, 0.01)
    assert_close(reply["weights"], expected, atol=1e-5, what=name)
    plain = reference_sgd(start, batches, lambda ws, x, y: ce(plain_logits(ws, x), y), 0.5, 0.9, 0.01)
    assert float((plain - expected).abs().max()) > 1e-3, f"{name}: the term hardly changes the weights"


def plain_logits(ws, x):
    """``W x`` (Linear) or ``W A x`` (TwoLayer): the logits plain CE sees."""
    h = x @ ws[0].T
    return h @ ws[1].T if len(ws) == 2 else h
