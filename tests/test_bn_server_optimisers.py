"""BatchNorm statistics under server optimisers and non-convex combinations (FedAvg.aggregate).

Whatever moves the parameters on the server (FedAvgM's momentum, FedAdam, FedNova's extrapolation, FedDyn's
correction), the entries of the flat vector that are not trainable parameters get the plain p_k-weighted mean
of the clients' values: a running variance pushed by a server step turns negative and the network outputs NaN.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import small_config

from fedistill.algorithms.base import Message, RoundInfo, ServerContext
from fedistill.simulation import Simulation, make_algorithm
from fedistill.models import build_model
from fedistill.models.flat import get_flat, trainable_mask

# (algorithm.name, algorithm.plus, the weighting p_k of the combination)
METHODS = [
    ("fedavgm", {}, "samples"),
    ("fednova", {}, "samples"),
    ("fednova", {"fedadam": {"server_lr": 0.1}}, "samples"),  # FedAdam on FedNova's extrapolated aggregate
    ("fedavg", {"fedavgm": {}}, "samples"),
    ("feddyn", {"fedavgm": {}}, "uniform"),  # FedDyn's card: the uniform mean
]
IDS = ["fedavgm", "fednova", "fednova+fedadam", "fedavg+fedavgm", "feddyn+fedavgm"]


def _config(name, plus, **overrides):
    settings = {"algorithm.name": name, "model.name": "resnet8", "partition.alpha": 0.1}
    if plus:
        settings["algorithm.plus"] = plus
    return small_config(**{**settings, **overrides})


def _statistics(model, suffix=("running_mean", "running_var")):
    """Mask of the flat vector's entries whose state-dict key ends with one of ``suffix``."""
    pieces = [
        torch.full((t.numel(),), key.endswith(suffix), dtype=torch.bool)
        for key, t in model.state_dict().items()
        if t.is_floating_point()
    ]
    return torch.cat(pieces)


def _plain_mean(replies, weighting):
    """sum_k p_k w_k in float32, client order, p_k = n_k / sum n (samples) or 1/m (uniform)."""
    counts = [int(r["num_samples"]) for r in replies]
    total = sum(counts) if weighting == "samples" else len(counts)
    out = torch.zeros_like(replies[0]["weights"])
    for r, n in zip(replies, counts):
        out.add_(r["weights"], alpha=(n if weighting == "samples" else 1) / total)
    return out


@pytest.mark.parametrize("name, plus, weighting", METHODS, ids=IDS)
def test_statistics_of_hand_made_replies_are_their_plain_mean(name, plus, weighting):
    """Known client values: running_var 0.5 and 0.25, running_mean 0.5 and −0.25, n_k = 1 and 3 (p = ¼, ¾).

    The plain mean is exact in float32 (0.3125 and −0.0625 by samples; 0.375 and 0.125 uniformly). Before the
    fix FedAvgM's momentum carried the variance below zero in round 2 and FedNova's extrapolation (clients
    with 1 and 20 local steps: weights summing to far more than 1) in round 1.
    """
    algorithm = make_algorithm(_config(name, plus))
    model = build_model("resnet8", (1, 8, 8), 10)
    server = ServerContext(model, {}, torch.Generator().manual_seed(0), 10, num_clients=6)
    algorithm.init_server(server)
    stats, var = _statistics(model), _statistics(model, ("running_var",))
    assert torch.equal(~trainable_mask(model), stats) and bool(var.any())  # resnet8: buffers = BN statistics
    mean = stats & ~var
    noise = torch.Generator().manual_seed(1)
    expected_var = 0.3125 if weighting == "samples" else 0.375
    expected_mean = -0.0625 if weighting == "samples" else 0.125
    for rnd in range(1, 4):
        g = get_flat(model)
        replies = {}
        for cid, (n, steps, v, m) in enumerate([(1, 1, 0.5, 0.5), (3, 20, 0.25, -0.25)]):
            w = g + 0.01 * torch.randn(g.shape, generator=noise)
            w[var], w[mean] = v, m
            replies[cid] = Message(weights=w, num_samples=n, local_steps=steps, train_loss=1.0)
        algorithm.aggregate(server, RoundInfo(rnd, 0.05), replies)
        new = get_flat(model)
        assert torch.isfinite(new).all()
        assert (new[var] >= 0).all(), f"round {rnd}: negative running_var {float(new[var].min())}"
        assert (new[var] == expected_var).all() and (new[mean] == expected_mean).all(), f"round {rnd}"
        assert torch.equal(new[stats], _plain_mean(list(replies.values()), weighting)[stats])


@pytest.mark.parametrize("name, plus, weighting", METHODS[:4], ids=IDS[:4])
def test_trained_statistics_stay_the_plain_mean_of_the_replies(digits, name, plus, weighting):
    """resnet8 on label-skewed digits (LDA 0.1): after every round the BatchNorm statistics of the global model
    are exactly the weighted mean of the clients' replies, variances are non-negative, everything is finite."""
    sim = Simulation(_config(name, plus), digits)
    seen = []
    aggregate = sim.algorithm.aggregate

    def recording(server, info, replies):
        seen.append([replies[c] for c in sorted(replies)])
        return aggregate(server, info, replies)

    sim.algorithm.aggregate = recording
    model = sim.server.model
    stats, var = _statistics(model), _statistics(model, ("running_var",))
    for rnd in range(1, 4):
        row = sim.run_round(rnd)
        new = get_flat(model)
        assert torch.isfinite(new).all() and math.isfinite(row["test_loss"])
        assert (new[var] >= 0).all(), f"round {rnd}: negative running_var"
        assert torch.equal(new[stats], _plain_mean(seen[-1], weighting)[stats]), f"round {rnd}"


def test_fedavgm_with_batchnorm_learns(digits):
    """The issue's run (resnet8, digits, LDA 0.1, β = 0.7) gave NaN from round 2 and stayed at chance."""
    cfg = _config("fedavgm", {}, rounds=6, **{"algorithm.server_momentum": 0.7, "local.epochs": 2})
    history = Simulation(cfg, digits).run()
    assert all(math.isfinite(r["test_loss"]) for r in history)
    assert history[-1]["test_accuracy"] > 35.0, history[-1]["test_accuracy"]


def test_a_model_without_buffers_gets_the_server_optimisers_vector_unchanged():
    """Regression guard (passes before and after): no BatchNorm, nothing is overwritten.

    The expectation is FedAvgM written out (fedavg.md §3: β = 0.7 by default, η_s = 1, p_k = n_k / Σ n = k/6),
    in float64, independently of ``combine`` and ``ServerMomentum``; bit-identity with what the server
    optimiser produced is checked as well, since "unchanged" is the point of the guard.
    """
    algorithm = make_algorithm(small_config(**{"algorithm.name": "fedavgm", "model.name": "digits_cnn"}))
    assert algorithm.params.server_momentum == 0.7 and algorithm.params.server_lr == 1.0
    model = build_model("digits_cnn", (1, 8, 8), 10)
    assert bool(trainable_mask(model).all())
    server = ServerContext(model, {}, torch.Generator(), 10, num_clients=6)
    noise = torch.Generator().manual_seed(2)
    expected_state: dict = {}
    optimiser = algorithm.server_optimizer(server)
    momentum = None
    for rnd in range(1, 3):
        g = get_flat(model)
        replies = {c: Message(weights=g + torch.randn(g.shape, generator=noise), num_samples=c + 1) for c in range(3)}
        by_hand_mean = sum((c + 1) / 6 * r["weights"].double() for c, r in replies.items())
        delta = g.double() - by_hand_mean
        momentum = delta if momentum is None else 0.7 * momentum + delta
        by_hand = g.double() - momentum
        expected = optimiser.step(expected_state, g, algorithm.combine(g, list(replies.values())))
        algorithm.aggregate(server, RoundInfo(rnd, 0.05), replies)
        assert torch.allclose(get_flat(model).double(), by_hand, rtol=0.0, atol=1e-5)
        assert torch.equal(get_flat(model), expected)
