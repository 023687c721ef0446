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
