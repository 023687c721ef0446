"""FedRS (spec/fedrs.md §7) and FedNTD (spec/fedntd.md §7) invariants."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import assert_learns, assert_same_rounds

from fedistill.losses import not_true_distillation, restricted_softmax_scaling


# -- FedRS ---------------------------------------------------------------------------------------
def test_fedrs_with_alpha_one_is_fedavg_step_for_step(make_config, digits):
    assert_same_rounds(make_config(algorithm="fedavg"), make_config(**{"algorithm.name": "fedrs", "algorithm.alpha": 1.0}), digits)


def test_fedrs_client_holding_every_class_trains_like_fedavg(make_config, digits):
    # iid: every client holds all 10 classes, so the binary scaling is all ones for any alpha.
    assert_same_rounds(
        make_config(algorithm="fedavg", **{"partition.scheme": "iid"}),
        make_config(**{"algorithm.name": "fedrs", "algorithm.alpha": 0.1, "partition.scheme": "iid"}),
        digits,
    )


def test_scaling_modes_range_and_agreement():
    counts = torch.tensor([5, 0, 5, 0, 5])
    binary = restricted_softmax_scaling(counts, 0.3, "binary")
    prop = restricted_softmax_scaling(counts, 0.3, "proportional")
    assert torch.allclose(binary, prop) and torch.allclose(binary, torch.tensor([1, 0.3, 1, 0.3, 1]))
    uneven = restricted_softmax_scaling(torch.tensor([8, 2, 0]), 0.5, "proportional")
    assert torch.allclose(uneven, torch.tensor([1.0, 0.625, 0.5]))
    assert float(uneven.min()) >= 0.5 and float(uneven.max()) == 1.0


def test_alpha_zero_gives_missing_classes_zero_gradient():
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 3)
    h, y = torch.randn(6, 4), torch.tensor([0, 2, 0, 2, 2, 0])  # class 1 missing
    scale = restricted_softmax_scaling(torch.bincount(y, minlength=3), 0.0)
    F.cross_entropy(head(h) * scale[None, :], y).backward()
    assert float(head.weight.grad[1].abs().max()) == 0.0 and float(head.bias.grad[1].abs()) == 0.0
    assert float(head.weight.grad[0].abs().max()) > 0.0


# -- FedNTD --------------------------------------------------------------------------------------
def test_ntd_is_zero_for_equal_logits_and_nonnegative():
    z = torch.randn(16, 10)
    y = torch.randint(0, 10, (16,))
    assert abs(float(not_true_distillation(z, z.clone(), y, 2.0))) < 1e-7
    for _ in range(5):
        assert float(not_true_distillation(torch.randn(16, 10), torch.randn(16, 10), y, 1.5)) >= 0.0


def test_ntd_ignores_the_true_logit_and_constant_shifts():
    zs, zt = torch.randn(8, 5, requires_grad=True), torch.randn(8, 5)
    y = torch.randint(0, 5, (8,))
    loss = not_true_distillation(zs, zt, y, 1.0)
    (grad,) = torch.autograd.grad(loss, zs)
    assert float(grad[torch.arange(8), y].abs().max()) == 0.0
    zt2 = zt.clone()
    zt2[torch.arange(8), y] += 5.0
    assert torch.allclose(loss, not_true_distillation(zs, zt2, y, 1.0), atol=1e-6)
    assert torch.allclose(loss, not_true_distillation(zs + 3.0, zt - 2.0, y, 1.0), atol=1e-6)


def test_ntd_vanishes_with_two_classes():
    y = torch.randint(0, 2, (10,))
    assert abs(float(not_true_distillation(torch.randn(10, 2), torch.randn(10, 2), y, 1.0))) < 1e-7


def test_ntd_matches_a_mask_based_computation():
    zs, zt, tau = torch.randn(12, 7), torch.randn(12, 7), 2.0
    y = torch.randint(0, 7, (12,))
    mask = F.one_hot(y, 7).bool()
    ls = torch.log_softmax((zs / tau).masked_fill(mask, -1e9), 1)
    lt = torch.log_softmax((zt / tau).masked_fill(mask, -1e9), 1)
    kl = (lt.exp() * (lt - ls)).masked_fill(mask, 0.0).sum(1).mean() * tau**2
    assert torch.allclose(not_true_distillation(zs, zt, y, tau), kl, atol=1e-6)


def test_teacher_free_variant_matches_its_closed_form():
    zs, y = torch.randn(6, 4), torch.randint(0, 4, (6,))
    keep = ~F.one_hot(y, 4).bool()
    log_q = torch.log_softmax(zs[keep].view(6, 3), 1)
    expected = (-torch.log(torch.tensor(3.0)) - log_q.mean(1)).mean()
    assert torch.allclose(not_true_distillation(zs, None, y, 1.0), expected, atol=1e-6)


def test_fedntd_with_beta_zero_is_fedavg_step_for_step(make_config, digits):
    assert_same_rounds(make_config(algorithm="fedavg"), make_config(**{"algorithm.name": "fedntd", "algorithm.beta": 0.0}), digits)


def test_fedrs_and_fedntd_learn_on_label_skewed_digits(digits):
    assert_learns(digits, "fedrs")
    assert_learns(digits, "fedntd")
    assert_learns(digits, "fedntd", **{"algorithm.teacher_free": True})
