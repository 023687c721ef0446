"""Loss terms as pure functions (``torch.nn.functional`` style), each citing its card's equation.

Algorithms compose them into the local objective through ``local_sgd(extra_loss=...)``; the invariants
listed in the cards are tested in ``tests/test_losses.py``.

Length (over the ~500-line guide of ARCHITECTURE.md): the losses are pure functions (DESIGN.md) with their
invariants tested against this one module; sections follow the methods.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

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
    student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, labels: torch.Tensor, tau: float,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """FedNTD's not-true distillation ``τ² · mean_b KL(q̃_t || q̃_s)`` (spec/fedntd.md §3).

    The true class is removed before the temperature softmax of both sides, so the true logit gets no
    gradient from this term. ``teacher_logits=None`` is the teacher-free variant (uniform ``q̃_t``).
    Computed in float32.
    """
    s = student_logits.float()
    b, c = s.shape
    # Row i's not-true classes in order: j for j < y_i, j + 1 from y_i on. A gather, not a boolean-mask index,
    # so the shape is known without reading the mask back (no host wait; a CUDA graph can capture it).
    not_true = torch.arange(c - 1, device=s.device).expand(b, c - 1)
    not_true = not_true + (not_true >= labels[:, None]).long()
    s_nt = s.gather(1, not_true)
    log_q_s = torch.log_softmax(s_nt / tau, dim=1)
    if teacher_logits is None:
        q_t = torch.full_like(log_q_s, 1.0 / (c - 1))
        log_q_t = q_t.log()
    else:
        t_nt = teacher_logits.float().gather(1, not_true)
        log_q_t = torch.log_softmax(t_nt / tau, dim=1)
        q_t = log_q_t.exp()
    kl = (q_t * (log_q_t - log_q_s)).sum(dim=1)
    return (tau**2) * (kl.mean() if weights is None else row_mean(kl, weights))


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


def model_contrastive(
    z: torch.Tensor, z_global: torch.Tensor, z_prev: torch.Tensor, tau: float, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """MOON's model-contrastive loss, batch mean of ``−log softmax([sim(z,z_g), sim(z,z_p)]/τ)[0]`` (spec/moon.md §3).

    Cosine similarity with ``ε = 1e-8`` (an all-zero feature gives 0, not NaN); computed in float32. ``weights``:
    row weights of the mean (:func:`row_mean`; a cohort step's padded rows).
    """
    z, z_global, z_prev = z.float(), z_global.float(), z_prev.float()
    sims = torch.stack(
        [F.cosine_similarity(z, z_global, dim=1, eps=1e-8), F.cosine_similarity(z, z_prev, dim=1, eps=1e-8)], dim=1
    )
    target = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    if weights is None:
        return F.cross_entropy(sims / tau, target)
    return row_mean(F.cross_entropy(sims / tau, target, reduction="none"), weights)


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
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``τ² · (1/B) Σ_b KL(p_t || p_s)`` with per-sample supports (spec/fedlmd.md §3, stable form).

    ``p_t`` is the tempered teacher softmax over ``teacher_keep`` (uniform over it when ``teacher_logits`` is
    None, the teacher-free variants), ``p_s`` the tempered student softmax over ``student_keep``; both masks
    are (B, C) booleans and ``teacher_keep ⊆ student_keep`` is expected. Rows with an empty teacher support
    contribute 0 but still count in ``B``. Masked student logits get exactly zero gradient. float32.
    ``weights`` (B,): row weights, ``Σ_b w_b KL_b / Σ_b w_b`` (a cohort step's padded rows have weight 0).
    """
    s = student_logits.float()
    log_ps = torch.log_softmax((s / tau).masked_fill(~student_keep, _MASKED), dim=1)
    valid = teacher_keep.any(dim=1)
    log_pt = masked_teacher_log_distribution(teacher_logits, teacher_keep, tau, like=s)
    kl_rows = torch.where(teacher_keep, log_pt.exp() * (log_pt - log_ps), torch.zeros_like(s)).sum(dim=1)
    return (tau**2) * row_mean(kl_rows * valid, weights)


def row_mean(rows: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The batch mean of per-row values, or with ``weights`` the weighted mean ``Σ w_b r_b / Σ w_b`` (0 when every
    weight is 0): how a cohort step (engine/cohort.py) keeps its padded rows out of a loss term's mean."""
    if weights is None:
        return rows.sum() / rows.shape[0]
    return (rows * weights).sum() / weights.sum().clamp_min(1.0)


def label_masking_distillation(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor,
    majority: torch.Tensor,
    tau: float,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """FedLMD's ``τ² · mean_b ℓ_LMD`` (spec/fedlmd.md §3; paper Eqs. 3-6, code's masks).

    Teacher support ``A(y) = [C] \\ (M_k ∪ {y})``, student support ``S(y) = [C] \\ {y}``; ``majority`` is the
    client's boolean ``M_k``. ``teacher_logits=None`` is FedLMD-Tf: uniform over ``A(y)`` (Eq. 8).
    """
    # a comparison, not F.one_hot (which reads the labels' range back to the host, and so cannot run under vmap)
    target = labels[:, None] == torch.arange(student_logits.shape[1], device=labels.device)[None, :]
    teacher_keep = ~(target | majority.to(target.device)[None, :])
    return masked_distillation(student_logits, teacher_logits, teacher_keep, ~target, tau, weights)


def knowledge_distillation(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Full-softmax KD ``τ² · mean_b KL(p_t || p_s)`` over all classes (FedLMD Table 1's FedAvg+KD)."""
    keep = torch.ones_like(student_logits, dtype=torch.bool)
    return masked_distillation(student_logits, teacher_logits, keep, keep, tau, weights)


def label_smoothing_term(logits: torch.Tensor, labels: torch.Tensor, epsilon: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """What label smoothing adds to plain CE: ``ε · (mean_b −(1/C) Σ_i log p_i − CE)`` (FedLMD Table 2, FedAvg+LS).

    ``CE + this`` equals ``F.cross_entropy(logits, labels, label_smoothing=ε)`` (PyTorch's
    ``(1−ε)·onehot + ε/C`` target), so label smoothing composes as a loss term. It sees the raw logits: combined
    with a logit transform (FedRS) it smooths those, not the transformed ones the CE sees.
    """
    log_p = torch.log_softmax(logits.float(), dim=1)
    if weights is None:
        uniform_ce = -log_p.mean(dim=1).mean()
        ce = F.nll_loss(log_p, labels)
        return epsilon * (uniform_ce - ce)
    rows = -log_p.mean(dim=1) + log_p.gather(1, labels[:, None])[:, 0]  # uniform CE − CE, per row
    return epsilon * row_mean(rows, weights)


# -- FedFTG: server-side data-free fine-tuning (spec/fedftg.md §3) ---------------------------------
def customized_label_distribution(label_counts: torch.Tensor) -> torch.Tensor:
    """FedFTG's customized label distribution (Eq. 9): ``p_t(y) = Σ_k n_k^y / Σ_k Σ_y' n_k^y'``.

    ``label_counts`` is the (K, M) matrix of the selected clients' class counts; returns the (M,) float64
    distribution. ``p_t(y) = 0`` exactly where no selected client holds class y.
    """
    pooled = label_counts.double().sum(dim=0)
    total = pooled.sum()
    if total <= 0:
        raise ValueError("customized_label_distribution: the selected clients hold no samples")
    return pooled / total


def class_ensemble_weights(label_counts: torch.Tensor) -> torch.Tensor:
    """FedFTG's class-level ensemble weights (Eq. 10): ``α^{k,y} = n_k^y / Σ_{i∈S_t} n_i^y``.

    ``label_counts`` is (K, M); returns (K, M) float32 whose columns sum to 1. A class that no selected client
    holds (reachable only with uniform label sampling) gets ``α^{k,y} = 1/K`` (card §3 (c), the zero-count
    rule) instead of a 0/0. Computed in float64.
    """
    counts = label_counts.double()
    pooled = counts.sum(dim=0, keepdim=True)
    uniform = torch.full_like(counts, 1.0 / counts.shape[0])
    return torch.where(pooled > 0, counts / pooled.clamp_min(1.0), uniform).float()


def stratified_labels(n: int, class_counts: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """FedFTG's ``StratifiedLabels(N, c)`` (card §4 and ambiguity 7): N labels in proportion to ``c``, shuffled.

    Integer edges ``E_y = (N · Σ_{y'≤y} c_y') // Σ c`` (exact, no float cumsum); class y gets ``E_y − E_{y−1}``
    copies. So exactly N labels, ``|count_y − N p(y)| < 1``, and never a class with ``c_y = 0``.
    """
    counts = class_counts.to(torch.int64).cpu()
    if counts.dim() != 1 or bool((counts < 0).any()) or int(counts.sum()) <= 0:
        raise ValueError(f"stratified_labels: need non-negative counts with a positive total, got {class_counts!r}")
    edges = (n * torch.cumsum(counts, 0)) // counts.sum()
    per_class = torch.diff(edges, prepend=torch.zeros(1, dtype=torch.int64))
    labels = torch.repeat_interleave(torch.arange(counts.numel()), per_class)
    return labels[torch.randperm(n, generator=generator)]


def ensemble_distribution(teacher_logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """FedFTG's class-weighted teacher ensemble ``p̄_b = Σ_k α^{k,y_b} σ(D(x̂_b; ω_k))`` (card §3 (d)).

    ``teacher_logits`` is (K, B, M), ``weights`` the per-sample weights (B, K) (rows summing to 1, so every
    ``p̄_b`` is a distribution). Built from probabilities, without logs: a zero-weight teacher is harmless.
    """
    probs = torch.softmax(teacher_logits.float(), dim=-1)
    return torch.einsum("kbm,bk->bm", probs, weights.float())


def soft_cross_entropy(student_logits: torch.Tensor, target: torch.Tensor, reduction: str = "code") -> torch.Tensor:
    """FedFTG's student loss ``L_S = −(1/(B·M)) Σ_b Σ_c p̄_{b,c} log q_{b,c}`` (card §3 (d), ambiguity 3).

    ``code``: the mean over the B×M matrix (the reference code's implicit 1/M); ``batchmean``: ``−(1/B) Σ``.
    Its gradient equals that of ``Σ_k α^{k,y} KL(p_k ‖ q)`` (same reduction): soft CE is linear in the target and
    the teachers' entropies are constants. Temperature 1, log_softmax, float32.
    """
    log_q = torch.log_softmax(student_logits.float(), dim=1)
    total = -(target.float() * log_q).sum()
    if reduction == "code":
        return total / log_q.numel()
    if reduction == "batchmean":
        return total / log_q.shape[0]
    raise ValueError(f"unknown student reduction {reduction!r} (code or batchmean)")


def model_discrepancy(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, weights: torch.Tensor, metric: str = "l1_logits"
) -> torch.Tensor:
    """FedFTG's per-teacher discrepancy ``L_md^k`` for the generator (card §3 (e), ambiguities 1 and 17).

    ``l1_logits`` (default, reference code): ``(1/B) Σ_b α_b · (1/M) ‖D(x̂_b; ω) − stopgrad(D(x̂_b; ω_k))‖_1``;
    ``mse``: the same with squared differences (the paper's ablation); ``kl``: ``(1/B) Σ_b α_b KL(p_k ‖ q)``
    with gradients through both models (Eq. 4 in the teacher‖student direction). ``weights`` is α^{k,y_b}, (B,).
    """
    s = student_logits.float()
    if metric == "kl":
        log_p = torch.log_softmax(teacher_logits.float(), dim=1)
        per_sample = (log_p.exp() * (log_p - torch.log_softmax(s, dim=1))).sum(dim=1)
    elif metric == "l1_logits":
        per_sample = (s - teacher_logits.detach().float()).abs().mean(dim=1)
    elif metric == "mse":
        per_sample = (s - teacher_logits.detach().float()).pow(2).mean(dim=1)
    else:
        raise ValueError(f"unknown discrepancy metric {metric!r} (l1_logits, kl or mse)")
    return (weights.float() * per_sample).mean()


def weighted_classification_loss(
    teacher_logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, weighting: str = "per_sample"
) -> torch.Tensor:
    """FedFTG's fidelity term ``L_cls^k`` (Eqs. 5-6; card §3 (e) and ambiguity 4).

    ``per_sample`` (default): ``(1/B) Σ_b α^{k,y_b} CE(D(x̂_b; ω_k), y_b)``; ``batch_scalar`` (reference code):
    ``mean_b α · mean_b CE``. The gradient reaches the generator through teacher k.
    """
    ce = F.cross_entropy(teacher_logits.float(), labels, reduction="none")
    if weighting == "per_sample":
        return (weights.float() * ce).mean()
    if weighting == "batch_scalar":
        return weights.float().mean() * ce.mean()
    raise ValueError(f"unknown cls weighting {weighting!r} (per_sample or batch_scalar)")


def diversity_loss(images: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """FedFTG's diversity loss ``L_dis = exp(−(1/B²) Σ_{i,j} δx_ij · δz_ij)`` (Eq. 7 in the code's form, ambiguity 5).

    ``δx_ij = (1/P) ‖x̂_i − x̂_j‖_1`` over the P = C·H·W values of an image, ``δz_ij = (1/d) ‖z_i − z_j‖²``; the
    pairs i = j are in the B² mean. ``L_dis ∈ (0, 1]``, and 1 when all images are identical. float32.
    """
    x = images.float().flatten(1)
    z = noise.float().flatten(1)
    dx = torch.cdist(x, x, p=1) / x.shape[1]
    dz = (z[:, None, :] - z[None, :, :]).pow(2).sum(dim=-1) / z.shape[1]
    return torch.exp(-(dx * dz).mean())


def generator_objective(
    discrepancy: torch.Tensor,
    classification: torch.Tensor,
    diversity: torch.Tensor,
    lambda_cls: float,
    lambda_dis: float,
    num_teachers: int,
    hard_sample_mining: bool = True,
) -> torch.Tensor:
    """FedFTG's per-teacher generator loss ``L_G^k = −L_md^k + λ_cls L_cls^k + (λ_dis/|S_t|) L_dis`` (card §3 (e)).

    The generator minimises it, i.e. maximises the discrepancy (hard samples, Eq. 8). Over one pass through the
    |S_t| teachers the diversity term adds up to ``λ_dis L_dis``. ``hard_sample_mining=False`` drops ``−L_md``
    (card ambiguity 17).
    """
    loss = lambda_cls * classification + (lambda_dis / num_teachers) * diversity
    if hard_sample_mining:
        loss = loss - discrepancy
    return loss


# -- FedDF and FedGen (spec/feddf.md, spec/fedgen.md) -------------------------------------------------------


def ensemble_target(teacher_logits: torch.Tensor, scheme: str = "avg_logits", tau: float = 1.0) -> torch.Tensor:
    """The teachers' soft target from logits of shape ``(K, B, M)`` (spec/feddf.md §3), float32, no gradient.

    ``avg_logits`` (AVGLOGITS, FedDF's README/paper): ``σ((1/K) Σ_k f_k / T)``; ``avg_probs`` (FedFTG's
    data-free FedDF): ``(1/K) Σ_k σ(f_k / T)``. Rows sum to 1; identical teachers give that teacher's softmax.
    """
    logits = teacher_logits.detach().float()
    if scheme == "avg_logits":
        return torch.softmax(logits.mean(dim=0) / tau, dim=1)
    if scheme == "avg_probs":
        return torch.softmax(logits / tau, dim=2).mean(dim=0)
    raise ValueError(f"unknown teacher scheme {scheme!r} (avg_logits or avg_probs)")


def ensemble_distillation(student_logits: torch.Tensor, target: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """FedDF's student loss ``(1/B) Σ_b KL(p_T(x_b) ‖ σ(f(x_b; θ)/T))`` (spec/feddf.md §3; no T² factor, as
    the code). ``target`` is a probability matrix (no gradient flows into it). Also FedGen's client KL term
    at T = 1 (spec/fedgen.md §3). Computed in float32 with ``kl_div`` on ``log_softmax`` (never log of a
    softmax); zero target entries contribute 0.
    """
    log_q = torch.log_softmax(student_logits.float() / tau, dim=1)
    return F.kl_div(log_q, target.detach().float(), reduction="batchmean")


def qualified_labels(counts: torch.Tensor, min_samples: int = 1) -> torch.Tensor:
    """FedGen's ``Y_q = {y : max_k c_k^y > MIN_SAMPLES_PER_LABEL}`` as a boolean M-vector (spec/fedgen.md §3).

    ``counts`` is ``(K, M)`` with FedGen's +1 prior, so a label qualifies iff some selected client processed it.
    """
    return counts.max(dim=0).values > min_samples


def stacked_head_logits(features: torch.Tensor, head_weights: torch.Tensor, head_biases: torch.Tensor) -> torch.Tensor:
    """K linear heads on one batch of features at once: ``(B, d)`` features, ``(K, C, d)`` weights and ``(K, C)``
    biases give ``(K, B, C)`` logits, ``[k, b] = W_k z_b + b_k`` (FedGen's frozen client heads on the generator's
    features, spec/fedgen.md §3 and §8)."""
    return torch.einsum("bd,kcd->kbc", features, head_weights) + head_biases[:, None, :]


def fedgen_teacher_loss(
    head_logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, weighting: str = "per_sample"
) -> torch.Tensor:
    """FedGen's server term ``Σ_k (1/B) Σ_b ω_{y_b,k} · CE(h_k(ẑ_b), y_b)`` (spec/fedgen.md §3).

    ``head_logits`` is ``(K, B, M)`` (client k's head on the generated features), ``weights`` is ``(K, M)``
    (``ω``, columns summing to 1). ``batch_scalar`` reproduces the official code's broadcast,
    ``Σ_k mean_b(CE_k) · mean_b(ω_{y_b,k})`` (card ambiguity 3).
    """
    k, b, m = head_logits.shape
    ce = F.cross_entropy(head_logits.float().reshape(k * b, m), labels.repeat(k), reduction="none").view(k, b)
    w = weights.to(ce.device, ce.dtype)[:, labels]  # (K, B): ω_{y_b,k}
    if weighting == "per_sample":
        return (w * ce).mean(dim=1).sum()
    if weighting == "batch_scalar":
        return (ce.mean(dim=1) * w.mean(dim=1)).sum()
    raise ValueError(f"unknown weighting {weighting!r} (per_sample or batch_scalar)")


def fedgen_client_regulariser(
    logits: torch.Tensor,
    latent_logits: torch.Tensor,
    generated_logits: torch.Tensor,
    generated_labels: torch.Tensor,
    alpha: float,
    beta: float,
    ratio: float = 1.0,
) -> torch.Tensor:
    """FedGen's two client terms at round t ≥ 1 (spec/fedgen.md §3)::

        ratio · α_t · CE(h(G(ε, ŷ)), ŷ)  +  β_t · (1/B) Σ_b KL(stopgrad σ(h(G(ε_b, y_b))) ‖ σ(f(x_b)))

    ``logits`` = f(x) on the real batch; ``latent_logits`` = the client's head on generated features of the
    batch's labels (detached here: it is only a target); ``generated_logits`` = the head on generated features
    of the labels ``generated_labels``; ``ratio`` = B_g / B (official code's ``gen_ratio``).
    """
    target = torch.softmax(latent_logits.detach().float(), dim=1)
    latent = ensemble_distillation(logits, target)
    generative = F.cross_entropy(generated_logits.float(), generated_labels)
    return ratio * alpha * generative + beta * latent


# -- DaFKD (spec/dafkd.md) ------------------------------------------------------------------------------------


def discriminator_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """DaFKD's adversarial term of the joint loss, Eq. (2) in the card's code form::

        BCEWithLogits(ℓ_k(x), 1) + BCEWithLogits(ℓ_k(x̂), 0)     (each a batch mean)

    minimised by the discriminator: it rises on real inputs and falls on generated ones (= 2 × Eq. 2 for equal
    batch sizes). ``real_logits``/``fake_logits`` are the discriminator logits ``ℓ_k``, any shape.
    """
    real = real_logits.float()
    fake = fake_logits.float()
    return F.binary_cross_entropy_with_logits(real, torch.ones_like(real)) + F.binary_cross_entropy_with_logits(
        fake, torch.zeros_like(fake)
    )


def interpolation_gradient_penalty(
    score: Callable[[torch.Tensor], torch.Tensor],
    real: torch.Tensor,
    fake: torch.Tensor,
    mix: torch.Tensor,
    weight: float,
) -> torch.Tensor:
    """DaFKD code's gradient penalty on the discriminator (card §5 "gradient penalty", ambiguity 6)::

        x̃_b = m_b · x_b + (1 − m_b) · x̂_b,        m_b ~ U(0, 1) per sample (``mix``, shape (B,))
        GP  = λ · mean_b ( ‖∂ score(x̃)_b / ∂ x̃_b‖₂ − 1 )²

    ``score`` maps a batch to one score per sample (the released code penalises the sigmoid output f_k, not
    the logit). The norm is over each sample's whole flattened gradient (the card's resolution; the code's
    norm over the channel axis only is a bug). ``create_graph`` lets the penalty's gradient reach the
    discriminator's parameters; ``fake`` is detached (the generator is not trained through the penalty).
    """
    shape = (-1,) + (1,) * (real.dim() - 1)
    m = mix.to(real.dtype).view(shape)
    interpolates = (m * real.detach() + (1 - m) * fake.detach()).requires_grad_(True)
    scores = score(interpolates).float()
    (gradients,) = torch.autograd.grad(scores.sum(), interpolates, create_graph=True)
    norms = gradients.float().flatten(1).norm(2, dim=1)
    return weight * ((norms - 1) ** 2).mean()


def generator_adversarial_loss(fake_logits: torch.Tensor) -> torch.Tensor:
    """DaFKD's generator objective, Eq. (3) in its non-saturating form ``BCEWithLogits(ℓ_k(g(z)), 1)`` (card
    ambiguity 1): the generator is rewarded when the (frozen) discriminator calls its samples real."""
    fake = fake_logits.float()
    return F.binary_cross_entropy_with_logits(fake, torch.ones_like(fake))


def domain_log_importance(discriminator_logits: torch.Tensor) -> torch.Tensor:
    """Eq. (7) in log space: ``log α̂_{k,i} = log_softmax_k(logsigmoid(ℓ_k(x_i)))`` for logits of shape (K, N).

    ``α̂_{k,i} = f_k(x_i) / Σ_j f_j(x_i)`` with ``f = sigmoid(ℓ)``; the log form stays finite when every
    ``f_j(x_i)`` underflows (ℓ ≤ −100): it is then the softmax of the logits themselves.
    """
    return torch.log_softmax(F.logsigmoid(discriminator_logits.float()), dim=0)


def domain_aware_teacher(
    teacher_logits: torch.Tensor, log_importance: torch.Tensor, temperature: float = 1.0, space: str = "probs"
) -> torch.Tensor:
    """DaFKD's per-sample teacher ``log q_i`` (N, M) from teacher logits (K, N, M) and ``log α̂`` (K, N).

    ``probs`` (Eq. 8, the paper): ``q_i = Σ_k α̂_{k,i} softmax(z_k(x_i)/T)``, computed as
    ``logsumexp_k(log α̂_{k,i} + log_softmax(z_k/T))``. ``logits`` (the code, card ambiguity 2):
    ``q_i = softmax(Σ_k α̂_{k,i} z_k(x_i) / T)``. Rows of ``exp(log q)`` sum to 1 in both.
    """
    logits = teacher_logits.detach().float()
    log_alpha = log_importance.detach().float().unsqueeze(-1)  # (K, N, 1)
    if space == "probs":
        return torch.logsumexp(log_alpha + torch.log_softmax(logits / temperature, dim=2), dim=0)
    if space == "logits":
        return torch.log_softmax((log_alpha.exp() * logits).sum(dim=0) / temperature, dim=1)
    raise ValueError(f"unknown ensemble space {space!r} (probs or logits)")


def prior_corrected_target(log_target: torch.Tensor, log_reference: torch.Tensor) -> torch.Tensor:
    """A target whose class prior on the batch is the reference's: ``log q̃_i = log_softmax(log q_i − log q̄ + log r̄)``.

    ``q̄ = (1/N) Σ_i q_i`` and ``r̄ = (1/N) Σ_i r_i`` are the batch means of ``q = exp(log_target)`` and
    ``r = exp(log_reference)``, both (N, M). It is logit adjustment for a label shift: the per-sample preferences
    of ``q`` between classes are kept (``log q̃_{ic} − log q̃_{ic'}`` differs from ``log q_{ic} − log q_{ic'}`` by a
    constant of the two classes, the same for every sample), while the share of each class over the batch is
    moved from ``q̄`` to ``r̄``. DaFKD's server step uses it with the aggregate as the reference (spec/dafkd.md
    ambiguity 19): teachers that each saw one or two classes agree on one class for almost every generated
    sample, and a student that copies that share learns it as a prior on real images. Rows sum to 1; a target
    whose prior already is the reference's comes back unchanged up to the renormalisation.
    """
    log_q = log_target.detach().float()
    log_r = log_reference.detach().float()
    n = log_q.shape[0]
    log_q_bar = torch.logsumexp(log_q, dim=0) - math.log(n)
    log_r_bar = torch.logsumexp(log_r, dim=0) - math.log(n)
    return torch.log_softmax(log_q - log_q_bar + log_r_bar, dim=1)


def scale_matched_logits(
    teacher_logits: torch.Tensor, reference_logits: torch.Tensor, per: str = "sample", shrink_only: bool = False
) -> torch.Tensor:
    """Each teacher's logits brought to the reference's scale, sample by sample: ``z̃_{k,i} = (z_{k,i} − z̄_{k,i})·σ(r_i)/σ(z_{k,i})``.

    ``teacher_logits`` (K, N, M), ``reference_logits`` (N, M); ``z̄`` and ``σ`` are the mean and the (population)
    standard deviation over the M classes. The teacher's ranking of the classes on every sample and the ratios of
    its logit gaps are kept; only the size of its logits is the reference's. A teacher whose logits are all equal
    on a sample stays all zero there. ``per="teacher"``: one factor per teacher, from the root-mean-square spreads
    over the batch; ``shrink_only``: factors above 1 are cut to 1 (a teacher quieter than the reference keeps its
    logits). DaFKD's ``teacher_scale`` option uses it with the aggregate ŵ as the reference (spec/dafkd.md
    ambiguity 20, issue 61): a client that holds one class ends its local training with logit spreads of hundreds,
    and the code's logit-space mixture at T = 20 asks the student to regress onto them.
    """
    z = teacher_logits.detach().float()
    r = reference_logits.detach().float()
    centred = z - z.mean(dim=2, keepdim=True)
    var = centred.pow(2).mean(dim=2, keepdim=True)  # (K, N, 1)
    var_ref = (r - r.mean(dim=1, keepdim=True)).pow(2).mean(dim=1, keepdim=True).unsqueeze(0)  # (1, N, 1)
    if per == "teacher":  # one factor per teacher: root-mean-square spreads over the batch
        var, var_ref = var.mean(dim=1, keepdim=True), var_ref.mean(dim=1, keepdim=True)
    elif per != "sample":
        raise ValueError(f"unknown per {per!r} (sample or teacher)")
    factor = torch.where(var > 0, (var_ref / var.clamp_min(1e-30)).sqrt(), torch.zeros_like(var))
    if shrink_only:
        factor = factor.clamp(max=1.0)
    return centred * factor


def domain_aware_distillation(
    student_logits: torch.Tensor, log_target: torch.Tensor, temperature: float = 1.0, reduction: str = "batchmean"
) -> torch.Tensor:
    """Eq. (8): ``L_KD = T² · (1/N) Σ_i KL(q_i ‖ softmax(z(x_i)/T))`` with ``log_target = log q`` (no gradient).

    ``batchmean`` divides the summed KL by the batch size (the paper); ``mean`` by batch × M (the code's
    ``KLDivLoss()`` default, card ambiguity 2), both times T².
    """
    if reduction not in ("batchmean", "mean"):
        raise ValueError(f"unknown reduction {reduction!r} (batchmean or mean)")
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=1)
    total = F.kl_div(log_s, log_target.detach().float(), log_target=True, reduction="sum")
    return temperature**2 * total / (log_s.shape[0] if reduction == "batchmean" else log_s.numel())


# -- FedICT, FedDKC and FedGKT (spec/fedict.md, spec/feddkc.md, spec/fedgkt.md) ------------------------------


def label_distribution(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """FedICT's local distribution vector ``d^k_c = f^k_c = (1/N^k) Σ_i 1[ŷ_i^k = c]`` (spec/fedict.md Eq. 7).

    ``labels`` is the client's LongTensor of training labels in ``[0, C)``; returns the (C,) float64 histogram
    divided by ``N^k`` (non-negative, sums to 1). An empty label set has no distribution: ``ValueError``.
    """
    flat = labels.reshape(-1).long()
    if flat.numel() == 0:
        raise ValueError("label_distribution: no labels (N^k = 0)")
    if bool((flat < 0).any()) or bool((flat >= num_classes).any()):
        raise ValueError(f"label_distribution: labels must lie in [0, {num_classes})")
    counts = torch.bincount(flat, minlength=num_classes).double()
    return counts / flat.numel()


def global_label_distribution(distributions: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """FedICT's global distribution ``d^S = Σ_k N^k d^k / Σ_k N^k`` (spec/fedict.md §3, Alg. 2 line 8).

    ``distributions`` is (K, C) (row k = ``d^k``), ``counts`` is (K,) (``N^k``). The result, float64 (C,), is
    the label histogram of the union of the clients' training sets and a convex combination of the ``d^k``.
    """
    n = counts.double().reshape(-1)
    total = n.sum()
    if n.numel() != distributions.shape[0] or bool((n < 0).any()) or total <= 0:
        raise ValueError("global_label_distribution: need one non-negative count per client, positive in total")
    return (n[:, None] * distributions.double()).sum(dim=0) / total


def fpkd_class_weights(distribution: torch.Tensor, temperature: float, form: str = "softmax") -> torch.Tensor:
    """FedICT's FPKD class weights ``w^k_r = exp(f^k_r/T) / Σ_j exp(f^k_j/T)`` (spec/fedict.md Eq. 11).

    Float64 softmax of the client's class frequencies: strictly positive, sums to 1, keeps the order of
    ``f^k``; ``T → ∞`` gives ``1/C``, ``T → 0⁺`` the one-hot of ``argmax f^k``. ``form="linear"`` is the
    authors' code, ``d^k/T`` (card A4): zero for a class the client lacks, summing to 1/T.
    """
    if form == "linear":
        return distribution.double() / temperature
    if form != "softmax":
        raise ValueError(f"fpkd_class_weights: form {form!r} is not softmax or linear")
    return torch.softmax(distribution.double() / temperature, dim=-1)


def lka_similarity(global_distribution: torch.Tensor, local_distribution: torch.Tensor) -> float:
    """FedICT(sim)'s client weight ``s_k = (d^S)ᵀ d^k / (‖d^S‖₂ ‖d^k‖₂)`` (spec/fedict.md Eq. 12).

    Float64, no ε: a distribution has ``‖d‖₂ ≥ 1/√C > 0`` (a zero or negative vector is a ``ValueError``).
    For non-negative vectors the cosine lies in [0, 1]; the result is clipped to that range so rounding cannot
    push an exact match above 1. Equal (or positively scaled) vectors give 1, disjoint supports 0.
    """
    g = global_distribution.double().reshape(-1)
    d = local_distribution.double().reshape(-1)
    if bool((g < 0).any()) or bool((d < 0).any()):
        raise ValueError("lka_similarity: distributions must be non-negative")
    norm = g.norm() * d.norm()
    if norm <= 0:
        raise ValueError("lka_similarity: a distribution vector is all zeros")
    return float(((g * d).sum() / norm).clamp(0.0, 1.0))


def lka_balance_weights(
    global_distribution: torch.Tensor, local_distribution: torch.Tensor, temperature: float, form: str = "softmax"
) -> torch.Tensor:
    """FedICT(balance)'s class weights ``v^k_r = softmax((f^S − f^k)/U)_r`` (spec/fedict.md Eq. 14).

    Float64; strictly positive, sums to 1, exactly ``1/C`` when ``d^k = d^S``, and ``v^k_a > v^k_b`` iff class a
    is rarer locally relative to the global distribution than class b. ``form="linear"`` is the authors' code,
    ``(d^S − d^k)/U`` (card A5): it can be negative, which makes the server loss unbounded below.
    """
    diff = global_distribution.double() - local_distribution.double()
    if form == "linear":
        return diff / temperature
    if form != "softmax":
        raise ValueError(f"lka_balance_weights: form {form!r} is not softmax or linear")
    return torch.softmax(diff / temperature, dim=-1)


def _weighted_kl_batchmean(
    teacher_probs: torch.Tensor,
    teacher_term: torch.Tensor,
    log_q: torch.Tensor,
    tau: float,
    class_weights: torch.Tensor | None,
) -> torch.Tensor:
    """``τ² · mean_b Σ_r a_r (teacher_term_r − p_r log q_r)`` with ``teacher_term = p log p`` (0 where p = 0)."""
    per_class = teacher_term - teacher_probs * log_q
    if class_weights is not None:
        per_class = per_class * class_weights.to(device=log_q.device, dtype=log_q.dtype)
    return (tau**2) * per_class.sum(dim=1).mean()


def distillation_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float, class_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """FedICT/FedGKT's (class-weighted) distillation term ``τ² · mean_b WKL(a; p_b ‖ q_b)`` (spec/fedict.md §3).

    ``WKL(a; p‖q) = Σ_r a_r p_r (log p_r − log q_r)`` with the detached teacher ``p = σ_τ(teacher)`` and the
    student ``q = σ_τ(student)`` ("batchmean": sum over classes, mean over the batch). ``class_weights``
    (``a``, shape (C,)) is FPKD's ``w^k`` (Eqs. 10-11) or LKA-balance's ``v^k`` (Eqs. 13-14); ``None`` means
    all ones, i.e. the plain ``τ² KL(p‖q)`` of Eqs. 2/4 and fedgkt.md §3. Direction: KL(teacher ‖ student).
    Both sides come from ``log_softmax``, teacher probabilities are ``exp(log p)`` (so ``0 · log 0 = 0``), no ε
    is added. Computed in float32; returns a float32 scalar. Its gradient w.r.t. the student logits of one
    sample is ``τ (q_j Σ_r a_r p_r − a_j p_j)``.
    """
    log_q = torch.log_softmax(student_logits.float() / tau, dim=1)
    log_p = torch.log_softmax(teacher_logits.detach().float() / tau, dim=1)
    p = log_p.exp()
    return _weighted_kl_batchmean(p, p * log_p, log_q, tau, class_weights)


def distillation_kl_from_probs(
    student_logits: torch.Tensor,
    teacher_probs: torch.Tensor,
    tau: float,
    class_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`distillation_kl` with a teacher given as probabilities (spec/feddkc.md §3 and A4).

    FedDKC's server term ``τ² · mean_b Σ_r a_r t_r (log t_r − log σ_τ(o)_r)``: the refined teacher ``t`` (KKR or
    SKR output) is used as-is (detached, not re-tempered); only the student is softened by τ. Entries with
    ``t_r = 0`` contribute exactly 0 (``xlogy``), no ε. float32 scalar.
    """
    log_q = torch.log_softmax(student_logits.float() / tau, dim=1)
    t = teacher_probs.detach().float()
    return _weighted_kl_batchmean(t, torch.xlogy(t, t), log_q, tau, class_weights)


def _kkr_map(probs: torch.Tensor, peak: float) -> torch.Tensor:
    """FedDKC's KKR affine map ``p → p'`` on probability rows (spec/feddkc.md §3), in the dtype of ``probs``.

    ``p'_r = ((C·T − 1) p_r + m − T) / (C·m − 1)`` with ``m = max_r p_r``; rows with ``C·m − 1 ≤ 1e-12``
    or a negative ``p'`` fall back to ``T`` at the argmax (lowest index among ties, A7) and
    ``(1 − T)/(C − 1)`` elsewhere.
    """
    c = probs.shape[1]
    top = torch.argmax(probs, dim=1, keepdim=True)  # first maximal index
    m = probs.gather(1, top)
    denom = c * m - 1.0
    degenerate = denom <= 1e-12
    refined = ((c * peak - 1.0) * probs + (m - peak)) / torch.where(degenerate, torch.ones_like(denom), denom)
    use_fallback = degenerate | (refined.min(dim=1, keepdim=True).values < 0)
    fallback = torch.full_like(probs, (1.0 - peak) / (c - 1)).scatter(1, top, peak)
    return torch.where(use_fallback, fallback, refined)


def kkr_refine(logits: torch.Tensor, peak: float, scale: float = 0.05, tau: float = 3.0) -> torch.Tensor:
    """FedDKC's kernel-based knowledge refinement (KKR, spec/feddkc.md §3), a detached (B, C) float32 teacher.

    ``p = softmax(z / (S·τ))`` (code default ``S = 0.05``, ``τ = 3``; ``S = 1`` is the paper-pure input, A3),
    then the affine map to peak ``T``: ``p'_r = T − (C·T − 1)/(C·m − 1) · (m − p_r)``, ``m = max_r p``.
    Fallback when ``C·m − 1 ≤ 1e-12`` (uniform p) or ``min_r p'_r < 0``: ``T`` at ``argmax p`` (ties: lowest
    index) and ``(1 − T)/(C − 1)`` elsewhere. Every row sums to 1 and peaks at exactly T (congruence); without
    the fallback the ranking is kept and the map is idempotent. Needs ``1/C < T ≤ 1``. Float64 inside, no
    gradient.
    """
    c = logits.shape[1]
    if c < 2 or not (1.0 / c < peak <= 1.0):
        raise ValueError(f"kkr_refine: need C ≥ 2 and 1/C < T ≤ 1, got C={c}, T={peak}")
    with torch.no_grad():
        probs = torch.softmax(logits.detach().double() / (scale * tau), dim=1)
        return _kkr_map(probs, peak).float()


def _entropy_bits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Row entropies ``−Σ_r q_r log₂ q_r`` of ``q = softmax(z / s)`` with one temperature per row (log_softmax)."""
    log_q = torch.log_softmax(logits / temperature[:, None], dim=1)
    return -(log_q.exp() * log_q).sum(dim=1) / torch.log(torch.tensor(2.0, dtype=log_q.dtype))


def skr_refine(
    logits: torch.Tensor,
    target_entropy_bits: float,
    low: float = 1e-4,
    high: float = 1000.0,
    tol: float = 1e-6,
    max_halvings: int = 60,
) -> torch.Tensor:
    """FedDKC's searching-based knowledge refinement (SKR, spec/feddkc.md §3), a detached (B, C) float32 teacher.

    Per row, finds ``s*`` with ``H(softmax(z/s*)) = H*`` bits by bisection on ``[ε₁, ε₂] = [low, high]`` (H is
    non-decreasing in s), vectorised over rows with a fixed number of halvings: the first n with
    ``(high − low)/2ⁿ ≤ tol``, at most ``max_halvings``; ``s*`` is the final midpoint. ``tol ≤ 0`` runs all
    ``max_halvings``: the card's absolute ``ε = 1e-6`` on s bounds the entropy error only by about
    ``5e-7 · Var_q(z/s*) / s*`` nats, more than 1e-4 bits for small ``s*`` (logits with a tiny spread).
    Rows whose target is outside ``[H(low), H(high)]`` are clamped (A6): ``s* = low`` if ``H(low) ≥ H*``,
    ``s* = high`` if ``H(high) ≤ H*`` (constant rows: uniform output). Returns ``softmax(z/s*)`` on the raw
    logits (no τ, no S). Entropies from log_softmax without ε; float64 inside, no gradient. The output is
    invariant to adding a constant to a row and keeps each row's ranking.
    """
    import math

    if not (0.0 < low < high) or max_halvings < 0:
        raise ValueError(f"skr_refine: need 0 < low < high, max_halvings ≥ 0; got [{low}, {high}], {max_halvings}")
    halvings = int(max_halvings)
    if tol > 0:
        halvings = min(halvings, max(0, math.ceil(math.log2((high - low) / tol))))
    with torch.no_grad():
        z = logits.detach().double()
        z = z - z.max(dim=1, keepdim=True).values
        lo = torch.full((z.shape[0],), float(low), dtype=z.dtype, device=z.device)
        hi = torch.full_like(lo, float(high))
        clamp_low = _entropy_bits(z, lo) >= target_entropy_bits
        clamp_high = _entropy_bits(z, hi) <= target_entropy_bits
        for _ in range(halvings):
            mid = 0.5 * (lo + hi)
            below = _entropy_bits(z, mid) < target_entropy_bits
            lo = torch.where(below, mid, lo)
            hi = torch.where(below, hi, mid)
        s = 0.5 * (lo + hi)
        s = torch.where(clamp_low, torch.full_like(s, float(low)), s)
        s = torch.where(clamp_high, torch.full_like(s, float(high)), s)
        return torch.softmax(z / s[:, None], dim=1).float()


# -- FML (spec/fml.md) --------------------------------------------------------------------------------------------
def mutual_learning_losses(
    private_logits: torch.Tensor,
    meme_logits: torch.Tensor,
    labels: torch.Tensor,
    alpha: float,
    beta: float,
    kl_reduction: str = "mean",
    detach_targets: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FML's two losses (spec/fml.md F2): ``L_priv = α CE(z, y) + (1 − α) KL(q ‖ p)`` and
    ``L_meme = β CE(u, y) + (1 − β) KL(p ‖ q)``, p = softmax(z) of the private model, q = softmax(u) of the meme.

    ``kl_reduction``: ``"mean"`` averages the KL over all |b|·C elements (PyTorch's ``KLDivLoss()`` default, as
    HtFLlib; card ambiguity 1), ``"batchmean"`` over the |b| samples (the authors' code: C times the former).
    ``detach_targets``: each KL's target distribution a constant (the authors' DML, F3's paper form); by default
    (HtFLlib) it is not, so the sum of the two losses sends each model the gradient of both KL terms."""
    if kl_reduction not in ("mean", "batchmean"):
        raise ValueError(f"mutual_learning_losses: kl_reduction must be 'mean' or 'batchmean', not {kl_reduction!r}")
    log_p, log_q = F.log_softmax(private_logits, dim=1), F.log_softmax(meme_logits, dim=1)
    target_q, target_p = (log_q.detach(), log_p.detach()) if detach_targets else (log_q, log_p)
    # Summed, then divided by |b|·C ("mean") or |b| ("batchmean"): PyTorch warns on its own "mean" reduction.
    divisor = private_logits.shape[0] * (private_logits.shape[1] if kl_reduction == "mean" else 1)
    kl_q_p = F.kl_div(log_p, target_q, reduction="sum", log_target=True) / divisor  # KL(q ‖ p)
    kl_p_q = F.kl_div(log_q, target_p, reduction="sum", log_target=True) / divisor  # KL(p ‖ q)
    private = alpha * F.cross_entropy(private_logits, labels) + (1.0 - alpha) * kl_q_p
    meme = beta * F.cross_entropy(meme_logits, labels) + (1.0 - beta) * kl_p_q
    return private, meme


# -- FedMRL (spec/fedmrl.md) --------------------------------------------------------------------------------------
def matryoshka_loss(private_logits: torch.Tensor, shared_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """FedMRL's client loss (spec/fedmrl.md M2): ``CE(z, y) + CE(u, y)``, the private head's logits z on the whole
    fused representation and the shared head's u on its first s dimensions, both batch means, weights 1 and 1
    (HtFLlib and the authors' code)."""
    return F.cross_entropy(private_logits, labels) + F.cross_entropy(shared_logits, labels)


# -- FedKD (spec/fedkd.md) ----------------------------------------------------------------------------------------
def adaptive_mutual_losses(
    mentor_logits: torch.Tensor,
    mentee_logits: torch.Tensor,
    mentor_features: torch.Tensor,
    mapped_mentee_features: torch.Tensor,
    labels: torch.Tensor,
    detach_peers: bool = False,
) -> torch.Tensor:
    """FedKD's summed client objective (spec/fedkd.md K2-K3): with S = CE_p + CE_g,
    ``CE_p + CE_g + [KL̄(q ‖ p) + KL̄(p ‖ q) + 2·MSĒ(r, W_h r̃)] / S`` — the mentor's loss CE_p + KL̄(q ‖ p)/S +
    MSĒ/S plus the mentee's CE_g + KL̄(p ‖ q)/S + MSĒ/S, KL̄ averaged over |b|·C elements and MSĒ over |b|·d (PyTorch's
    default "mean" reductions, as HtFLlib). Nothing is detached by default, not even S (HtFLlib and the authors);
    ``detach_peers``: S and, in each model's own terms, the peer's distribution and features are constants."""
    ce_p, ce_g = F.cross_entropy(mentor_logits, labels), F.cross_entropy(mentee_logits, labels)
    log_p, log_q = F.log_softmax(mentor_logits, dim=1), F.log_softmax(mentee_logits, dim=1)
    target_q, target_p = (log_q.detach(), log_p.detach()) if detach_peers else (log_q, log_p)
    elements = mentor_logits.shape[0] * mentor_logits.shape[1]
    kl_q_p = F.kl_div(log_p, target_q, reduction="sum", log_target=True) / elements  # KL(mentee ‖ mentor)
    kl_p_q = F.kl_div(log_q, target_p, reduction="sum", log_target=True) / elements  # KL(mentor ‖ mentee)
    r, mapped = mentor_features, mapped_mentee_features
    if detach_peers:  # the mentor's copy pulls r towards a constant W_h r̃, the mentee's W_h r̃ towards a constant r
        hidden = F.mse_loss(r, mapped.detach()) + F.mse_loss(r.detach(), mapped)
    else:  # the same expression in both losses (K2)
        hidden = 2.0 * F.mse_loss(r, mapped)
    scale = (ce_p + ce_g).detach() if detach_peers else ce_p + ce_g
    return ce_p + ce_g + (kl_q_p + kl_p_q + hidden) / scale
