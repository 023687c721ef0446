"""pFedMe (spec/fmtl-baselines.md §3): the card's invariants, its reduction to local SGD, a hand-computed
round, BatchNorm handling, the configuration refusals and an end-to-end personalisation check."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_resume_is_exact, small_config

from fedistill.algorithms.base import ClientContext, Message, RoundInfo
from fedistill.algorithms.build import make_algorithm
from fedistill.algorithms.local import local_sgd
from fedistill.algorithms.pfedme import PFedMe, ServerMixing
from fedistill.config import build_config
from fedistill.data.dataset import Dataset
from fedistill.data.pipeline import TensorPipeline
from fedistill.simulation import Simulation
from fedistill.errors import ConfigError, TrainingDiverged
from fedistill.models.flat import get_flat, set_flat, trainable_mask


def pfedme_config(**overrides):
    """pFedMe on the small digits federation; momentum-free local settings, as pFedMe requires. One intra-op
    thread: these models are tiny, and on a shared machine spinning threads cost far more than they give."""
    settings = {"algorithm.name": "pfedme", "local.momentum": 0.0, "local.weight_decay": 5e-4, "run.threads": 1}
    return small_config(**{**settings, **overrides})


class Recording:
    """A data pipeline that hands out the real pipeline's batches and snapshots ``model`` (its flat vector)
    each time a batch is drawn: with one step per batch, the path before every step."""

    def __init__(self, pipeline, model: torch.nn.Module) -> None:
        self.pipeline, self.model = pipeline, model
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.snapshots: list[torch.Tensor] = []

    def epoch_batches(self, indices, batch_size, generator):
        for x, y in self.pipeline.epoch_batches(indices, batch_size, generator):
            self.snapshots.append(get_flat(self.model))
            self.batches.append((x.clone(), y.clone()))
            yield x, y


def client_update(sim: Simulation, cid: int = 0, rnd: int = 1, recording: bool = False):
    """One client's local update of round ``rnd`` from the broadcast, outside the engine's round loop."""
    info = sim.round_info(rnd)
    msg = sim.server_runtime.broadcast(info, cid)
    ctx = sim.client_runtime.context(cid, rnd, {})
    if recording:
        ctx.data = Recording(ctx.data, ctx.model)
    reply = sim.algorithm.local_update(ctx, info, msg)
    return ctx, msg, reply


# -- card invariants ---------------------------------------------------------------------------------------
def test_zero_personal_lr_leaves_theta_and_the_upload_at_the_global_model(digits):
    sim = Simulation(pfedme_config(**{"algorithm.personal_lr": 0.0, "local.epochs": 2}), digits)
    ctx, msg, reply = client_update(sim)
    assert torch.equal(get_flat(ctx.model), msg["weights"])  # θ = w_t
    assert torch.equal(reply["weights"], msg["weights"])  # w_{k,J} = w_t
    before = get_flat(sim.server.model)
    sim.run_round(1)
    # Every client uploads w_t exactly; their p_k-weighted mean is w_t up to float32 rounding of the sum.
    torch.testing.assert_close(get_flat(sim.server.model), before, rtol=1e-6, atol=1e-7)


def test_beta_zero_keeps_the_global_model(digits):
    sim = Simulation(pfedme_config(**{"algorithm.beta": 0.0}), digits)
    before = get_flat(sim.server.model)
    row = sim.run_round(1)
    assert torch.equal(get_flat(sim.server.model), before)  # digits CNN: no BatchNorm, every entry is w
    assert row["train_loss"] > 0  # the clients did train


def test_server_mixing_is_exact_at_beta_one_and_zero_and_convex_between():
    g = torch.randn(1000) * 3
    agg = torch.randn(1000)
    assert torch.equal(ServerMixing(1.0).step({}, g, agg), agg)
    assert torch.equal(ServerMixing(0.0).step({}, g, agg), g)
    torch.testing.assert_close(ServerMixing(0.25).step({}, g, agg), 0.75 * g + 0.25 * agg, rtol=0, atol=1e-6)


def test_aggregate_mixes_the_weighted_mean_with_the_old_global_model(digits):
    sim = Simulation(pfedme_config(**{"algorithm.beta": 0.5}), digits)
    old = get_flat(sim.server.model)
    a, b = torch.randn_like(old), torch.randn_like(old)
    replies = {0: Message(weights=a, num_samples=1, train_loss=0.0), 1: Message(weights=b, num_samples=3, train_loss=0.0)}
    sim.algorithm.aggregate(sim.server, sim.round_info(1), replies)
    expected = 0.5 * old.double() + 0.5 * (0.25 * a.double() + 0.75 * b.double())
    torch.testing.assert_close(get_flat(sim.server.model).double(), expected, rtol=0, atol=1e-6)


def test_large_lambda_drives_theta_to_w(digits):
    """θ − w → 0 like 1/λ (the proximal point of w), with η_p·λ = 0.5 < 1 and η·λ ≤ 0.5 so both updates
    are contractions. Measured ‖θ − w_{k,J}‖: λ=10 → 0.092, 100 → 0.0087, 1000 → 0.00045."""
    gaps = []
    for lam in (10.0, 100.0, 1000.0):
        overrides = {"algorithm.lam": lam, "algorithm.personal_lr": 0.5 / lam, "local.lr": 0.5 / 1000.0}
        ctx, msg, reply = client_update(Simulation(pfedme_config(**overrides), digits))
        mask = trainable_mask(ctx.model)
        gaps.append(float((get_flat(ctx.model)[mask] - reply["weights"][mask]).norm()))
    assert gaps[0] > 0
    assert gaps[1] < 0.2 * gaps[0] and gaps[2] < 0.2 * gaps[1], gaps


def test_each_client_evaluates_exactly_J_times_K_gradients(digits):
    epochs, batch, k = 2, 32, 3
    sim = Simulation(pfedme_config(**{"algorithm.inner_steps": k, "local.epochs": epochs, "local.batch_size": batch}), digits)
    info = sim.round_info(1)
    for cid in (0, 1):
        ctx = sim.client_runtime.context(cid, 1, {})
        forwards, backwards = [0], [0]
        first = next(ctx.model.parameters())
        hooks = [
            ctx.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1)),
            first.register_hook(lambda g: backwards.__setitem__(0, backwards[0] + 1)),
        ]
        try:
            sim.algorithm.local_update(ctx, info, sim.server_runtime.broadcast(info, cid))
        finally:
            for h in hooks:
                h.remove()
        j = epochs * math.ceil(ctx.num_samples / batch)
        assert forwards[0] == backwards[0] == j * k, (cid, forwards, backwards, j)


# -- lambda = 0, K = 1: plain local SGD --------------------------------------------------------------------
@pytest.mark.parametrize("grad_clip", [None, 0.5])
def test_lambda_zero_one_inner_step_is_local_sgd_step_for_step(digits, grad_clip):
    """The card's reduction: θ follows momentum-free SGD with lr η_p and weight decay μ_wd over the same
    mini-batches, and the upload is w_t (w never moves when λ = 0). With grad_clip, both clip the CE gradient."""
    lr, wd = 0.07, 1e-3
    cfg = pfedme_config(**{"algorithm.lam": 0.0, "algorithm.inner_steps": 1, "algorithm.personal_lr": lr,
                           "local.weight_decay": wd, "local.epochs": 2, "algorithm.grad_clip": grad_clip})  # fmt: skip
    sim = Simulation(cfg, digits)
    ctx, msg, reply = client_update(sim, cid=2, rnd=3, recording=True)
    theta_path = ctx.data.snapshots + [get_flat(ctx.model)]
    assert torch.equal(reply["weights"], msg["weights"])

    # local_sgd on a fresh context of the same client and round: same generator seed, same batches.
    reference = sim.client_runtime.context(2, 3, {})
    set_flat(reference.model, msg["weights"])
    reference.data = Recording(reference.data, reference.model)
    result = local_sgd(
        reference, lr=lr, epochs=2, batch_size=cfg.local.batch_size, momentum=0.0, weight_decay=wd, grad_clip=grad_clip
    )
    sgd_path = reference.data.snapshots + [get_flat(reference.model)]
    assert len(theta_path) == len(sgd_path) == result.steps + 1 > 3
    for step, (a, b) in enumerate(zip(theta_path, sgd_path)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"step {step}: {m}")
    assert reply["train_loss"] == pytest.approx(result.mean_loss, rel=1e-12)


# -- a round computed by hand ------------------------------------------------------------------------------
def hand_client(model: torch.nn.Module, pixels, labels) -> ClientContext:
    x = torch.tensor(pixels, dtype=torch.uint8).view(len(labels), 1, 1, -1)
    y = torch.tensor(labels, dtype=torch.int64)
    data = Dataset("hand", x, y, x.clone(), y.clone(), 2, (0.0,), (1.0,))
    return ClientContext(cid=0, train_indices=torch.arange(len(labels)), data=TensorPipeline(data), model=model,
                         generator=torch.Generator().manual_seed(5))  # fmt: skip


def test_one_batch_two_inner_steps_by_hand():
    lam, eta_p, eta, mu, k = 2.0, 0.3, 0.05, 0.01, 2
    algorithm = make_algorithm(pfedme_config(**{
        "algorithm.lam": lam, "algorithm.personal_lr": eta_p, "algorithm.inner_steps": k,
        "local.lr": eta, "local.weight_decay": mu, "local.epochs": 1, "local.batch_size": 3,
    }))  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3, 2))
    client = hand_client(model, [[255, 0, 51], [0, 102, 255], [204, 153, 0]], [0, 1, 0])
    x = torch.tensor([[255, 0, 51], [0, 102, 255], [204, 153, 0]], dtype=torch.float32) / 255.0  # mean 0, std 1
    y = torch.nn.functional.one_hot(torch.tensor([0, 1, 0]), 2).float()
    w0 = [model[1].weight.detach().clone(), model[1].bias.detach().clone()]
    msg = Message(weights=get_flat(model))

    # The card's formulas, with the CE gradient written out: ∂/∂z mean CE = (softmax(z) − y)/N.
    theta, losses = [t.clone() for t in w0], []
    for _ in range(k):
        z = x @ theta[0].T + theta[1]
        losses.append(float(-(y * z.log_softmax(1)).sum(1).mean()))
        dz = (z.softmax(1) - y) / x.shape[0]
        grads = [dz.T @ x, dz.sum(0)]
        theta = [t - eta_p * (g + lam * (t - w) + mu * t) for t, g, w in zip(theta, grads, w0)]
    w1 = [w - eta * lam * (w - t) for w, t in zip(w0, theta)]  # J = 1: one w step, after the K inner steps

    reply = algorithm.local_update(client, RoundInfo(round=1, lr=eta), msg)
    torch.testing.assert_close(reply["weights"], torch.cat([t.reshape(-1) for t in w1]), rtol=0, atol=1e-6)
    torch.testing.assert_close(get_flat(model), torch.cat([t.reshape(-1) for t in theta]), rtol=0, atol=1e-6)
    assert reply["train_loss"] == pytest.approx(sum(losses) / k, abs=1e-6)
    assert reply["num_samples"] == 3
    assert all(p.grad is None for p in model.parameters())


def test_batchnorm_statistics_are_thetas_and_uploaded_next_to_w():
    algorithm = make_algorithm(pfedme_config(**{"algorithm.inner_steps": 3, "local.batch_size": 2, "local.lr": 0.05}))
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
    )
    client = hand_client(model, [[255, 0, 51], [0, 102, 255], [204, 153, 0], [10, 20, 30]], [0, 1, 0, 1])
    start = get_flat(model)
    reply = algorithm.local_update(client, RoundInfo(round=1, lr=0.05), Message(weights=start))
    theta, mask = get_flat(model), trainable_mask(model)
    assert torch.equal(reply["weights"][~mask], theta[~mask])  # running statistics: θ's, end of the round
    assert not torch.equal(theta[~mask], start[~mask])  # ... which the inner loop updated
    assert int(model[2].num_batches_tracked) == 2 * 3  # one update per forward pass: J·K = 2·3
    assert not torch.equal(reply["weights"][mask], theta[mask])  # parameters: w_{k,J}, not θ
    assert model.training


# -- configuration ------------------------------------------------------------------------------------------
def test_parameters_default_to_the_card():
    p = make_algorithm(pfedme_config()).params
    assert (p.lam, p.personal_lr, p.inner_steps, p.beta) == (15.0, 0.09, 5, 1.0)
    assert PFedMe.personal_model == "local"


def test_local_momentum_is_refused_when_the_config_is_built():
    """An explicit momentum is refused when the config is built; left unset, pFedMe's own default (0) replaces the
    run's 0.9 (issue 27: `fedistill run --algorithm pfedme` runs on the defaults)."""
    with pytest.raises(ConfigError, match="local.momentum: pfedme runs momentum-free"):
        small_config(algorithm="pfedme", **{"local.momentum": 0.9})
    assert small_config(algorithm="pfedme").local.momentum == 0.0


@pytest.mark.parametrize(
    "algorithm",
    [{"name": "pfedme", "plus": {"fedavgm": {}}}, {"name": "fedavg", "plus": {"pfedme": {}}}],
)
def test_pfedme_cannot_be_combined(algorithm):
    # momentum 0, so the refusal is the combination's and not pFedMe's momentum check.
    with pytest.raises(ConfigError, match="pfedme replaces local_update"):
        build_config({"algorithm": algorithm, "local": {"momentum": 0.0}})


def test_invalid_parameters_are_refused():
    for key, value in (("lam", -1.0), ("personal_lr", -0.1), ("inner_steps", 0), ("beta", -0.5)):
        with pytest.raises(ConfigError):
            pfedme_config(**{f"algorithm.{key}": value})


def test_a_diverging_run_names_the_personal_lr(digits, tmp_path):
    """η_p·λ = 750: every inner step multiplies θ − w by about −749, so θ (and w with it) overflows in round 1;
    local.lr is not what to lower, and the error says which step size is."""
    cfg = pfedme_config(**{"algorithm.personal_lr": 50.0, "rounds": 2})
    with pytest.raises(TrainingDiverged, match=r"round 1: .*local\.lr \(now 0\.05\) or algorithm\.personal_lr \(now 50\)"):
        Simulation(cfg, digits, run_dir=tmp_path).run()


# -- end to end ------------------------------------------------------------------------------------------------
def test_personalised_models_beat_fedavg_on_label_skewed_digits(digits):
    """10 Dirichlet(0.3) clients with their own test splits, all clients every round, 10 rounds.

    Measured (CPU, torch 2.13, one thread): pFedMe personal 90.3% (worst client 76.5%), its global w 82.8%;
    FedAvg's personal accuracy (its global model on each client's split) 75.2%, global 77.4%.
    Momentum-free SGD at lr 0.3 is what this small CNN needs to learn in 10 rounds; λ and K are the card's,
    η_p = 0.05 keeps η_p·λ < 1.
    """
    common = {
        "rounds": 10,
        "clients_per_round": 10,
        "partition": {"scheme": "lda", "num_clients": 10, "alpha": 0.3, "per_client_test": True},
        "local.lr": 0.3,
        "local.momentum": 0.0,
        "run.checkpoint_every": 0,
        "run.threads": 1,
    }
    personal = Simulation(small_config(**common, **{"algorithm.name": "pfedme", "algorithm.personal_lr": 0.05}), digits).run()
    plain = Simulation(small_config(**common, algorithm="fedavg"), digits).run()
    last = personal[-1]
    assert last["test_accuracy"] is not None and last["test_accuracy"] > 60.0  # the global w is reported too
    assert len(last["personal_accuracies"]) == 10
    assert last["personal_accuracy"] > 80.0, last["personal_accuracy"]
    assert last["personal_accuracy"] > plain[-1]["personal_accuracy"] + 5.0, (last["personal_accuracy"], plain[-1])


def test_resume_is_exact(digits, tmp_path):
    assert_resume_is_exact(
        digits, tmp_path, "pfedme",
        **{"local.momentum": 0.0, "algorithm.inner_steps": 2, "algorithm.personal_lr": 0.05, "partition.per_client_test": True,
           "run.threads": 1},
    )  # fmt: skip
