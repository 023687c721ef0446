"""FedNova (Wang et al., NeurIPS 2020). Card: spec/fednova.md.

Clients train exactly as in FedAvg and also report how many local steps they took. The server divides
each client's change by its effective number of steps ``a_k`` (momentum-aware), averages those normalised
directions and rescales by ``τ_eff = Σ p_k a_k``, so clients that ran more steps no longer dominate (card §3):

    w_g ← w_g − τ_eff · Σ_k p_k (w_g − w_k) / a_k
"""

from __future__ import annotations

from typing import Any

import torch

from ..registry import ALGORITHMS
from .aggregate import aggregation_weights
from .base import ClientContext, Message, RoundInfo
from .fedavg import FedAvg, FedAvgParams
from .local import LocalResult, effective_local_steps


# FedNova's a_k is the momentum-aware step count shared with SCAFFOLD.
nova_normaliser = effective_local_steps


@ALGORITHMS.register("fednova")
class FedNova(FedAvg):
    """FedNova: FedAvg whose aggregation normalises each client's update by its local steps."""

    name = "fednova"
    Params = FedAvgParams

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        # Counted steps, not planned ones (card ambiguity 2); the normaliser is computed on the server.
        return {"local_steps": result.steps}

    def combine(self, global_vec: torch.Tensor, replies: list[Message]) -> torch.Tensor:
        active = [r for r in replies if int(r["local_steps"]) > 0]  # τ_k = 0 contributes nothing (card §3)
        if not active:
            return global_vec.clone()
        p = aggregation_weights([int(r["num_samples"]) for r in active], self.params.weighting)
        a = [nova_normaliser(int(r["local_steps"]), self.local.momentum) for r in active]
        tau_eff = sum(float(pk) * ak for pk, ak in zip(p, a))
        # Accumulate in float64: the normalised differences are small against the weights themselves.
        g = global_vec.double()
        step = torch.zeros_like(g)
        for r, pk, ak in zip(active, p.tolist(), a):
            step.add_(g - r["weights"].double(), alpha=pk / ak)
        return (g - tau_eff * step).float()
