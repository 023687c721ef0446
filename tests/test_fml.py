"""FML (``fml``): a shared meme averaged by the server, trained with each private model by mutual learning
(spec/fml.md §8). Expected values are the card's formulas written out on tiny tensors, or what the test reads off
Local runs and the clients themselves: a flipped KL direction, a reduction over |b| for |b|·C, a detached target
where the default has none, a count weighting for the plain mean or a private model that travels fails."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_resume_bitwise, hetero_config, own_model_accuracies, own_models, shared_model_accuracies

from fedistill.algorithms.build import make_algorithm
from fedistill.config import build_config
from fedistill.errors import ConfigError
from fedistill.losses import mutual_learning_losses
from fedistill.models.flat import num_flat
from fedistill.protocol import Message, RoundInfo, ServerContext
from fedistill.simulation import Simulation

THREE = ["digits_cnn", "resnet8", "logistic"]


def test_the_losses_by_hand():
    """Invariant 2: C = 2, z = [0, 0] (p = [½, ½]), u = [ln 3, 0] (q = [¾, ¼]), y = 0, α = β = 0.5:
    KL(q ‖ p) = ¾ ln 1.5 + ¼ ln 0.5, KL(p ‖ q) = ½ ln(2/3) + ½ ln 2; the default divides by |b|·C = 2, batchmean
    by |b| = 1."""
    z, u, y = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]]), torch.tensor([0])
    kl_qp = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    kl_pq = 0.5 * math.log(2 / 3) + 0.5 * math.log(2.0)
    ce_z, ce_u = math.log(2.0), -math.log(0.75)
    private, meme = mutual_learning_losses(z, u, y, 0.5, 0.5)
    assert float(private) == pytest.approx(0.5 * ce_z + 0.5 * kl_qp / 2, rel=1e-6)
    assert float(meme) == pytest.approx(0.5 * ce_u + 0.5 * kl_pq / 2, rel=1e-6)
    private, meme = mutual_learning_losses(z, u, y, 0.5, 0.5, kl_reduction="batchmean")
    assert float(private) == pytest.approx(0.5 * ce_z + 0.5 * kl_qp, rel=1e-6)
    assert float(meme) == pytest.approx(0.5 * ce_u + 0.5 * kl_pq, rel=1e-6)


def test_the_default_sends_each_model_both_kl_terms_and_detach_only_its_own():
    """Invariant 3: α = 1, β = 0.5 on tiny linear models. The default (targets not detached, the losses summed)
    gives the private model ∇CE + 0.5·∇KL̄(p ‖ q), the meme's term reaching it through its target; with
    detach_targets it gets ∇CE exactly. Both written out by autograd on the card's formula."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, generator=g), torch.tensor([0, 1, 2, 1])
    w_private, w_meme = torch.randn(3, 3, generator=g), torch.randn(3, 3, generator=g)

    def grads(detach):
        wp, wm = w_private.clone().requires_grad_(), w_meme.clone().requires_grad_()
        private, meme = mutual_learning_losses(x @ wp, x @ wm, y, 1.0, 0.5, detach_targets=detach)
        (private + meme).backward()
        return wp.grad

    def card(term_on_private):
        wp = w_private.clone().requires_grad_()
        z, u = x @ wp, x @ w_meme
        loss = torch.nn.functional.cross_entropy(z, y)
        if term_on_private:  # 0.5 · KL(p ‖ q) averaged over |b|·C, p = softmax(z) the target that moves
            p, log_q = torch.softmax(z, 1), torch.log_softmax(u, 1)
            loss = loss + 0.5 * (p * (torch.log(p) - log_q)).sum() / (4 * 3)
        loss.backward()
        return wp.grad

    torch.testing.assert_close(grads(False), card(True))
    torch.testing.assert_close(grads(True), card(False))
    assert not torch.allclose(grads(False), grads(True))


def test_the_server_mean_is_plain_and_samples_weighting_is_an_option():
    """Invariant 5: memes [1, 2] and [3, 6] of clients with 1 and 99 samples give [2, 4]; by samples [2.98, 5.96]."""
    for weighting, expected in (("uniform", [2.0, 4.0]), ("samples", [2.98, 5.96])):
        algorithm = make_algorithm(build_config({"algorithm": {"name": "fml", "weighting": weighting}}))
        server = ServerContext(model=torch.nn.Module(), state={}, generator=torch.Generator(), num_classes=2,
                               shared_initial=torch.zeros(2))  # fmt: skip
        algorithm.init_server(server)
        replies = {0: Message(meme=torch.tensor([1.0, 2.0]), num_samples=1), 1: Message(meme=torch.tensor([3.0, 6.0]), num_samples=99)}
        algorithm.aggregate(server, RoundInfo(1, 0.01), replies)
        assert algorithm.broadcast(server, RoundInfo(2, 0.01), 0)["meme"].tolist() == pytest.approx(expected)


def test_with_alpha_and_beta_one_the_private_models_train_as_local_does(digits):
    """Invariant 1: α = β = 1 switches the KL terms off, so (without clipping) each private model follows Local's
    trajectory on the same batches: the meme is trained beside it and never touches it."""
    same = {"rounds": 2, "local.lr": 0.05}
    fml = Simulation(hetero_config({"name": "fml", "alpha": 1.0, "beta": 1.0, "clip_norm": None}, clients=THREE, **same), digits)
    fml_history = fml.run()
    alone = Simulation(hetero_config("local_only", clients=THREE, **same), digits)
    alone_history = alone.run()
    a, b = own_models(fml), own_models(alone)
    for cid in range(3):
        torch.testing.assert_close(a[cid], b[cid], rtol=1e-5, atol=1e-6)
    assert fml_history[-1]["personal_accuracies"] == pytest.approx(alone_history[-1]["personal_accuracies"])
    # with the default α = β = 0.5 the meme does teach them
    taught = Simulation(hetero_config({"name": "fml", "clip_norm": None}, clients=THREE, **same), digits)
    taught.run()
    assert not torch.allclose(own_models(taught)[0], a[0], rtol=1e-4, atol=1e-5)


def test_each_models_gradient_is_clipped_on_its_own(digits):
    """Invariant 4: one client, one batch holding all its samples, one plain-SGD step: with clip_norm c far below
    the gradients' norms each model moves by exactly lr·c (its own clip, not a shared one)."""
    cfg = hetero_config({"name": "fml", "clip_norm": 1e-3}, clients=["digits_cnn"], **{"local.batch_size": 10_000})
    runtime = Simulation(cfg, digits).client_runtime
    meme = torch.randn(num_flat(runtime.shared_worker), generator=torch.Generator().manual_seed(1)) * 0.1
    context = runtime.context(0, 1, {})
    reply = runtime.algorithm.local_update(context, RoundInfo(1, 0.5), Message(meme=meme))
    moved_private = float((context.state["model"] - context.initial_weights).norm())
    moved_meme = float((reply["meme"] - meme).norm())
    assert moved_private == pytest.approx(0.5e-3, rel=1e-3) and moved_meme == pytest.approx(0.5e-3, rel=1e-3)


def test_three_architectures_the_meme_travels_and_the_private_models_are_evaluated(digits):
    """Invariants 6-8: the meme is the assignment's first member (digits_cnn): bytes up and down 4|φ| per client
    every round whatever the private architectures; the server's meme is the plain mean of the uploads; the
    personal accuracy is each client's own private model on its own test split."""
    sim = Simulation(hetero_config("fml", clients=THREE), digits)
    history = sim.run()
    meme_size = num_flat(sim.client_runtime.worker_for("digits_cnn"))
    assert num_flat(sim.client_runtime.shared_worker) == meme_size
    assert [r["bytes_up"] for r in history] == [3 * 4 * meme_size] * 2
    assert [r["bytes_down"] for r in history] == [3 * 4 * meme_size] * 2
    assert history[-1]["personal_accuracies"] == pytest.approx(own_model_accuracies(sim, THREE))


def test_a_named_shared_model_and_an_unknown_one(digits):
    """model.shared chooses the meme's architecture (its bytes follow); a name the zoo lacks is refused in one line."""
    sim = Simulation(hetero_config("fml", clients=THREE, **{"model.shared": "logistic", "rounds": 1}), digits)
    history = sim.run()
    assert history[-1]["bytes_up"] == 3 * 4 * num_flat(sim.client_runtime.worker_for("logistic"))
    with pytest.raises(ConfigError, match="no_such_model"):
        Simulation(hetero_config("fml", clients=THREE, **{"model.shared": "no_such_model"}), digits)


def test_the_paper_variant_detaches_uses_batchmean_and_does_not_clip():
    params = make_algorithm(build_config({"algorithm": {"name": "fml", "variant": "paper"}})).params
    assert params.resolved() == (True, "batchmean", None)
    params = make_algorithm(build_config({"algorithm": {"name": "fml", "variant": "paper", "clip_norm": 5.0}})).params
    assert params.resolved() == (True, "batchmean", 5.0)
    assert make_algorithm(build_config({"algorithm": {"name": "fml"}})).params.resolved() == (False, "mean", 10.0)


def test_resume_after_a_kill_is_bitwise(digits, tmp_path):
    assert_resume_bitwise(digits, tmp_path, "fml", THREE, "meme")


def test_eval_model_meme_scores_the_global_meme_on_each_clients_split(digits):
    """eval_model="meme": the personal accuracy is the aggregated meme's on each client's own test split."""
    sim = Simulation(hetero_config({"name": "fml", "eval_model": "meme"}, clients=THREE), digits)
    history = sim.run()
    assert history[-1]["personal_accuracies"] == pytest.approx(shared_model_accuracies(sim, "meme"))
    assert history[-1]["personal_accuracies"] != pytest.approx(own_model_accuracies(sim, THREE))
