"""Evaluation of a model on batches (accuracy, loss, predicted-class histogram, per-sample hits) and the bf16
autocast context every forward pass uses. Below the methods: the engine evaluates the global and the
personalised models with it; ``fedistill.algorithms.local`` re-exports both for the methods."""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


def autocast_context(precision: str, device: torch.device):
    """bf16 autocast (fp32 master weights and optimizer) when ``precision == 'bf16'``; else a no-op."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")



class Evaluation(NamedTuple):
    accuracy: float  # top-1, as a fraction
    loss: float  # mean cross-entropy
    predictions: torch.Tensor  # (C,) int64: how often each class was predicted (FedLMD Fig. 2 diagnostic)
    correct: torch.Tensor | None = None  # (N,) bool per sample, in batch order, when asked for (per_sample)


class EvaluationTotals(NamedTuple):
    """What :func:`evaluation_totals` accumulates, on the model's device (a captured evaluation's outputs)."""

    correct: torch.Tensor  # () int64: samples classified right
    loss_sum: torch.Tensor  # () float64: summed cross-entropy
    predicted: torch.Tensor  # (C,) int64 predicted-class counts
    hits: torch.Tensor | None  # (N,) bool per sample, with per_sample
    count: int  # samples seen (known on the host: batch shapes)


def evaluation_totals(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    precision: str = "fp32",
    per_sample: bool = False,
) -> EvaluationTotals:
    """The sums behind :func:`evaluate`, left on the model's device: no host synchronisation, so the whole loop
    can be captured as one CUDA graph (engine/cuda_graphs.py, ``GraphedEvaluation``). Call in inference mode
    with the model in eval mode."""
    correct: torch.Tensor | int = 0
    loss_sum: torch.Tensor | float = 0.0
    predicted: torch.Tensor | None = None  # (C,) int64 counts on the model's device
    hits: list[torch.Tensor] = []
    n = 0
    for xb, yb in batches:
        with autocast_context(precision, xb.device):
            logits = model(xb).float()
        loss_sum = loss_sum + F.cross_entropy(logits, yb, reduction="sum").double()
        guesses = logits.argmax(1)
        right = guesses == yb
        correct = correct + right.sum()
        if per_sample:
            hits.append(right)
        # A (B, C) comparison summed over the batch: bincount's output size depends on the data, so on a GPU it
        # reads the largest guess back to the host once per batch (issue 29's profile: 200 waits a round), and
        # an index_add_ histogram uses atomics (or, in deterministic mode, a sort). B x C compares are nothing.
        counts = (guesses[:, None] == torch.arange(logits.shape[1], device=guesses.device)).sum(0)
        predicted = counts if predicted is None else predicted + counts
        n += yb.shape[0]
    if n == 0 or predicted is None:
        raise ValueError("evaluate: no samples")
    assert isinstance(correct, torch.Tensor) and isinstance(loss_sum, torch.Tensor)
    return EvaluationTotals(correct, loss_sum, predicted, torch.cat(hits) if per_sample else None, n)


def read_totals(totals: EvaluationTotals) -> Evaluation:
    """The :class:`Evaluation` of device-side totals, read to the host in one copy (one wait on a GPU, not three).

    The counts travel as float64, exact below 2**53, so the numbers are the ones separate reads would give."""
    packed = torch.cat([totals.correct.double().view(1), totals.loss_sum.double().view(1), totals.predicted.double()]).cpu()
    n = totals.count
    predicted = packed[2:].to(torch.int64)
    hits = totals.hits.cpu() if totals.hits is not None else None
    return Evaluation(float(packed[0]) / n, float(packed[1]) / n, predicted, hits)


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    precision: str = "fp32",
    per_sample: bool = False,
) -> Evaluation:
    """Top-1 accuracy, mean cross-entropy and the predicted-class histogram of ``model`` over ``(x, y)``
    batches; with ``per_sample`` also which samples were right (personalised accuracy per client split)."""
    model.eval()
    # Accumulated on the model's device and read once at the end: no host synchronisation per batch.
    return read_totals(evaluation_totals(model, batches, precision, per_sample))
