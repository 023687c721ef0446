"""MOON (Li, He & Song, CVPR 2021): model-contrastive learning. Card: spec/moon.md.

Clients add ``μ · ℓ_con``, pulling the representation of the local model toward the global model's and
away from the client's previous local model's (one negative), on the penultimate features (card ambiguity
1: no projection head). The previous model is client state; before a client's first participation it is the
initial global model ``w_g^0`` (ambiguity 2). Server and aggregation are FedAvg's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from pydantic import Field

from ..losses import model_contrastive
from ..models.flat import get_flat, set_flat
from ..registry import ALGORITHMS
from .base import ClientContext, Message, RoundInfo
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss, LocalResult


class MoonParams(FedAvgParams):
    mu: float = Field(0.1, ge=0.0, description="μ, weight of the contrastive term (FedLMD Table 6)")
    tau: float = Field(1.0, gt=0.0, description="τ_m, temperature (FedLMD Table 6: 1 or 0.5)")


@ALGORITHMS.register("moon")
class Moon(FedAvg):
    """MOON: FedAvg plus a model-contrastive term on the features."""

    name = "moon"
    Params = MoonParams
    needs_features = True

    def _frozen(self, client: ClientContext, attr: str, weights: torch.Tensor) -> torch.nn.Module:
        # Two frozen modules per process (global, previous), reloaded per client; never a copy per client.
        model = getattr(self, attr, None)
        if model is None:
            model = copy.deepcopy(client.model).requires_grad_(False)
            setattr(self, attr, model)
        set_flat(model, weights)
        return model.eval()

    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss:
        prev_weights = client.state.get("moon_prev")
        if prev_weights is None:
            prev_weights = client.initial_weights if client.initial_weights is not None else msg["weights"]
        global_model = self._frozen(client, "_global_model", msg["weights"])
        prev_model = self._frozen(client, "_prev_model", prev_weights)
        mu, tau = self.params.mu, self.params.tau

        def contrastive(model, x, y, logits, features):
            with torch.no_grad():
                z_global = global_model.extract(x)
                z_prev = prev_model.extract(x)
            return mu * model_contrastive(features, z_global, z_prev, tau)

        return contrastive

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        client.state["moon_prev"] = get_flat(client.model)  # prev[k] <- the weights this client uploads
        return {}
