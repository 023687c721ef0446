"""FedGen in HtFLlib's heterogeneous form (``fedgen`` with ``variant: htfllib``; spec/fedgen.md §8). Expected
values come from the card's formulas written out here: the heads' ensemble CE by hand, the client's generative
term's gradient on the head by hand (a generator whose output is one constant feature), the n_k-weighted head mean
from the clients' own trained heads. A uniform mean for a weighted one, a flipped sign of the client's term, a term
that reaches the extractor or a generator that does not learn fails."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_resume_bitwise, hetero_config, own_models

from fedistill.algorithms.build import make_algorithm
from fedistill.algorithms.fedgen_heads import (
    COUNTS_KEY,
    GENERATOR_KEY,
    HEAD_KEY,
    SUMMED_COUNTS_KEY,
    FedGenHeads,
    draw_labels,
    ensemble_head_loss,
)
from fedistill.config import build_config
from fedistill.errors import ConfigError
from fedistill.models.flat import get_flat, set_flat
from fedistill.models.generators import FeatureGenerator
from fedistill.protocol import Message, RoundInfo, ServerContext
from fedistill.simulation import Simulation

THREE = ["digits_cnn", "resnet8", "logistic"]  # three families, each with a 64-wide feature on 8x8 digits
D, C = 64, 10
HEAD = D * C + C
HTFLLIB = {"name": "fedgen", "variant": "htfllib"}


def test_the_variant_builds_the_heads_form_with_htfllibs_defaults():
    """``variant: htfllib`` gives the heterogeneous form with HtFLlib's client settings and its total.sh flags;
    ``paper`` (the default) keeps the paper's FedGen."""
    cfg = build_config({"algorithm": HTFLLIB})
    algorithm = make_algorithm(cfg)
    assert isinstance(algorithm, FedGenHeads) and algorithm.name == "fedgen"
    assert (cfg.local.lr, cfg.local.batch_size, cfg.local.epochs, cfg.local.momentum) == (0.01, 10, 1, 0.0)
    p = algorithm.params
    assert (p.noise_dim, p.hidden_dim, p.generator_lr, p.generator_steps, p.noise) == (32, 512, 0.1, 100, "uniform")
    assert p.generator_batch_size == p.gen_batch_size == 10 and p.generative_alpha == 1.0 and p.generative_beta == 0.0
    assert not isinstance(make_algorithm(build_config({"algorithm": {"name": "fedgen"}})), FedGenHeads)


def test_the_paper_forms_terms_are_refused_not_ignored():
    for key, value in [("generative_beta", 1.0), ("eta_ens", 0.5), ("cls_weighting", "batch_scalar")]:
        with pytest.raises(ConfigError, match=f"algorithm.{key}"):
            make_algorithm(build_config({"algorithm": {**HTFLLIB, key: value}}))
    with pytest.raises(ConfigError, match="algorithm.gen_batch_size: .*at least 2 rows"):
        make_algorithm(build_config({"algorithm": {**HTFLLIB, "gen_batch_size": 1}}))


def test_the_ensemble_loss_is_the_share_weighted_heads_ce_by_hand():
    """H4 on one feature z = [1, 2], two heads of two classes: W_A = I, b_A = 0 (logits [1, 2]); W_B = [[0, 0],
    [0, 0]], b_B = [3, 0] (logits [3, 0]); shares [0.25, 0.75] give logits [2.5, 0.5], CE for class 1 = 2 +
    log(1 + e^-2)."""
    z = torch.tensor([[1.0, 2.0]])
    weights = torch.stack([torch.eye(2), torch.zeros(2, 2)])
    biases = torch.tensor([[0.0, 0.0], [3.0, 0.0]])
    loss = ensemble_head_loss(z, torch.tensor([1]), weights, biases, torch.tensor([0.25, 0.75]))
    assert float(loss) == pytest.approx(2.0 + math.log(1 + math.exp(-2.0)), rel=1e-6)


def test_labels_are_drawn_in_proportion_to_the_counts():
    counts = torch.tensor([0, 30, 10, 0])
    labels = draw_labels(counts, 40_000, torch.Generator().manual_seed(0))
    share = torch.bincount(labels, minlength=4).double() / labels.numel()
    assert share[0] == 0 and share[3] == 0 and share[1] == pytest.approx(0.75, abs=0.01)


def server_with(algorithm: FedGenHeads, num_clients: int) -> ServerContext:
    server = ServerContext(model=torch.nn.Module(), state={}, generator=torch.Generator(), num_classes=C, num_clients=num_clients,
                           feature_dim=D)  # fmt: skip
    algorithm.init_server(server)
    return server


def test_the_server_learns_the_generator_from_the_heads_then_averages_them_by_samples():
    """Round 1 sends the head alone; the server keeps each client's counts, trains G so that the heads' share-weighted
    ensemble names the drawn labels (its CE on fresh draws falls from the initial generator's), and the new global
    head is Σ n_k h_k / Σ n_k; from then on G and the summed counts go down too."""
    algorithm = make_algorithm(build_config({"algorithm": {**HTFLLIB, "hidden_dim": 32, "generator_steps": 200}}))
    server = server_with(algorithm, num_clients=3)
    first = algorithm.broadcast(server, RoundInfo(1, 0.01), 0)
    assert set(first) == {HEAD_KEY}
    g = torch.Generator().manual_seed(1)
    heads = {cid: torch.randn(HEAD, generator=g) * 3 for cid in (0, 2)}  # client 1 did not report
    counts = {0: torch.tensor([5, 0, 0, 0, 0, 0, 0, 0, 0, 1]), 2: torch.tensor([0, 4, 0, 0, 0, 0, 0, 0, 0, 2])}
    replies = {cid: Message({HEAD_KEY: heads[cid], "num_samples": n, "label_counts": counts[cid]}) for cid, n in ((0, 1), (2, 3))}
    initial = FeatureGenerator(32, C, D, 32)
    set_flat(initial, server.state[GENERATOR_KEY].clone())
    algorithm.aggregate(server, RoundInfo(1, 0.01), replies)

    torch.testing.assert_close(server.state[HEAD_KEY], 0.25 * heads[0] + 0.75 * heads[2], rtol=0, atol=1e-6)
    assert server.state[COUNTS_KEY][1].sum() == 0 and torch.equal(server.state[COUNTS_KEY][2], counts[2])
    after = algorithm.broadcast(server, RoundInfo(2, 0.01), 1)
    assert torch.equal(after[SUMMED_COUNTS_KEY], counts[0] + counts[2])
    trained = FeatureGenerator(32, C, D, 32)
    set_flat(trained, after[GENERATOR_KEY])
    stacked = torch.stack([heads[0], heads[2]])
    weights, biases, shares = stacked[:, :-C].reshape(2, C, D), stacked[:, -C:], torch.tensor([0.25, 0.75])
    draws = torch.Generator().manual_seed(5)
    labels = draw_labels(counts[0] + counts[2], 512, draws)
    eps = torch.rand(512, 32, generator=draws)
    with torch.no_grad():
        losses = [float(ensemble_head_loss(G.train()(eps, labels), labels, weights, biases, shares)) for G in (initial, trained)]
    assert losses[1] < 0.5 * losses[0], losses


def test_the_clients_term_reaches_the_head_only_with_the_gradient_by_hand(digits):
    """H2 in one step (one batch holds the client's data): a generator whose output is one constant feature z
    (fc2's weight 0, its bias z) and counts of class 3 alone make the term α·CE(W z + b, 3), whose gradient is
    (softmax(W z + b) − e_3) zᵀ on W and softmax − e_3 on b. So the head after the step with the term is the one
    without it minus lr·α·that gradient at the broadcast head, and the extractor is the same bit for bit."""
    lr, alpha = 0.05, 2.0
    cfg = hetero_config({**HTFLLIB, "hidden_dim": 8, "generative_alpha": alpha}, clients=["digits_cnn"],
                        **{"local.lr": lr, "local.batch_size": 10_000})  # fmt: skip
    runtime = Simulation(cfg, digits).client_runtime
    g = torch.Generator().manual_seed(3)
    head = torch.randn(HEAD, generator=g) * 0.1
    generator = FeatureGenerator(32, C, D, 8)
    z = torch.randn(D, generator=g)
    with torch.no_grad():
        generator.fc2.weight.zero_()
        generator.fc2.bias.copy_(z)
    counts = torch.zeros(C, dtype=torch.int64)
    counts[3] = 7
    with_term = Message({HEAD_KEY: head, GENERATOR_KEY: get_flat(generator), SUMMED_COUNTS_KEY: counts})
    trained = {}
    for name, msg in (("with", with_term), ("without", Message({HEAD_KEY: head}))):
        context = runtime.context(1, 2, {})
        reply = runtime.algorithm.local_update(context, RoundInfo(2, lr), msg)
        trained[name] = (context.state["model"], reply[HEAD_KEY])
    assert torch.equal(trained["with"][0][:-HEAD], trained["without"][0][:-HEAD])  # the extractor
    weight, bias = head[: D * C].view(C, D), head[D * C :]
    residual = F.softmax(weight @ z + bias, dim=0) - F.one_hot(torch.tensor(3), C).float()
    expected = trained["without"][1] - lr * alpha * torch.cat([torch.outer(residual, z).flatten(), residual])
    torch.testing.assert_close(trained["with"][1], expected, rtol=0, atol=1e-5)


def test_three_architectures_learn_with_the_bytes_of_the_card(digits):
    """Three architectures, 3 rounds: up |S|·(4(dC + C) + 8 + 8C) every round; down |S|·4(dC + C) in round 1 and
    |S|·(4(dC + C) + 4·|G| + 8C) after; the global head is the n_k-weighted mean of the clients' trained heads; the
    clients end well above chance."""
    sim = Simulation(hetero_config({**HTFLLIB, "hidden_dim": 32}, clients=THREE, rounds=3), digits)
    history = sim.run()
    generator = 4 * get_flat(FeatureGenerator(32, C, D, 32)).numel()
    assert [r["bytes_up"] for r in history] == [3 * (4 * HEAD + 8 + 8 * C)] * 3
    assert [r["bytes_down"] for r in history] == [3 * 4 * HEAD] + [3 * (4 * HEAD + generator + 8 * C)] * 2
    sizes = torch.tensor([len(ix) for ix in sim.federation.train_indices], dtype=torch.float64)
    trained = torch.stack([own_models(sim)[cid][-HEAD:].double() for cid in range(3)])
    torch.testing.assert_close(sim.server.state[HEAD_KEY].double(), (sizes / sizes.sum()) @ trained, rtol=0, atol=1e-6)
    assert history[-1]["personal_accuracy"] > 60, [r["personal_accuracy"] for r in history]


def test_resume_after_a_kill_is_bitwise(digits, tmp_path):
    assert_resume_bitwise(digits, tmp_path, {**HTFLLIB, "hidden_dim": 32}, THREE, GENERATOR_KEY)
