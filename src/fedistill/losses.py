"""Loss terms as pure functions (``torch.nn.functional`` style), each citing its card's equation.

Algorithms compose them into the local objective through ``local_sgd(extra_loss=...)``; the invariants
listed in the cards are tested in ``tests/test_losses.py``.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F


def proximal_term(params: Iterable[torch.Tensor], anchors: Iterable[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's proximal penalty ``(μ/2) Σ_P ||P − P_anchor||²`` (spec/fedprox.md §3).

    Summed per tensor in float32 (no concatenation into one vector); ``anchors`` are detached copies of
    the weights received this round, so no gradient reaches them. Its gradient is ``μ (P − P_anchor)``.
    """
    total = None
    for p, a in zip(params, anchors):
        term = (p.float() - a.float()).pow(2).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("proximal_term: no parameters")
    return 0.5 * mu * total


def restricted_softmax_scaling(class_counts: torch.Tensor, alpha: float, mode: str = "binary") -> torch.Tensor:
    """FedRS's per-client logit scaling ``s_k`` (spec/fedrs.md §3).

    ``binary``: 1 for classes the client holds, ``α`` for the others; ``proportional``:
    ``α + (1 − α) n_c / max n``. Values lie in ``[α, 1]``; the most frequent class gets 1.
    """
    counts = class_counts.double()
    if mode == "binary":
        scale = torch.where(counts > 0, torch.ones_like(counts), torch.full_like(counts, alpha))
    elif mode == "proportional":
        scale = alpha + (1.0 - alpha) * counts / counts.max().clamp_min(1.0)
    else:
        raise ValueError(f"unknown FedRS scaling mode {mode!r}")
    return scale.float()


def not_true_distillation(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, labels: torch.Tensor, tau: float
) -> torch.Tensor:
    """FedNTD's not-true distillation ``τ² · mean_b KL(q̃_t || q̃_s)`` (spec/fedntd.md §3).

    The true class is removed before the temperature softmax of both sides, so the true logit gets no
    gradient from this term. ``teacher_logits=None`` is the teacher-free variant (uniform ``q̃_t``).
    Computed in float32.
    """
    s = student_logits.float()
    b, c = s.shape
    keep = torch.ones_like(s, dtype=torch.bool)
    keep[torch.arange(b, device=s.device), labels] = False
    s_nt = s[keep].view(b, c - 1)
    log_q_s = torch.log_softmax(s_nt / tau, dim=1)
    if teacher_logits is None:
        q_t = torch.full_like(log_q_s, 1.0 / (c - 1))
        log_q_t = q_t.log()
    else:
        t_nt = teacher_logits.float()[keep].view(b, c - 1)
        log_q_t = torch.log_softmax(t_nt / tau, dim=1)
        q_t = log_q_t.exp()
    kl = (q_t * (log_q_t - log_q_s)).sum(dim=1)
    return (tau**2) * kl.mean()


def curvature_penalty(params: list[torch.Tensor], p_sum: list[torch.Tensor], q_sum: list[torch.Tensor], lam: float) -> torch.Tensor:
    """FedCurv's penalty in expanded form ``λ (⟨P, w ⊙ w⟩ − 2 ⟨Q, w⟩)`` (spec/fedcurv.md §3).

    Equal to ``λ Σ_j (w − ŵ_j)ᵀ diag(u_j) (w − ŵ_j)`` up to a constant; gradient ``2λ (P ⊙ w − Q)``. No 1/2
    factor (reference code).
    """
    total = None
    for w, p, q in zip(params, p_sum, q_sum):
        w32 = w.float()
        term = (p * w32 * w32).sum() - 2.0 * (q * w32).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("curvature_penalty: no parameters")
    return lam * total


def model_contrastive(z: torch.Tensor, z_global: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON's model-contrastive loss, batch mean of ``−log softmax([sim(z,z_g), sim(z,z_p)]/τ)[0]`` (spec/moon.md §3).

    Cosine similarity with ``ε = 1e-8`` (an all-zero feature gives 0, not NaN); computed in float32.
    """
    z, z_global, z_prev = z.float(), z_global.float(), z_prev.float()
    sims = torch.stack(
        [F.cosine_similarity(z, z_global, dim=1, eps=1e-8), F.cosine_similarity(z, z_prev, dim=1, eps=1e-8)], dim=1
    )
    return F.cross_entropy(sims / tau, torch.zeros(z.shape[0], dtype=torch.long, device=z.device))


def dynamic_regulariser(
    params: list[torch.Tensor], anchors: list[torch.Tensor], linear: list[torch.Tensor], alpha: float
) -> torch.Tensor:
    """FedDyn's client terms ``−⟨g_k, w⟩ + (α/2)||w − w_anchor||²`` (spec/feddyn.md §3).

    ``linear`` holds ``g_k`` split like ``params``. At the anchor the gradient is exactly ``−g_k``.
    """
    inner = sum((g * p.float()).sum() for g, p in zip(linear, params))
    return proximal_term(params, anchors, alpha) - inner


# Finite fill for masked logits: exp underflows to exactly 0, and unlike -inf it never produces 0 * (-inf)
# or NaN gradients through ``where`` (spec/fedlmd.md §3, "stable implementation").
_MASKED = -1e9


def majority_labels(class_counts: torch.Tensor, rule: str = "code") -> torch.Tensor:
    """FedLMD's majority set ``M_k`` as a boolean C-vector (spec/fedlmd.md §3 and ambiguity 1).

    ``code`` (default, reference implementation): ``n_{k,c} > n_k / C`` with the mean over all C classes.
    ``paper``: ``n_{k,c} ≥ n_k / |Y_k|`` with ``Y_k`` the classes the client holds.
    """
    counts = class_counts.double()
    total = counts.sum()
    if rule == "code":
        return counts > total / counts.numel()
    if rule == "paper":
        present = int((counts > 0).sum())
        if present == 0:
            return torch.zeros_like(counts, dtype=torch.bool)
        return (counts > 0) & (counts >= total / present)
    raise ValueError(f"unknown majority rule {rule!r} (code or paper)")


def masked_teacher_log_distribution(
    teacher_logits: torch.Tensor | None, teacher_keep: torch.Tensor, tau: float, like: torch.Tensor | None = None
) -> torch.Tensor:
    """``log p_t`` on ``teacher_keep`` (meaningless elsewhere): tempered masked softmax, or ``−log|A(y)|``.

    The teacher-free target (``teacher_logits=None``) is FedLMD-Tf's ``μ_{k,y}(i) = 1/|A(y)|`` (Eq. 8) and
    FedNTD-Tf's uniform not-true distribution; it is not tempered (spec/fedlmd.md §3).
    """
    if teacher_logits is None:
        ref = like if like is not None else teacher_keep.float()
        support = teacher_keep.sum(dim=1, keepdim=True).clamp_min(1).to(ref.dtype)
        return (-support.log()).expand(teacher_keep.shape)
    return torch.log_softmax((teacher_logits.float() / tau).masked_fill(~teacher_keep, _MASKED), dim=1)


def masked_distillation(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    teacher_keep: torch.Tensor,
    student_keep: torch.Tensor,
    tau: float,
) -> torch.Tensor:
    """``τ² · (1/B) Σ_b KL(p_t || p_s)`` with per-sample supports (spec/fedlmd.md §3, stable form).

    ``p_t`` is the tempered teacher softmax over ``teacher_keep`` (uniform over it when ``teacher_logits`` is
    None, the teacher-free variants), ``p_s`` the tempered student softmax over ``student_keep``; both masks
    are (B, C) booleans and ``teacher_keep ⊆ student_keep`` is expected. Rows with an empty teacher support
    contribute 0 but still count in ``B``. Masked student logits get exactly zero gradient. float32.
    """
    s = student_logits.float()
    log_ps = torch.log_softmax((s / tau).masked_fill(~student_keep, _MASKED), dim=1)
    valid = teacher_keep.any(dim=1)
    log_pt = masked_teacher_log_distribution(teacher_logits, teacher_keep, tau, like=s)
    kl_rows = torch.where(teacher_keep, log_pt.exp() * (log_pt - log_ps), torch.zeros_like(s)).sum(dim=1)
    return (tau**2) * (kl_rows * valid).sum() / s.shape[0]


def label_masking_distillation(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor,
    majority: torch.Tensor,
    tau: float,
) -> torch.Tensor:
    """FedLMD's ``τ² · mean_b ℓ_LMD`` (spec/fedlmd.md §3; paper Eqs. 3-6, code's masks).

    Teacher support ``A(y) = [C] \\ (M_k ∪ {y})``, student support ``S(y) = [C] \\ {y}``; ``majority`` is the
    client's boolean ``M_k``. ``teacher_logits=None`` is FedLMD-Tf: uniform over ``A(y)`` (Eq. 8).
    """
    target = F.one_hot(labels, student_logits.shape[1]).bool()
    teacher_keep = ~(target | majority.to(target.device)[None, :])
    return masked_distillation(student_logits, teacher_logits, teacher_keep, ~target, tau)


def knowledge_distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """Full-softmax KD ``τ² · mean_b KL(p_t || p_s)`` over all classes (FedLMD Table 1's FedAvg+KD)."""
    keep = torch.ones_like(student_logits, dtype=torch.bool)
    return masked_distillation(student_logits, teacher_logits, keep, keep, tau)


def label_smoothing_term(logits: torch.Tensor, labels: torch.Tensor, epsilon: float) -> torch.Tensor:
    """What label smoothing adds to plain CE: ``ε · (mean_b −(1/C) Σ_i log p_i − CE)`` (FedLMD Table 2, FedAvg+LS).

    ``CE + this`` equals ``F.cross_entropy(logits, labels, label_smoothing=ε)`` (PyTorch's
    ``(1−ε)·onehot + ε/C`` target), so label smoothing composes as a loss term. It sees the raw logits: combined
    with a logit transform (FedRS) it smooths those, not the transformed ones the CE sees.
    """
    log_p = torch.log_softmax(logits.float(), dim=1)
    uniform_ce = -log_p.mean(dim=1).mean()
    ce = F.nll_loss(log_p, labels)
    return epsilon * (uniform_ce - ce)
