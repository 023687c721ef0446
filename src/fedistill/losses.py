"""Loss terms as pure functions (``torch.nn.functional`` style), each citing its card's equation.

Algorithms compose them into the local objective through ``local_sgd(extra_loss=...)``; the invariants
listed in the cards are tested in ``tests/test_losses.py``.
"""

from __future__ import annotations

from typing import Iterable

import torch


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
