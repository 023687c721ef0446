"""Invariants of the FedICT / FedDKC / FedGKT loss pieces (spec/fedict.md §7, spec/feddkc.md §7, spec/fedgkt.md §7).

Every expected value is computed here independently of the code under test: hand numbers, or the card's
formula written out with plain torch / math.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedistill.losses import (
    distillation_kl,
    distillation_kl_from_probs,
    fpkd_class_weights,
    global_label_distribution,
    kkr_refine,
    label_distribution,
    lka_balance_weights,
    lka_similarity,
    skr_refine,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """Row entropies in bits, written out: −Σ q log₂ q over the positive entries."""
    q = probs.double()
    safe = torch.where(q > 0, q, torch.ones_like(q))
    return -(torch.where(q > 0, q * torch.log2(safe), torch.zeros_like(q))).sum(dim=1)


def _wkl_reference(student_logits, teacher_logits, tau, weights=None):
    """τ² · mean_b Σ_r a_r p_r (log p_r − log q_r) in float64 with plain softmax/log (fedict.md §3)."""
    p = torch.softmax(teacher_logits.double() / tau, dim=1)
    q = torch.softmax(student_logits.double() / tau, dim=1)
    a = torch.ones(p.shape[1], dtype=torch.float64) if weights is None else weights.double()
    return (tau**2) * (a * p * (p.log() - q.log())).sum(dim=1).mean()


# =====================================================================================================
# FedICT §7.1: distribution vectors
# =====================================================================================================


def test_label_distribution_is_the_normalised_histogram():
    labels = torch.tensor([0, 2, 2, 1, 2, 0])
    d = label_distribution(labels, 4)
    assert d.dtype == torch.float64
    assert torch.equal(d, torch.tensor([2 / 6, 1 / 6, 3 / 6, 0.0], dtype=torch.float64))
    assert bool((d >= 0).all())
    assert abs(float(d.sum()) - 1.0) < 1e-15


def test_label_distribution_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        label_distribution(torch.tensor([], dtype=torch.long), 3)
    with pytest.raises(ValueError):
        label_distribution(torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError):
        label_distribution(torch.tensor([-1, 0]), 3)


def test_global_distribution_is_histogram_of_union_and_in_convex_hull():
    g = _gen(1)
    num_classes = 5
    client_labels = [
        torch.randint(0, 3, (7,), generator=g),
        torch.randint(2, 5, (13,), generator=g),
        torch.randint(0, 5, (4,), generator=g),
    ]
    dists = torch.stack([label_distribution(y, num_classes) for y in client_labels])
    counts = torch.tensor([len(y) for y in client_labels])
    for row in dists:
        assert bool((row >= 0).all()) and abs(float(row.sum()) - 1.0) < 1e-12
    d_s = global_label_distribution(dists, counts)
    assert d_s.dtype == torch.float64

    union = [int(v) for y in client_labels for v in y]
    expected = torch.tensor([union.count(c) / len(union) for c in range(num_classes)], dtype=torch.float64)
    assert torch.allclose(d_s, expected, atol=1e-15, rtol=0)
    assert abs(float(d_s.sum()) - 1.0) < 1e-12

    # convex hull: d^S = Σ λ_k d^k with λ_k = N^k / Σ N ≥ 0, Σ λ = 1; hence per class between min and max
    lam = [n / len(union) for n in (7, 13, 4)]
    combo = sum(l * dists[k] for k, l in enumerate(lam))
    assert torch.allclose(d_s, combo, atol=1e-15, rtol=0)
    assert bool((d_s >= dists.min(dim=0).values - 1e-15).all())
    assert bool((d_s <= dists.max(dim=0).values + 1e-15).all())


def test_global_distribution_rejects_zero_total():
    with pytest.raises(ValueError):
        global_label_distribution(torch.full((2, 3), 1 / 3), torch.tensor([0, 0]))


# =====================================================================================================
# FedICT §7.2 / §7.3: FPKD weights w^k and balance weights v^k
# =====================================================================================================


def test_fpkd_weights_match_eq11_and_are_positive_and_order_preserving():
    f = torch.tensor([0.5, 0.1, 0.0, 0.3, 0.1], dtype=torch.float64)
    w = fpkd_class_weights(f, 3.0)
    assert w.dtype == torch.float64
    e = [math.exp(v / 3.0) for v in f.tolist()]
    expected = torch.tensor([v / sum(e) for v in e], dtype=torch.float64)
    assert torch.allclose(w, expected, atol=1e-15, rtol=0)
    assert bool((w > 0).all()) and abs(float(w.sum()) - 1.0) < 1e-15
    for a in range(5):
        for b in range(5):
            if f[a] > f[b]:
                assert w[a] > w[b]
            elif f[a] == f[b]:
                assert w[a] == w[b]
    # the card's bound: max/min ≤ e^{1/3} for T = 3
    assert float(w.max() / w.min()) <= math.exp(1 / 3) + 1e-12


def test_fpkd_infinite_temperature_is_uniform_and_reduces_wkl_to_kl():
    f = torch.tensor([0.6, 0.25, 0.1, 0.05], dtype=torch.float64)
    w = fpkd_class_weights(f, 1e9)
    assert torch.allclose(w, torch.full((4,), 0.25, dtype=torch.float64), atol=1e-6, rtol=0)
    g = _gen(2)
    s, t = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    weighted = distillation_kl(s, t, 3.0, class_weights=w)
    plain = distillation_kl(s, t, 3.0)
    assert torch.allclose(weighted * 4, plain, rtol=1e-5, atol=1e-7)


def test_fpkd_zero_temperature_is_one_hot_argmax():
    f = torch.tensor([0.2, 0.05, 0.45, 0.3], dtype=torch.float64)
    w = fpkd_class_weights(f, 1e-3)
    one_hot = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    assert torch.allclose(w, one_hot, atol=1e-6, rtol=0)


def test_balance_weights_uniform_exactly_when_local_equals_global():
    d = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    v = lka_balance_weights(d, d.clone(), 7.0)
    assert torch.equal(v, torch.full((4,), 1 / 4, dtype=torch.float64))
    d5 = torch.tensor([0.05, 0.15, 0.5, 0.2, 0.1], dtype=torch.float64)
    v5 = lka_balance_weights(d5, d5.clone(), 7.0)
    assert torch.allclose(v5, torch.full((5,), 1 / 5, dtype=torch.float64), atol=1e-16, rtol=0)


def test_balance_weights_match_eq14_and_ordering_rule():
    d_s = torch.tensor([0.25, 0.25, 0.2, 0.3], dtype=torch.float64)
    d_k = torch.tensor([0.5, 0.0, 0.2, 0.3], dtype=torch.float64)
    v = lka_balance_weights(d_s, d_k, 7.0)
    assert v.dtype == torch.float64
    diff = [a - b for a, b in zip(d_s.tolist(), d_k.tolist())]
    e = [math.exp(x / 7.0) for x in diff]
    expected = torch.tensor([x / sum(e) for x in e], dtype=torch.float64)
    assert torch.allclose(v, expected, atol=1e-15, rtol=0)
    assert bool((v > 0).all()) and abs(float(v.sum()) - 1.0) < 1e-15
    for a in range(4):
        for b in range(4):
            assert bool(v[a] > v[b]) == (diff[a] > diff[b])
    assert float(v.max() / v.min()) <= math.exp(2 / 7) + 1e-12


# =====================================================================================================
# FedICT §7.4: LKA similarity s_k
# =====================================================================================================


def test_lka_similarity_hand_values_and_range():
    a = torch.tensor([0.5, 0.5, 0.0])
    b = torch.tensor([1.0, 0.0, 0.0])
    assert lka_similarity(a, b) == pytest.approx(1 / math.sqrt(2), abs=1e-15)
    # 1 up to float64 rounding (the result is clipped to [0, 1], so never above)
    assert lka_similarity(a, a) == pytest.approx(1.0, abs=1e-12)
    assert lka_similarity(a, 3.7 * a) == pytest.approx(1.0, abs=1e-12)
    d_s = torch.tensor([0.2, 0.3, 0.1, 0.4], dtype=torch.float64)
    assert lka_similarity(d_s, d_s.clone()) == pytest.approx(1.0, abs=1e-12)
    assert lka_similarity(d_s, 0.01 * d_s) <= 1.0
    assert lka_similarity(torch.tensor([0.5, 0.5, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.3, 0.7])) == 0.0
    g = _gen(3)
    for _ in range(20):
        x = torch.rand(6, generator=g) * (torch.rand(6, generator=g) > 0.4)
        y = torch.rand(6, generator=g) * (torch.rand(6, generator=g) > 0.4)
        if float(x.sum()) == 0 or float(y.sum()) == 0:
            continue
        dx, dy = x / x.sum(), y / y.sum()
        s = lka_similarity(dx, dy)
        assert isinstance(s, float) and 0.0 <= s <= 1.0
        xd, yd = dx.tolist(), dy.tolist()
        dot = sum(u * v for u, v in zip(xd, yd))
        cosine = dot / (math.sqrt(sum(u * u for u in xd)) * math.sqrt(sum(v * v for v in yd)))
        assert s == pytest.approx(min(cosine, 1.0), abs=1e-14)


def test_lka_similarity_rejects_zero_vector():
    with pytest.raises(ValueError):
        lka_similarity(torch.zeros(3), torch.tensor([1.0, 0.0, 0.0]))


# =====================================================================================================
# FedICT §7.5 / §7.6 and FedGKT §7.2: the (weighted) distillation KL
# =====================================================================================================


def test_distillation_kl_two_class_hand_value():
    # tau = 2, teacher logits (2 ln 3, 0) -> p = (3/4, 1/4); student (0, 0) -> q = (1/2, 1/2)
    # KL(p‖q) = 0.75 ln 1.5 + 0.25 ln 0.5 = 0.13081203594..., times tau² = 4
    teacher = torch.tensor([[2 * math.log(3.0), 0.0]])
    student = torch.zeros(1, 2)
    value = distillation_kl(student, teacher, 2.0)
    assert value.dtype == torch.float32 and value.dim() == 0
    assert float(value) == pytest.approx(0.5232481438, abs=1e-6)
    # class weights a = (2, 0.5): 4 · (2·0.75 ln 1.5 + 0.5·0.25 ln 0.5) = 2.0862170584...
    weighted = distillation_kl(student, teacher, 2.0, class_weights=torch.tensor([2.0, 0.5]))
    assert float(weighted) == pytest.approx(2.0862170584, abs=1e-6)
    # flipping the roles: 4 · KL((1/2,1/2) ‖ (3/4,1/4)) = 4 · 0.1438410362 = 0.5753641449
    flipped = distillation_kl(teacher, student, 2.0)
    assert float(flipped) == pytest.approx(0.5753641449, abs=1e-6)
    assert abs(float(flipped) - float(value)) > 0.05


def test_distillation_kl_matches_card_formula_and_batchmean():
    g = _gen(4)
    s, t = torch.randn(5, 7, generator=g) * 2, torch.randn(5, 7, generator=g) * 2
    w = torch.rand(7, generator=g) + 0.1
    for weights in (None, w):
        got = distillation_kl(s, t, 3.0, class_weights=weights)
        assert float(got) == pytest.approx(float(_wkl_reference(s, t, 3.0, weights)), rel=1e-5, abs=1e-6)
    # batchmean: the batch value is the mean of per-sample values
    rows = torch.stack([distillation_kl(s[i : i + 1], t[i : i + 1], 3.0, class_weights=w) for i in range(5)])
    assert float(distillation_kl(s, t, 3.0, class_weights=w)) == pytest.approx(float(rows.mean()), rel=1e-5)


def test_kl_non_negative_and_zero_for_shifted_teacher():
    """fedgkt §7.2: KL ≥ 0, and 0 when teacher = student + a per-row constant."""
    g = _gen(5)
    for _ in range(10):
        s, t = torch.randn(4, 6, generator=g) * 3, torch.randn(4, 6, generator=g) * 3
        assert float(distillation_kl(s, t, 3.0)) >= 0.0
        assert float(distillation_kl(s, t, 1.0)) >= 0.0
    s = torch.randn(4, 6, generator=g) * 3
    shift = torch.randn(4, 1, generator=g) * 10
    assert abs(float(distillation_kl(s, s + shift, 3.0))) < 1e-5
    assert abs(float(distillation_kl(s, s.clone(), 3.0))) < 1e-7


def test_weighted_kl_zero_when_student_equals_teacher():
    """fedict §7.5: FPKD(p, q = p) = 0 for any weights."""
    g = _gen(6)
    z = torch.randn(3, 5, generator=g)
    w = fpkd_class_weights(torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0]), 3.0)
    assert abs(float(distillation_kl(z, z.clone(), 3.0, class_weights=w))) < 1e-7


def _tilted_target(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w * p) / (w * p).sum()


@pytest.mark.parametrize("kind", ["fpkd", "balance"])
def test_weighted_kl_minimiser_is_tilted_teacher(kind):
    """fedict §7.5: argmin_q WKL(w; p‖q) = w⊙p/Σ(w⊙p); no random candidate beats it."""
    tau = 3.0
    if kind == "fpkd":
        weights = fpkd_class_weights(torch.tensor([0.55, 0.25, 0.15, 0.05], dtype=torch.float64), 0.3)
    else:
        weights = lka_balance_weights(
            torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64),
            torch.tensor([0.7, 0.0, 0.1, 0.2], dtype=torch.float64),
            0.2,
        )
    teacher = torch.tensor([[1.0, -0.5, 0.3, 2.0]])
    p = torch.softmax(teacher.double() / tau, dim=1)[0]
    q_star = _tilted_target(p, weights.double())
    best = float(distillation_kl(tau * q_star.log()[None], teacher, tau, class_weights=weights))
    g = _gen(7)
    candidates = torch.distributions.Dirichlet(torch.ones(4, dtype=torch.float64))
    torch.manual_seed(8)
    for _ in range(200):
        q = candidates.sample()
        value = float(distillation_kl(tau * q.log()[None], teacher, tau, class_weights=weights))
        assert value >= best - 1e-6
    # small perturbations around q* (in logit space) never improve either
    for _ in range(50):
        z = tau * q_star.log()[None] + 0.05 * torch.randn(1, 4, generator=g, dtype=torch.float64)
        assert float(distillation_kl(z, teacher, tau, class_weights=weights)) >= best - 1e-6


@pytest.mark.parametrize("use_weights", [False, True])
def test_weighted_kl_gradient_formula(use_weights):
    """fedict §7.5: ∂/∂z_j [τ² WKL(w; p‖σ_τ(z))] = τ (q_j Σ_r w_r p_r − w_j p_j), summing to 0 over j."""
    tau = 2.5
    g = _gen(9)
    z = torch.randn(1, 6, generator=g).requires_grad_()
    teacher = torch.randn(1, 6, generator=g)
    w = fpkd_class_weights(torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1, 0.0]), 0.5) if use_weights else None
    loss = distillation_kl(z, teacher, tau, class_weights=w)
    loss.backward()
    p = torch.softmax(teacher.double() / tau, dim=1)[0]
    q = torch.softmax(z.detach().double() / tau, dim=1)[0]
    wd = torch.ones(6, dtype=torch.float64) if w is None else w.double()
    expected = tau * (q * (wd * p).sum() - wd * p)
    assert torch.allclose(z.grad[0].double(), expected, atol=1e-6, rtol=1e-5)
    assert abs(float(z.grad.sum())) < 1e-6
    # at the minimiser the gradient vanishes
    z_star = (tau * _tilted_target(p, wd).log()).float()[None].requires_grad_()
    distillation_kl(z_star, teacher, tau, class_weights=w).backward()
    assert float(z_star.grad.abs().max()) < 1e-5


def test_weighted_kl_gradient_scales_with_batch():
    """distillation_kl averages over the batch: a sample's gradient is (1/B) of its single-sample gradient."""
    tau = 3.0
    g = _gen(10)
    z = torch.randn(4, 5, generator=g)
    t = torch.randn(4, 5, generator=g)
    zb = z.clone().requires_grad_()
    distillation_kl(zb, t, tau).backward()
    z0 = z[:1].clone().requires_grad_()
    distillation_kl(z0, t[:1], tau).backward()
    assert torch.allclose(zb.grad[0] * 4, z0.grad[0], atol=1e-6)


def test_no_gradient_reaches_teacher_logits():
    """fedict §7.6, fedgkt §7.5: the teacher is detached."""
    g = _gen(11)
    student = torch.randn(3, 4, generator=g).requires_grad_()
    teacher = torch.randn(3, 4, generator=g).requires_grad_()
    w = torch.tensor([0.1, 0.2, 0.3, 0.4])
    (distillation_kl(student, teacher, 3.0) + distillation_kl(student, teacher, 3.0, class_weights=w)).backward()
    assert teacher.grad is None
    assert student.grad is not None and float(student.grad.abs().sum()) > 0


# =====================================================================================================
# distillation_kl_from_probs (FedDKC server term, feddkc.md §3 and A4)
# =====================================================================================================


def test_from_probs_hand_values_and_zero_entries():
    # teacher (1, 0), student q = (1/2, 1/2): τ² · (1 · ln 2) with τ = 2 → 4 ln 2 = 2.7725887222
    student = torch.zeros(1, 2)
    value = distillation_kl_from_probs(student, torch.tensor([[1.0, 0.0]]), 2.0)
    assert value.dtype == torch.float32 and value.dim() == 0
    assert math.isfinite(float(value))
    assert float(value) == pytest.approx(2.7725887222, abs=1e-6)
    # teacher (3/4, 1/4) used as-is (not re-tempered), student (0,0) at τ = 2: 4 · 0.1308120359 = 0.5232481438
    assert float(distillation_kl_from_probs(student, torch.tensor([[0.75, 0.25]]), 2.0)) == pytest.approx(
        0.5232481438, abs=1e-6
    )


def test_from_probs_equals_logit_version_and_grad_is_finite():
    g = _gen(12)
    s = torch.randn(4, 5, generator=g).requires_grad_()
    t = torch.randn(4, 5, generator=g)
    w = torch.rand(5, generator=g) + 0.5
    probs = torch.softmax(t / 3.0, dim=1)
    a = distillation_kl_from_probs(s, probs, 3.0, class_weights=w)
    b = distillation_kl(s, t, 3.0, class_weights=w)
    assert float(a.detach()) == pytest.approx(float(b.detach()), rel=1e-5, abs=1e-6)
    # a teacher with zero entries gives a finite loss and finite gradients
    sparse = torch.tensor([[0.0, 0.7, 0.0, 0.3, 0.0]] * 4)
    sparse.requires_grad_()
    loss = distillation_kl_from_probs(s, sparse, 3.0)
    log_q = torch.log_softmax(s.detach().double() / 3.0, dim=1)
    sd = sparse.detach().double()
    ref = 9.0 * (sd * (torch.where(sd > 0, sd, torch.ones_like(sd)).log() - log_q)).sum(dim=1).mean()
    assert float(loss.detach()) == pytest.approx(float(ref), rel=1e-5)
    loss.backward()
    assert bool(torch.isfinite(s.grad).all())
    assert sparse.grad is None


# =====================================================================================================
# FedDKC §7.1-3: KKR
# =====================================================================================================


def _kkr_reference_no_fallback(p: torch.Tensor, peak: float) -> torch.Tensor:
    c = p.shape[1]
    m = p.max(dim=1, keepdim=True).values
    return peak - (c * peak - 1) / (c * m - 1) * (m - p)


def test_kkr_basic_properties():
    g = _gen(13)
    logits = torch.randn(16, 10, generator=g) * 0.2
    peak = 0.12
    out = kkr_refine(logits, peak)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    assert bool((out >= 0).all())
    assert torch.allclose(out.sum(dim=1), torch.ones(16), atol=1e-6)
    assert torch.allclose(out.max(dim=1).values, torch.full((16,), peak), atol=1e-7)
    assert torch.equal(out.argmax(dim=1), logits.argmax(dim=1))
    p = torch.softmax(logits.double() / (0.05 * 3.0), dim=1)
    assert bool((p.max(dim=1).values >= peak).all())  # so the affine branch is the one tested
    expected = _kkr_reference_no_fallback(p, peak)
    assert torch.allclose(out.double(), expected, atol=1e-7)


def test_kkr_keeps_ranking_and_is_idempotent_without_fallback():
    scale, tau, peak = 0.05, 3.0, 0.3
    p = torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04], [0.05, 0.1, 0.5, 0.2, 0.1, 0.05]], dtype=torch.float64)
    logits = (scale * tau * p.log()).float()
    out = kkr_refine(logits, peak, scale=scale, tau=tau)
    ref = _kkr_reference_no_fallback(p, peak)
    assert torch.allclose(out.double(), ref, atol=1e-6)
    for i in range(2):
        for a in range(6):
            for b in range(6):
                if p[i, a] > p[i, b]:
                    assert out[i, a] > out[i, b]
                elif p[i, a] == p[i, b]:
                    assert abs(float(out[i, a] - out[i, b])) < 1e-7
    # idempotence: feed logits whose softmax(z/(Sτ)) is the refined vector itself
    again = kkr_refine(scale * tau * out.double().log(), peak, scale=scale, tau=tau)
    assert torch.allclose(again, out, atol=1e-6)


def test_kkr_congruence_different_inputs_same_peak():
    g = _gen(14)
    sharp = torch.randn(3, 10, generator=g) * 5
    flat = torch.randn(3, 10, generator=g) * 0.01
    for kwargs in ({}, {"scale": 1.0}):
        out = kkr_refine(torch.cat([sharp, flat]), 0.12, **kwargs)
        assert torch.allclose(out.max(dim=1).values, torch.full((6,), 0.12), atol=1e-7)


def test_kkr_fallback_uniform_logits_ties_lowest_index():
    c, peak = 10, 0.12
    out = kkr_refine(torch.zeros(2, c), peak)
    expected = torch.full((c,), (1 - peak) / (c - 1), dtype=torch.float64)
    expected[0] = peak
    for row in out:
        assert torch.allclose(row.double(), expected, atol=1e-7)
    # ties among maximal entries go to the lowest index
    tied = torch.tensor([[0.0, 1.0, 1.0, 0.0]]) * 1e-3
    out_tied = kkr_refine(tied, 0.5, scale=1.0, tau=1.0)  # p is near-uniform, p'_min < 0 ⇒ fallback
    assert int(out_tied.argmax()) == 1
    assert float(out_tied[0, 1]) == pytest.approx(0.5, abs=1e-7)


def test_kkr_fallback_card_example():
    """feddkc §7.2: C = 10, T = 0.3, raw p'_10 = −0.0267 ⇒ fallback."""
    p = torch.tensor([0.25, 0.2, 0.2, 0.15, 0.1, 0.05, 0.03, 0.01, 0.005, 0.005], dtype=torch.float64)
    c, peak, scale, tau = 10, 0.3, 0.05, 3.0
    raw_last = ((c * peak - 1) * 0.005 + 0.25 - peak) / (c * 0.25 - 1)
    assert raw_last == pytest.approx(-0.0266667, abs=1e-6)
    out = kkr_refine((scale * tau * p.log())[None], peak, scale=scale, tau=tau)
    expected = torch.full((c,), (1 - peak) / (c - 1), dtype=torch.float64)
    expected[0] = peak
    assert torch.allclose(out[0].double(), expected, atol=1e-7)
    assert abs(float(out.sum()) - 1.0) < 1e-6


def test_kkr_identity_when_peak_already_target():
    q = torch.tensor([[0.3, 0.2, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.3, 0.25, 0.2, 0.05]], dtype=torch.float64)
    for scale, tau in ((0.05, 3.0), (1.0, 1.0)):
        out = kkr_refine(scale * tau * q.log(), 0.3, scale=scale, tau=tau)
        assert torch.allclose(out.double(), q, atol=1e-7)


def test_kkr_rejects_bad_peak_and_has_no_gradient():
    with pytest.raises(ValueError):
        kkr_refine(torch.zeros(1, 10), 0.1)
    with pytest.raises(ValueError):
        kkr_refine(torch.zeros(1, 10), 1.5)
    g = _gen(15)
    z = torch.randn(3, 5, generator=g).requires_grad_()
    out = kkr_refine(z, 0.3)
    assert not out.requires_grad
    o = torch.randn(3, 5, generator=g).requires_grad_()
    distillation_kl_from_probs(o, out, 3.0).backward()
    assert z.grad is None
    assert o.grad is not None


# =====================================================================================================
# FedDKC §7.4, §7.6: SKR
# =====================================================================================================


def _entropy_at(logits: torch.Tensor, s: float) -> torch.Tensor:
    return _entropy_bits(torch.softmax(logits.double() / s, dim=1))


@pytest.mark.parametrize("target", [3.2, 2.5, 1.0])
def test_skr_hits_target_entropy_inside_bracket(target):
    g = _gen(16)
    logits = torch.randn(12, 10, generator=g) * 2
    h_low, h_high = _entropy_at(logits, 1e-4), _entropy_at(logits, 1000.0)
    assert bool((h_low < target).all()) and bool((h_high > target).all())
    out = skr_refine(logits, target)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    assert torch.allclose(out.sum(dim=1), torch.ones(12), atol=1e-6)
    assert float((_entropy_bits(out) - target).abs().max()) <= 1e-4


def test_skr_iteration_count_and_full_precision_mode():
    """tol = 1e-6 on [1e-4, 1000] means 30 halvings; tol = 0 runs all 60 and hits H* also for small s*."""
    g = _gen(20)
    logits = torch.randn(8, 10, generator=g) * 0.05
    target = 1.0
    assert bool((_entropy_at(logits, 1e-4) < target).all()) and bool((_entropy_at(logits, 1000.0) > target).all())
    precise = skr_refine(logits, target, tol=0.0)
    assert float((_entropy_bits(precise) - target).abs().max()) <= 1e-5
    # the default tol gives exactly 30 halvings, as does a tol just above the 30th bracket width
    assert torch.equal(skr_refine(logits, target), skr_refine(logits, target, tol=0.0, max_halvings=30))
    width_30 = 1.0001 * (1000.0 - 1e-4) / 2**30
    assert torch.equal(skr_refine(logits, target, tol=width_30), skr_refine(logits, target, tol=0.0, max_halvings=30))


def test_skr_shift_invariance_and_ranking():
    g = _gen(17)
    logits = torch.randn(6, 8, generator=g) * 2
    shift = torch.randn(6, 1, generator=g) * 20
    a = skr_refine(logits, 2.5)
    b = skr_refine(logits + shift, 2.5)
    assert torch.allclose(a, b, atol=1e-6)
    assert torch.equal(torch.argsort(a, dim=1), torch.argsort(logits, dim=1))


def test_skr_larger_target_gives_flatter_output():
    g = _gen(18)
    logits = torch.randn(5, 10, generator=g) * 2
    outs = [skr_refine(logits, h) for h in (1.0, 2.0, 3.0, 3.3)]
    ents = [_entropy_bits(o) for o in outs]
    peaks = [o.max(dim=1).values for o in outs]
    for lo, hi in zip(ents, ents[1:]):
        assert bool((hi > lo).all())
    for lo, hi in zip(peaks, peaks[1:]):
        assert bool((hi < lo).all())
    # and the found temperatures increase: recover s* from the output's log-ratio against the raw logits
    top, bottom = logits.argmax(dim=1), logits.argmin(dim=1)
    rows = torch.arange(5)
    gap = (logits[rows, top] - logits[rows, bottom]).double()
    temps = [gap / (o[rows, top].double().log() - o[rows, bottom].double().log()) for o in outs]
    for lo, hi in zip(temps, temps[1:]):
        assert bool((hi > lo).all())


def test_skr_clamp_branches():
    # constant row: H ≡ log2 C ⇒ clamp, uniform output whatever the target
    const = torch.full((2, 5), 3.7)
    for target in (1.0, 2.0, 5.0):
        assert torch.allclose(skr_refine(const, target), torch.full((2, 5), 0.2), atol=1e-7)
    # tiny spread: even s = ε₁ is too flat ⇒ s* = ε₁
    tiny = torch.tensor([[0.0, 1e-6, 2e-6]], dtype=torch.float64)
    assert float(_entropy_at(tiny, 1e-4)[0]) > 0.5
    expected_low = torch.softmax(tiny / 1e-4, dim=1)
    assert torch.allclose(skr_refine(tiny, 0.5).double(), expected_low, atol=1e-7)
    # huge spread: even s = ε₂ is too sharp ⇒ s* = ε₂
    huge = torch.tensor([[0.0, 1e4, 2e4]], dtype=torch.float64)
    assert float(_entropy_at(huge, 1000.0)[0]) < 1.5
    expected_high = torch.softmax(huge / 1000.0, dim=1)
    assert torch.allclose(skr_refine(huge, 1.5).double(), expected_high, atol=1e-7)
    # a target above log2 C is out of reach ⇒ s* = ε₂
    z = torch.tensor([[0.0, 1.0, 2.0]])
    assert torch.allclose(skr_refine(z, 2.0).double(), torch.softmax(z.double() / 1000.0, dim=1), atol=1e-7)


def test_skr_has_no_gradient():
    g = _gen(19)
    z = torch.randn(3, 6, generator=g).requires_grad_()
    out = skr_refine(z, 2.0)
    assert not out.requires_grad
    o = torch.randn(3, 6, generator=g).requires_grad_()
    distillation_kl_from_probs(o, out, 3.0).backward()
    assert z.grad is None and o.grad is not None


def test_the_authors_linear_weights_are_the_card_options():
    """Card A4/A5: the code's FPKD weights d^k/T and balance weights (d^S − d^k)/U, written out."""
    d_k = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    d_s = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    assert fpkd_class_weights(d_k, 3.0, "linear").tolist() == pytest.approx([0.5 / 3, 0.1, 0.2 / 3, 0.0])
    v = lka_balance_weights(d_s, d_k, 7.0, "linear")
    assert v.tolist() == pytest.approx([-0.25 / 7, -0.05 / 7, 0.05 / 7, 0.25 / 7])
    assert bool((v < 0).any())  # why the card keeps the softmax by default: a negative weight, an unbounded loss
    with pytest.raises(ValueError, match="form"):
        fpkd_class_weights(d_k, 3.0, "cubic")
