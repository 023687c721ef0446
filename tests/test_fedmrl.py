"""FedMRL (``fedmrl``): a shared small model fused with each private model by a private projector into nested
representations (spec/fedmrl.md §8). Expected values are the card's numbers on tiny tensors or what the test
computes itself from the clients' state: the shared feature put second, a head on the wrong slice, a projector
that is kept where HtFLlib resets it (or the reverse), a count weighting for the plain mean fails."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_resume_bitwise, hetero_config, own_model_accuracies, own_models
from torch import nn

from fedistill.algorithms.build import make_algorithm
from fedistill.algorithms.fedmrl import FusedPredictor, initial_projector
from fedistill.config import build_config
from fedistill.errors import ConfigError
from fedistill.losses import matryoshka_loss
from fedistill.models.flat import get_flat, num_flat, set_flat
from fedistill.protocol import Message, RoundInfo, ServerContext
from fedistill.simulation import Simulation

THREE = ["digits_cnn", "resnet8", "logistic"]  # private models, each with a 64-wide feature on 8x8 digits
SMALL = {"model.shared": "ht_mlp", "algorithm.sub_feature_dim": 16}  # a shared model that takes feature_dim


class Fixed(nn.Module):
    """A model whose feature is a constant row and whose head is a given Linear (for the card's tiny example)."""

    def __init__(self, feature: list[float], head: nn.Linear) -> None:
        super().__init__()
        self.feature, self.classifier = torch.tensor([feature]), head

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return self.feature.expand(x.shape[0], -1)


def card_example() -> FusedPredictor:
    """Invariants 1-2: g_ex(x) = [1], e_k(x) = [0, 2]; A = [[1,0,0],[0,0,1]], c = 0; g_hd = [[1],[−1]]; h_k = I."""
    shared_head, private_head, projector = nn.Linear(1, 2), nn.Linear(2, 2), nn.Linear(3, 2)
    with torch.no_grad():
        shared_head.weight.copy_(torch.tensor([[1.0], [-1.0]])), shared_head.bias.zero_()
        private_head.weight.copy_(torch.eye(2)), private_head.bias.zero_()
        projector.weight.copy_(torch.tensor([[1.0, 0, 0], [0, 0, 1.0]])), projector.bias.zero_()
    return FusedPredictor(Fixed([0.0, 2.0], private_head), Fixed([1.0], shared_head), projector, s=1)


def test_the_card_example_shapes_order_loss_and_gradient_routing():
    """v = [1, 0, 2] (shared first), m = [1, 2], u = [1, −1], z = [1, 2]; L = ln(1 + e) + ln(1 + e^−2) = 1.440190;
    the shared head's gradient is CE(u)'s alone, the private head's CE(z)'s alone; the projector's first row gets
    both heads' gradients, its second only CE(z)'s."""
    fused, x, y = card_example(), torch.zeros(1, 5), torch.tensor([0])
    m = fused.fused(x)
    assert m.tolist() == [[1.0, 2.0]]
    z, u = fused.private.classifier(m), fused.shared.classifier(m[:, :1])
    assert z.tolist() == [[1.0, 2.0]] and u.tolist() == [[1.0, -1.0]]
    loss = matryoshka_loss(z, u, y)
    assert float(loss.detach()) == pytest.approx(math.log(1 + math.e) + math.log(1 + math.exp(-2)), abs=1e-6)
    loss.backward()
    p_u, p_z = torch.softmax(u.detach(), 1)[0], torch.softmax(z.detach(), 1)[0]
    du, dz = p_u - torch.tensor([1.0, 0.0]), p_z - torch.tensor([1.0, 0.0])  # ∂CE/∂logits
    torch.testing.assert_close(fused.shared.classifier.weight.grad, du[:, None] * m.detach()[0, :1])
    torch.testing.assert_close(fused.private.classifier.weight.grad, dz[:, None] * m.detach()[0])
    dm = dz.clone()  # ∂L/∂m: the private head's pull on both dims, the shared head's on the first
    dm[0] += float(du @ fused.shared.classifier.weight[:, 0].detach())
    torch.testing.assert_close(fused.projector.weight.grad, dm[:, None] * torch.tensor([[1.0, 0.0, 2.0]]))
    assert fused(x).tolist() == [[1.0, 2.0]]  # inference: the private head on the whole representation


def test_the_server_mean_is_plain_and_samples_weighting_is_an_option():
    """Invariant 5: [1, 2] and [3, 6] of clients with 1 and 99 samples give [2, 4]; by samples [2.98, 5.96]."""
    for weighting, expected in (("uniform", [2.0, 4.0]), ("samples", [2.98, 5.96])):
        algorithm = make_algorithm(build_config({"algorithm": {"name": "fedmrl", "weighting": weighting}}))
        server = ServerContext(model=nn.Module(), state={}, generator=torch.Generator(), num_classes=2, shared_initial=torch.zeros(2))
        algorithm.init_server(server)
        replies = {0: Message(shared=torch.tensor([1.0, 2.0]), num_samples=1), 1: Message(shared=torch.tensor([3.0, 6.0]), num_samples=99)}
        algorithm.aggregate(server, RoundInfo(1, 0.01), replies)
        assert algorithm.broadcast(server, RoundInfo(2, 0.01), 0)["shared"].tolist() == pytest.approx(expected)


@pytest.mark.parametrize("keep", [False, True])
def test_the_projector_is_reset_every_round_by_default_and_kept_on_request(digits, keep):
    """Invariant 4: by default (HtFLlib) a client starts every round, and is evaluated, with its initial projector
    P_k^0 although training moved it; with keep_projector the next round starts from the trained one."""
    cfg = hetero_config({"name": "fedmrl", "keep_projector": keep}, clients=["digits_cnn"], **{**SMALL, "local.lr": 0.1})
    runtime = Simulation(cfg, digits).client_runtime
    shared = get_flat(runtime.shared_worker).clone()
    state: dict = {}
    runtime.algorithm.local_update(runtime.context(0, 1, state), RoundInfo(1, 0.1), Message(shared=shared))
    trained = get_flat(runtime.algorithm._projectors[(16, 64)]).clone()
    context = runtime.context(0, 2, state)
    p0 = initial_projector(context, 16, 64)
    assert not torch.equal(trained, p0)
    runtime.algorithm.assemble_personal_model(context, Message(shared=shared))
    loaded = get_flat(runtime.algorithm.personal_predictor(context).projector)
    assert torch.equal(loaded, trained if keep else p0)
    assert ("projector" in state) == keep


def test_three_architectures_bytes_and_the_fused_accuracy(digits):
    """Invariants 6-7: the shared model (ht_mlp with a 16-wide feature) is what travels, 4|ψ| each way per client;
    the personal accuracy is argmax h_k(P_k^0([g_ex(x; ψ_t); e_k(x)])) computed here from the stores; zeroing
    the global shared head leaves it unchanged (inference never reads it)."""
    sim = Simulation(hetero_config("fedmrl", clients=THREE, **SMALL), digits)
    history = sim.run()
    shared_worker = sim.client_runtime.shared_worker
    assert shared_worker.feature_dim == 16
    size = num_flat(shared_worker)
    assert [r["bytes_up"] for r in history] == [3 * 4 * size] * 2 and [r["bytes_down"] for r in history] == [3 * 4 * size] * 2
    psi, fed = sim.server.state["shared"], sim.federation
    without_head = psi.clone()
    without_head[-(16 * 10 + 10) :] = 0.0  # the shared head is the model's last parameters (classifier)
    for global_shared in (psi, without_head):
        accuracies = []
        for cid, name in enumerate(THREE):
            private = sim.client_runtime.worker_for(name)
            set_flat(private, own_models(sim)[cid])
            set_flat(shared_worker, global_shared)
            projector = nn.Linear(16 + 64, 64)
            set_flat(projector, initial_projector(sim.client_runtime.context(cid, 3, {}), 16, 64))
            for module in (private, shared_worker, projector):
                module.eval()
            with torch.no_grad():
                x, y = next(sim.client_runtime.pipeline.test_batches_of(fed.test_indices[cid], 10_000))
                logits = private.classifier(projector(torch.cat([shared_worker.extract(x), private.extract(x)], 1)))
                accuracies.append(100.0 * float((logits.argmax(1) == y).double().mean()))
        assert history[-1]["personal_accuracies"] == pytest.approx(accuracies)


def test_s_defaults_to_128_capped_by_the_narrowest_private_feature(digits):
    """Unset, s is HtFLlib's 128, or the narrowest private feature where that is narrower: 64 on the digit models,
    so the default shared model (the first member, digits_cnn, 64 wide without a feature_dim option) fits."""
    sim = Simulation(hetero_config("fedmrl", clients=THREE, rounds=1), digits)
    assert sim.client_runtime.algorithm._s == 64 and sim.client_runtime.shared_worker.feature_dim == 64
    assert sim.run()[-1]["bytes_up"] > 0
    wide = Simulation(hetero_config("fedmrl", clients=["ht_mlp"], rounds=1), digits)
    assert wide.client_runtime.shared_worker.feature_dim == 128  # ht_mlp is 512 wide: HtFLlib's s


def test_assignments_it_cannot_train_are_refused_in_one_line(digits):
    with pytest.raises(ConfigError, match="at least as wide"):  # s = 128 > the private models' 64
        Simulation(hetero_config("fedmrl", clients=THREE, **{"model.shared": "ht_mlp", "algorithm.sub_feature_dim": 128}), digits)
    with pytest.raises(ConfigError, match="16-wide feature"):  # digits_cnn has no feature_dim option
        Simulation(hetero_config("fedmrl", clients=THREE, **{"algorithm.sub_feature_dim": 16}), digits)


def test_the_paper_variant():
    params = make_algorithm(build_config({"algorithm": {"name": "fedmrl", "variant": "paper"}})).params
    assert params.resolved() == (True, "samples", 50.0)
    assert make_algorithm(build_config({"algorithm": {"name": "fedmrl"}})).params.resolved() == (False, "uniform", None)


def test_resume_after_a_kill_is_bitwise(digits, tmp_path):
    assert_resume_bitwise(digits, tmp_path, "fedmrl", THREE, "shared", **{**SMALL, "algorithm.keep_projector": True})
