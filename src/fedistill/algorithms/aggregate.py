"""Aggregation of flat weight vectors and server optimisers (fedavg.md §3).

Server optimisers turn the aggregate into the next global model. They see the old global vector and the
aggregate, so FedAvgM, FedAdam and plain replacement are interchangeable ingredients. They step every entry;
``FedAvg.aggregate`` then overwrites the non-trainable ones (BatchNorm statistics) with the plain weighted mean.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def aggregation_weights(num_samples: Sequence[int], weighting: str = "samples") -> torch.Tensor:
    """``p_k = n_k / sum_j n_j`` (``samples``) or ``1/m`` (``uniform``), float64; clients with n_k = 0 get 0.

    Clients with no data are excluded and the rest renormalised (fedavg.md §3, "Numerics").
    """
    n = torch.tensor(list(num_samples), dtype=torch.float64)
    if weighting == "samples":
        w = n.clone()
    elif weighting == "uniform":
        w = (n > 0).double()
    else:
        raise ValueError(f"unknown weighting {weighting!r}")
    total = w.sum()
    if total <= 0:
        raise ValueError("no client with data to aggregate")
    return w / total


def weighted_mean(vectors: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """``sum_k p_k v_k`` accumulated in float32 (in client order, so the result is order-deterministic)."""
    out = torch.zeros_like(vectors[0], dtype=torch.float32)
    for v, p in zip(vectors, weights.tolist()):
        if p != 0.0:
            out.add_(v.float(), alpha=p)
    return out


class ServerOptimizer:
    """Maps (old global, aggregate) to the new global model; the base class takes the aggregate.

    Any state (momentum buffers, Adam moments) lives in the ``state`` dict it is given, which is the
    server's persistent state: the engine checkpoints it, so optimisers hold no hidden state.
    """

    def step(self, state: dict[str, Any], global_vec: torch.Tensor, aggregate: torch.Tensor) -> torch.Tensor:
        return aggregate


class ServerMomentum(ServerOptimizer):
    """FedAvgM (Hsu et al. 2019; fedavg.md §3): heavy-ball momentum on the pseudo-gradient.

    ``Δ_t = w_g - w_agg``, ``m_t = β m_{t-1} + Δ_t``, ``w_g <- w_g - η_s m_t`` with ``m_0 = 0`` and no
    dampening (card ambiguity 4). The buffer and the update are kept in float64: the difference of two
    float32 vectors is then exact, so with β = 0 (or in round 1, where m_1 = Δ_1) the new global model
    equals FedAvg's aggregate bit for bit, as the card's invariant requires.
    """

    def __init__(self, momentum: float, server_lr: float = 1.0) -> None:
        self.momentum = momentum
        self.server_lr = server_lr

    def step(self, state: dict[str, Any], global_vec: torch.Tensor, aggregate: torch.Tensor) -> torch.Tensor:
        old = global_vec.double()
        delta = old - aggregate.double()
        buffer = state.get("server_momentum")
        if buffer is None:
            buffer = delta
        else:
            buffer.mul_(self.momentum).add_(delta)
        state["server_momentum"] = buffer
        return (old - self.server_lr * buffer).float()


class ServerAdam(ServerOptimizer):
    """FedAdam (Reddi et al. 2021, Alg. 2; spec/fmtl-baselines.md §2), no bias correction.

    ``Δ = w_agg − w_g``, ``m = β1 m + (1−β1) Δ``, ``v = β2 v + (1−β2) Δ²``, ``w_g ← w_g + η m / (√v + τ)``
    on every entry; the caller (``FedAvg.aggregate``) then gives the entries that are not trainable
    parameters (BatchNorm statistics) the plain weighted mean, as it does for every server optimiser.
    Moments start at 0 (card ambiguity a) and live in the server state, in float64.
    """

    def __init__(self, lr: float, beta1: float, beta2: float, tau: float) -> None:
        self.lr, self.beta1, self.beta2, self.tau = lr, beta1, beta2, tau

    def step(self, state: dict[str, Any], global_vec: torch.Tensor, aggregate: torch.Tensor) -> torch.Tensor:
        old = global_vec.double()
        delta = aggregate.double() - old
        m = state.get("adam_m")
        v = state.get("adam_v")
        if m is None:
            m, v = torch.zeros_like(old), torch.zeros_like(old)
        m.mul_(self.beta1).add_(delta, alpha=1 - self.beta1)
        v.mul_(self.beta2).addcmul_(delta, delta, value=1 - self.beta2)
        state["adam_m"], state["adam_v"] = m, v
        return (old + self.lr * m / (v.sqrt() + self.tau)).float()
