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
