"""LG-FedAvg (``lg_fedavg``): private extractors, one shared head averaged by FedAvg (spec/lg-fedavg.md §8).
Expected values come from the card's formulas on tiny tensors or from what the test reads off the clients and
off FedAvg and Local runs of the same setup: a count weighting for a uniform one (or the reverse), a sum for a
mean, an extractor that travels or a head that is not replaced fails."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_resume_bitwise, hetero_config, own_model_accuracies, own_models

from fedistill.algorithms.build import make_algorithm
from fedistill.algorithms.lg_fedavg import get_shared, set_shared
from fedistill.config import build_config
from fedistill.errors import ConfigError
from fedistill.models.flat import get_flat, set_flat
from fedistill.protocol import Message, RoundInfo, ServerContext
from fedistill.simulation import Simulation

THREE = ["digits_cnn", "resnet8", "logistic"]  # three families, each with a 64-wide feature on 8x8 digits
HEAD = 64 * 10 + 10


def server_mean(params: dict, heads: dict[int, tuple[list, list, int]]) -> torch.Tensor:
    """The server's global head after one aggregation of ``heads`` ({cid: (W rows, b, n_k)})."""
    algorithm = make_algorithm(build_config({"algorithm": {"name": "lg_fedavg", **params}}))
    server = ServerContext(model=torch.nn.Module(), state={}, generator=torch.Generator(), num_classes=2, feature_dim=1)
    algorithm.init_server(server)
    replies = {
        cid: Message(lg_shared=torch.tensor([*sum(w, []), *b]), num_samples=n) for cid, (w, b, n) in heads.items()
    }  # fmt: skip
    algorithm.aggregate(server, RoundInfo(1, 0.01), replies)
    return algorithm.broadcast(server, RoundInfo(2, 0.01), 0)["lg_shared"]


def test_the_server_mean_is_sample_weighted_by_hand():
    """Invariant 2: W_A = [[1],[0]], b_A = [0, 0], n_A = 1 and W_B = [[3],[4]], b_B = [2, 2], n_B = 3 give
    W = [[2.5],[3]], b = [1.5, 1.5]; uniform weighting gives [[2],[2]], [1, 1]."""
    heads = {0: ([[1.0], [0.0]], [0.0, 0.0], 1), 1: ([[3.0], [4.0]], [2.0, 2.0], 3)}
    assert server_mean({}, heads).tolist() == [2.5, 3.0, 1.5, 1.5]
    assert server_mean({"weighting": "uniform"}, heads).tolist() == [2.0, 2.0, 1.0, 1.0]


def test_the_client_trains_from_the_broadcast_head_and_uploads_only_the_head(digits):
    """Invariants 1, 3 and 5 on one client: with lr = 0 the uploaded head is the broadcast one bit for bit and the
    extractor is the client's own; with lr > 0 the upload is the head of the client's trained model, the message
    holds 4(dC + C) + 8 bytes (the head and n_k), and the kept model is that trained model."""
    cfg = hetero_config("lg_fedavg", clients=["digits_cnn"], **{"local.lr": 0.0})
    runtime = Simulation(cfg, digits).client_runtime
    head = torch.randn(HEAD, generator=torch.Generator().manual_seed(2))
    context = runtime.context(1, 1, {})
    reply = runtime.algorithm.local_update(context, RoundInfo(1, 0.0), Message(lg_shared=head))
    assert torch.equal(reply["lg_shared"], head) and reply["num_samples"] == context.num_samples
    assert reply.nbytes() == 4 * HEAD + 8
    own = context.state["model"]
    assert torch.equal(own[: own.numel() - HEAD], context.initial_weights[: own.numel() - HEAD])

    trained = runtime.context(1, 1, {})
    reply = runtime.algorithm.local_update(trained, RoundInfo(1, 0.05), Message(lg_shared=head))
    model = runtime.worker_for("digits_cnn")
    set_flat(model, trained.state["model"])
    assert torch.equal(reply["lg_shared"], get_flat(model.classifier)) and not torch.equal(reply["lg_shared"], head)


def test_one_architecture_differs_from_fedavg_exactly_in_the_extractors(digits):
    """Invariant 4: one architecture, the same initial weights, batches and sample weights. After round 1 the
    global head is the head of FedAvg's global model, and each client's extractor is what Local's round 1 made
    of it (its own training, not FedAvg's average). The paper form sharing the top layer (the head) is used so
    that round 1 starts from the clients' one initial model, as FedAvg does."""
    same = {"rounds": 1, "local.lr": 0.05, "local.momentum": 0.0, "local.batch_size": 10, "local.weight_decay": 0.0,
            "partition.per_client_test": True, "model.name": "digits_cnn"}  # fmt: skip
    lg = Simulation(hetero_config({"name": "lg_fedavg", "variant": "paper", "num_layers_keep": 1, "weighting": "samples"}, **same), digits)
    lg.run()
    fedavg = Simulation(hetero_config("fedavg", **same), digits)
    fedavg.run()
    alone = Simulation(hetero_config("local_only", **same), digits)
    alone.run()
    global_model = get_flat(fedavg.server.model)
    torch.testing.assert_close(lg.server.state["lg_shared"], global_model[-HEAD:], rtol=0, atol=1e-6)
    lg_models, alone_models = own_models(lg), own_models(alone)
    for cid in range(3):
        assert torch.equal(lg_models[cid][:-HEAD], alone_models[cid][:-HEAD])  # the extractor stayed local
        assert not torch.allclose(lg_models[cid][:-HEAD], global_model[:-HEAD])


def test_evaluation_uses_the_global_head_not_the_trained_one(digits):
    """Invariant 6: assembled with a zero head, every prediction is class 0 whatever the client's trained head."""
    sim = Simulation(hetero_config("lg_fedavg", clients=THREE), digits)
    sim.run()
    runtime = sim.client_runtime
    client = runtime.context(0, 3, sim.server_runtime.client_store.load(0))
    runtime.algorithm.assemble_personal_model(client, Message(lg_shared=torch.zeros(HEAD)))
    with torch.no_grad():
        x, _ = runtime.pipeline.clean_batch(sim.federation.test_indices[0])
        predictor = runtime.algorithm.personal_predictor(client)
        predictor.eval()
        assert bool((predictor(x).argmax(1) == 0).all())


def test_three_architectures_bytes_and_the_head_accuracy(digits):
    """One run of three architectures: bytes up |S|·(4(dC + C) + 8), down |S|·4(dC + C) every round; the
    global head is the n_k-weighted mean of the clients' trained heads; the personal accuracy is each client's
    own extractor with the new global head on its own test split."""
    sim = Simulation(hetero_config("lg_fedavg", clients=THREE), digits)
    history = sim.run()
    assert [r["bytes_up"] for r in history] == [3 * (4 * HEAD + 8)] * 2
    assert [r["bytes_down"] for r in history] == [3 * 4 * HEAD] * 2
    fed, head = sim.federation, sim.server.state["lg_shared"]
    sizes = torch.tensor([len(ix) for ix in fed.train_indices], dtype=torch.float64)
    trained = torch.stack([own_models(sim)[cid][-HEAD:].double() for cid in range(3)])
    torch.testing.assert_close(head.double(), (sizes / sizes.sum()) @ trained, rtol=0, atol=1e-6)
    accuracies = own_model_accuracies(sim, THREE, lambda cid, model: set_flat(model.classifier, head))
    assert history[-1]["personal_accuracies"] == pytest.approx(accuracies)


def test_the_paper_form_shares_the_top_layers_and_refuses_several_architectures(digits):
    """variant=paper: the shared vector is the last num_layers_keep parameterised layers (here digits_cnn's top
    two, its hidden layer and head) and set_shared puts it back where get_shared read it; several architectures
    are refused before any work, in one line."""
    algorithm = make_algorithm(build_config({"algorithm": {"name": "lg_fedavg", "variant": "paper", "num_layers_keep": 2}}))
    sim = Simulation(hetero_config({"name": "lg_fedavg", "variant": "paper", "num_layers_keep": 2}, **{"model.name": "digits_cnn"}), digits)
    model = sim.client_runtime.worker_for("digits_cnn")
    layers = [m for m in model.modules() if not list(m.children()) and list(m.parameters(recurse=False))]
    expected = torch.cat([get_flat(m) for m in layers[-2:]])
    assert torch.equal(get_shared(model, algorithm.params), expected)
    set_shared(model, algorithm.params, torch.zeros_like(expected))
    assert all(float(p.detach().abs().sum()) == 0 for m in layers[-2:] for p in m.parameters())
    assert any(float(p.detach().abs().sum()) > 0 for p in layers[0].parameters())
    with pytest.raises(ConfigError, match="same architecture"):
        Simulation(hetero_config({"name": "lg_fedavg", "variant": "paper"}, clients=THREE), digits)


def test_resume_after_a_kill_is_bitwise(digits, tmp_path):
    assert_resume_bitwise(digits, tmp_path, "lg_fedavg", THREE, "lg_shared")
