"""FedAdam invariants from spec/fmtl-baselines.md §2."""

from __future__ import annotations

import torch
from conftest import assert_learns, assert_resume_is_exact

from fedistill.algorithms.aggregate import ServerAdam
from fedistill.algorithms.base import Message, RoundInfo, ServerContext
from fedistill.algorithms.fedadam import FedAdam
from fedistill.config import LocalConfig
from fedistill.models.flat import get_flat, set_flat, trainable_mask
from fedistill.models import build_model


def _adam(beta1=0.9, beta2=0.99, tau=1e-3, lr=0.1, n=4):
    return ServerAdam(lr, beta1, beta2, tau)


def test_zero_betas_and_tau_move_each_coordinate_by_lr_times_sign():
    opt, state = _adam(beta1=0.0, beta2=0.0, tau=0.0), {}
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    agg = g + torch.tensor([0.5, -0.01, 3.0, -2.0])
    new = opt.step(state, g, agg)
    assert torch.allclose(new, g + 0.1 * torch.tensor([1.0, -1.0, 1.0, -1.0]))


def test_zero_change_leaves_the_model_unchanged():
    opt = _adam()
    g = torch.randn(4)
    assert torch.equal(opt.step({}, g, g.clone()), g)


def test_common_rescaling_of_client_changes_does_not_change_the_step_when_tau_is_zero():
    g = torch.randn(4)
    d = torch.randn(4)
    a = _adam(tau=0.0).step({}, g, g + d)
    b = _adam(tau=0.0).step({}, g, g + 7.0 * d)
    assert torch.allclose(a, b, atol=1e-6)


def test_two_rounds_follow_adam_without_bias_correction_by_hand():
    opt, state = _adam(beta1=0.5, beta2=0.5, tau=0.1, lr=1.0, n=1), {}
    g0 = torch.tensor([0.0])
    g1 = opt.step(state, g0, torch.tensor([1.0]))  # d=1: m=0.5, v=0.5 -> 0.5/(0.7071+0.1)
    assert torch.allclose(g1, torch.tensor([0.5 / (0.5**0.5 + 0.1)]))
    d2 = 2.0 - float(g1)
    g2 = opt.step(state, g1, torch.tensor([2.0]))
    m, v = 0.25 + 0.5 * d2, 0.25 + 0.5 * d2**2
    assert torch.allclose(g2, g1 + m / (v**0.5 + 0.1))


def test_batchnorm_statistics_take_the_aggregate():
    # ServerAdam steps every entry; FedAvg.aggregate gives the BatchNorm statistics the plain mean.
    model = build_model("resnet8", (3, 8, 8), 10)
    mask = trainable_mask(model)
    assert int(mask.sum()) == sum(p.numel() for p in model.parameters())
    algorithm = FedAdam(FedAdam.Params(server_lr=0.1), LocalConfig())
    server = ServerContext(model, {}, torch.Generator(), 10)
    set_flat(model, torch.zeros(mask.numel()))
    agg = torch.ones(mask.numel())
    algorithm.aggregate(server, RoundInfo(1, 0.1), {0: Message(weights=agg, num_samples=5)})
    new = get_flat(model)
    assert torch.equal(new[~mask], agg[~mask]) and not torch.equal(new[mask], agg[mask])


def test_fedadam_learns_and_resumes_exactly(digits, tmp_path):
    assert_resume_is_exact(digits, tmp_path, "fedadam", server_keys=("adam_m", "adam_v"), **{"algorithm.server_lr": 0.03})
    assert_learns(digits, "fedadam", **{"algorithm.server_lr": 0.03})
