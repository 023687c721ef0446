"""FedProx (Li et al., MLSys 2020). Card: spec/fedprox.md.

FedAvg plus one local loss term: ``(μ/2) Σ ||P − P_anchor||²`` pulls every trainable tensor back toward the
weights the client received this round (card §3). Server, sampling and aggregation are FedAvg's.
"""

from __future__ import annotations

from pydantic import Field

from ..losses import proximal_term
from ..registry import ALGORITHMS
from .base import ClientContext, Message
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss


class FedProxParams(FedAvgParams):
    mu: float = Field(0.5, ge=0.0, description="proximal coefficient μ (FedLMD Table 6 uses 0.5 everywhere)")


@ALGORITHMS.register("fedprox")
class FedProx(FedAvg):
    """FedProx: FedAvg with a proximal term toward the round's global weights."""

    name = "fedprox"
    Params = FedProxParams

    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss:
        params = [p for p in client.model.parameters() if p.requires_grad]
        # Detached copies of the received weights: the anchor never changes during the round (card §3;
        # ambiguity 1: trainable parameters only, not BatchNorm buffers).
        anchors = [p.detach().clone() for p in params]
        mu = self.params.mu
        return lambda model, x, y, logits, features: proximal_term(params, anchors, mu)
