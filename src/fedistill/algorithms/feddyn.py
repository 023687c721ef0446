"""FedDyn (Acar et al., ICLR 2021): dynamic regularisation. Card: spec/feddyn.md.

Client loss ``CE − ⟨g_k, w⟩ + (α/2)||w − w_anchor||²`` with a persistent linear term ``g_k``, refreshed after
training as ``g_k ← g_k − α (w_k − w_anchor)``. The server keeps ``h ← h − (α/K) Σ_k (w_k − w_anchor)`` and sets
``w_g = mean_k w_k − h/α`` (card §3). Trainable parameters only; BatchNorm statistics are averaged plainly.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from ..losses import dynamic_regulariser
from ..models.flat import flat_parameters, trainable_mask, trainable_parameters
from ..registry import ALGORITHMS
from .base import ClientContext, Message, RoundInfo, ServerContext
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss, LocalResult


class FedDynParams(FedAvgParams):
    alpha: float = Field(0.1, gt=0.0, description="α (Lee-Gihun/FedNTD default); 0 would divide by zero")
    weighting: Literal["samples", "uniform"] = Field("uniform", description="mean over S_t (card ambiguity 1)")


@ALGORITHMS.register("feddyn")
class FedDyn(FedAvg):
    """FedDyn: FedAvg with a dynamic linear + proximal regulariser and a server correction h."""

    name = "feddyn"
    Params = FedDynParams

    # -- client ---------------------------------------------------------------------------------
    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss:
        params = trainable_parameters(client.model)
        anchors = [p.detach().clone() for p in params]
        g = client.state.setdefault("feddyn_g", torch.zeros(sum(p.numel() for p in params)))
        g_pieces = [piece.view_as(p).to(p.device) for piece, p in zip(g.split([p.numel() for p in params]), params)]
        alpha = self.params.alpha

        return lambda model, x, y, logits, features: dynamic_regulariser(params, anchors, g_pieces, alpha)

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        anchor = msg["weights"][trainable_mask(client.model)]  # the broadcast trainable weights
        drift = flat_parameters(client.model).double() - anchor.double()
        client.state["feddyn_g"] = (client.state["feddyn_g"].double() - self.params.alpha * drift).float()
        return {}

    # -- server ---------------------------------------------------------------------------------
    def adjust_combined(
        self, server: ServerContext, global_vec: torch.Tensor, combined: torch.Tensor, replies: list[Message]
    ) -> torch.Tensor:
        mask = trainable_mask(server.model)
        drift_sum = torch.zeros(int(mask.sum()), dtype=torch.float64)
        for r in replies:
            drift_sum += (r["weights"][mask].double() - global_vec[mask].double())
        h = server.state.get("feddyn_h", torch.zeros(int(mask.sum()))).double()
        h = h - (self.params.alpha / server.num_clients) * drift_sum
        server.state["feddyn_h"] = h.float()
        corrected = combined.double()
        corrected[mask] -= h / self.params.alpha  # w_g = mean_k w_k − h/α (card §3)
        return corrected.float()
