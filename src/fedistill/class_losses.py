"""Per-class statistics as pure functions: what clients accumulate, how the server averages them, and the losses
and inference that use the result (spec/fd.md, spec/fedproto.md; FedGH and FedTGP build on the same pieces).

Beside ``losses.py`` (which is long) and in its style: tensors in, tensors out, no state. A *table* is a dense
``(C, d)`` float32 tensor with a ``(C,)`` bool ``present`` mask saying which classes have a row; classes without a
row contribute nothing (their rows are zeros and every term masks them out). On the wire a table is
:class:`~fedistill.protocol.ClassRows` (held classes only); :func:`mean_over_holders` turns the uploads into one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F


def class_sums(values: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ_{i: y_i = c} v_i for every c, n_c)``: (C, d) float64 sums and (C,) int64 counts of a batch.

    One-hot matrix product rather than ``index_add_``: deterministic on every device (no atomics), and the sums
    of FD2/P2 (spec/fd.md, spec/fedproto.md) accumulate in float64 across a round's batches."""
    onehot = F.one_hot(labels, num_classes).to(torch.float64)
    return onehot.T @ values.detach().to(torch.float64), onehot.sum(0).to(torch.int64)


def mean_over_holders(
    uploads: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    num_classes: int,
    weighting: Literal["uniform", "count"] = "uniform",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's per-class average of the clients' rows: ``(table (C, d) float32, present (C,) bool)``.

    ``uploads``: one ``(classes, rows, counts)`` per client, in client-id order. ``uniform`` (FD3, P3; HtFLlib's
    ``proto_aggregation``): ``z̄^c = (1/|K_c|) Σ_{k∈K_c} u_k^c`` over the clients K_c that uploaded c, every holder
    counting once whatever its count. ``count`` (FD ``teacher_weighting: count``, P4): ``Σ n_k^c u_k^c / Σ n_k^c``.
    A class nobody uploaded has no row (``present`` False, zeros in the table). Summed in float64.
    """
    if not uploads:
        raise ValueError("mean_over_holders: no uploads")
    dim = int(uploads[0][1].shape[1])
    sums = torch.zeros(num_classes, dim, dtype=torch.float64)
    weights = torch.zeros(num_classes, dtype=torch.float64)
    for classes, rows, counts in uploads:
        if rows.shape[1] != dim:
            raise ValueError(f"mean_over_holders: rows of width {rows.shape[1]} and {dim} cannot be averaged")
        if weighting == "count":
            if counts is None:
                raise ValueError("mean_over_holders: count weighting needs the uploads' counts")
            w = counts.to(torch.float64)
        else:
            w = torch.ones(classes.numel(), dtype=torch.float64)
        sums.index_add_(0, classes.long(), rows.to(torch.float64) * w[:, None])
        weights.index_add_(0, classes.long(), w)
    present = weights > 0
    table = torch.zeros(num_classes, dim, dtype=torch.float32)
    table[present] = (sums[present] / weights[present, None]).float()
    return table, present


def class_table_distillation(
    logits: torch.Tensor, labels: torch.Tensor, table: torch.Tensor, present: torch.Tensor
) -> torch.Tensor:
    """FD's distillation term (spec/fd.md FD1) without its weight λ:
    ``(1/|b|) Σ_{i: y_i ∈ T} − Σ_j t^{y_i}_j log softmax(z_i)_j``, the teacher row ``t^{y_i}`` of the sample's label.

    The teacher is used as given (HtFLlib's soft-target cross-entropy: raw mean logits by default, a distribution
    with ``teacher: softmax`` or ``probs``) and is a constant. A row whose label has no teacher adds 0 but counts in ``|b|``."""
    log_p = F.log_softmax(logits.float(), dim=1)
    per_row = -(table[labels] * log_p).sum(1)
    return torch.where(present[labels], per_row, torch.zeros_like(per_row)).sum() / logits.shape[0]


def prototype_regulariser(
    features: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor, present: torch.Tensor
) -> torch.Tensor:
    """FedProto's regulariser (spec/fedproto.md P1) without its weight λ:
    ``(1/(|b|·d)) Σ_{i: y_i ∈ G} ‖r_i − P̄^{y_i}‖²``, HtFLlib's ``MSELoss`` over the batch's feature elements.

    The prototypes are constants; a row whose label has no global prototype adds 0 (and no gradient) but counts
    in ``|b|``."""
    features = features.float()
    squared = (features - prototypes[labels]).pow(2).sum(1)
    return torch.where(present[labels], squared, torch.zeros_like(squared)).sum() / (features.shape[0] * features.shape[1])


def nearest_prototype_scores(features: torch.Tensor, prototypes: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Scores whose argmax is the nearest global prototype (spec/fedproto.md P5): ``−‖r − P̄^c‖²`` per class, −inf
    for a class without a prototype (never predicted). argmax breaks ties towards the lowest class id."""
    squared = (features.float()[:, None, :] - prototypes[None, :, :]).pow(2).sum(2)
    return torch.where(present[None, :], -squared, torch.full_like(squared, float("-inf")))


def prototype_distance_regulariser(
    features: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor, present: torch.Tensor
) -> torch.Tensor:
    """FedTGP's client term in the paper's form (spec/fedtgp.md T1 with ``client_distance: euclidean``, A1) without
    its weight λ: ``(1/|b|) Σ_{i: y_i ∈ G} ‖r_i − P̂^{y_i}‖₂``, the distance φ itself (not squared, not over d).
    The square root is guarded at 0 as in :func:`prototype_distances` (finite gradient for a feature on its
    prototype); a row without a prototype adds 0 but counts in ``|b|``."""
    features = features.float()
    squared = (features - prototypes[labels]).pow(2).sum(1)
    distance = squared.clamp_min(DISTANCE_FLOOR).sqrt()
    return torch.where(present[labels], distance, torch.zeros_like(distance)).sum() / features.shape[0]


# The smallest squared distance whose square root is taken (spec/fedtgp.md A4): sqrt has an infinite gradient at
# 0; below this floor the clamp passes no gradient at all. Distances of rows that differ are far above it.
DISTANCE_FLOOR = 1e-12


def prototype_distances(rows: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """``D_ij = ‖p_i − P̂^j‖₂`` (spec/fedtgp.md T6, A4): (n, C) Euclidean distances of every row to every prototype.

    From the differences themselves, never from HtFLlib's expansion ``‖p‖² − 2p·P̂ + ‖P̂‖²`` (which rounding can make
    negative, a NaN under the root), and with the squared distance clamped at :data:`DISTANCE_FLOOR` so that a row
    lying on a prototype has a finite loss and finite gradients (invariant 9)."""
    squared = (rows.float()[:, None, :] - prototypes.float()[None, :, :]).pow(2).sum(2)
    return squared.clamp_min(DISTANCE_FLOOR).sqrt()


def adaptive_margin(class_means: torch.Tensor, present: torch.Tensor, threshold: float) -> float:
    """FedTGP's margin δ_t (spec/fedtgp.md T4-T5): ``min( max_c min_{c'≠c} ‖Q^c − Q^{c'}‖₂ , τ )`` over the classes
    uploaded this round (``present``), ``class_means`` the (C, d) table of Q (the unweighted means over holders,
    T3, from :func:`mean_over_holders`).

    A class not uploaded gets the smallest gap of the uploaded ones, so it never raises the maximum: the maximum
    is taken over the uploaded classes alone. Fewer than two uploaded classes: δ = τ. Computed in float64."""
    means = class_means[present.to(class_means.device)].to(torch.float64)
    if means.shape[0] < 2:
        return float(threshold)
    gaps = (means[:, None, :] - means[None, :, :]).pow(2).sum(2).sqrt()
    gaps.fill_diagonal_(float("inf"))
    return min(float(gaps.min(1).values.max()), float(threshold))


def margin_contrastive_loss(rows: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor, margin: float) -> torch.Tensor:
    """FedTGP's adaptive-margin-enhanced contrastive loss (spec/fedtgp.md T6) on a batch of uploaded rows:
    ``mean_i CE( −(D_i + δ · onehot(y_i)), y_i )`` with ``D`` from :func:`prototype_distances` over all C prototypes,
    i.e. ``−log e^{−(D_{iy}+δ)} / (e^{−(D_{iy}+δ)} + Σ_{j≠y} e^{−D_ij})``: the own class's distance is lengthened by
    the margin, so the row must be nearer its own prototype than any other by δ to be confident. The rows are
    data; gradients reach the prototypes (and what made them)."""
    distances = prototype_distances(rows, prototypes)
    onehot = F.one_hot(labels, prototypes.shape[0]).to(distances.dtype)
    return F.cross_entropy(-(distances + margin * onehot), labels)


def header_loss(header: torch.nn.Module, rows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """FedGH's server loss (spec/fedgh.md GH4) on a batch of uploaded prototypes: ``(1/|b|) Σ_{(p,c)∈b} CE(H(p), c)``,
    every (client, class) row counting once whatever its sample count (ambiguity 6)."""
    return F.cross_entropy(header(rows.float()), labels)
