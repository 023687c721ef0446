"""MOON (Li, He & Song, CVPR 2021): model-contrastive learning. Card: spec/moon.md.

Clients add ``μ · ℓ_con``, pulling the representation of the local model toward the global model's and
away from the client's previous local model's (one negative), on the penultimate features (card ambiguity
1: no projection head). The previous model is client state; before a client's first participation it is the
initial global model ``w_g^0`` (ambiguity 2). Server and aggregation are FedAvg's.

``projection_head=True`` is official MOON's variant (card §3 "Representation", ambiguity 1): the contrastive
term uses a 256-d projection ``Linear(d,d) → ReLU → Linear(d, 256)`` of the features, and the classifier
reads the projection. The head is part of the model, not of this class, because it is trained and averaged
like any other weight: it must be built by ``build_model`` on the server and on every client and travel in
the flat weight vector. So it is the model option ``model.kwargs.projection_dim`` (256 for the card's head;
:mod:`fedistill.models.projection`), and ``extract`` of such a model returns the projection, which is what
the contrastive term below reads. The switch states the intent and is checked against the model, on the
server before round 1 and on each client, so the two settings cannot silently disagree.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from pydantic import Field

from ..errors import ConfigError
from ..losses import model_contrastive
from ..models.flat import get_flat, set_flat
from ..models.projection import has_projection_head
from ..registry import ALGORITHMS
from .base import ClientContext, Message, RoundInfo, ServerContext
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss, LocalResult


class MoonParams(FedAvgParams):
    mu: float = Field(0.1, ge=0.0, description="μ, weight of the contrastive term (FedLMD Table 6)")
    tau: float = Field(1.0, gt=0.0, description="τ_m, temperature (FedLMD Table 6: 1 or 0.5)")
    projection_head: bool = Field(
        False,
        description="contrast official MOON's projection of the features instead of the features themselves "
        "(card §3, ambiguity 1); the model must be built with model.kwargs.projection_dim (256 in the card)",
    )


@ALGORITHMS.register("moon")
class Moon(FedAvg):
    """MOON: FedAvg plus a model-contrastive term on the features."""

    name = "moon"
    Params = MoonParams
    needs_features = True

    def _check_model(self, model: torch.nn.Module) -> None:
        if has_projection_head(model) == self.params.projection_head:
            return
        if self.params.projection_head:
            raise ConfigError(
                "algorithm.projection_head: MOON's projection head is a model option; "
                "set model.kwargs.projection_dim (256 in spec/moon.md)"
            )
        raise ConfigError(
            "model.kwargs.projection_dim: the model has a projection head but MOON's projection_head is false; "
            "set algorithm.projection_head: true (or remove the model option)"
        )

    def init_server(self, server: ServerContext) -> None:
        self._check_model(server.model)  # before round 1: both settings come from the same configuration

    def _frozen(self, client: ClientContext, attr: str, weights: torch.Tensor) -> torch.nn.Module:
        # Two frozen modules per process (global, previous), reloaded per client; never a copy per client.
        model = getattr(self, attr, None)
        if model is None:
            model = copy.deepcopy(client.model).requires_grad_(False)
            setattr(self, attr, model)
        set_flat(model, weights)
        return model.eval()

    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss:
        self._check_model(client.model)
        prev_weights = client.state.get("moon_prev")
        if prev_weights is None:
            prev_weights = client.initial_weights if client.initial_weights is not None else msg["weights"]
        global_model = self._frozen(client, "_global_model", msg["weights"])
        prev_model = self._frozen(client, "_prev_model", prev_weights)
        mu, tau = self.params.mu, self.params.tau

        def contrastive(model, x, y, logits, features):
            # ``features`` is model.extract(x): the projection when the model has the head (card §3).
            with torch.no_grad():
                z_global = global_model.extract(x)
                z_prev = prev_model.extract(x)
            return mu * model_contrastive(features, z_global, z_prev, tau)

        return contrastive

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[object, dict[str, torch.Tensor]] | None:
        """The same term on a cohort step (engine/cohort.py): the global and previous weights as each client's rows,
        their features computed in the step without gradient."""
        if self.params.grad_clip is not None:
            return None
        self._check_model(client.model)
        prev = client.state.get("moon_prev")
        if prev is None:
            prev = client.initial_weights if client.initial_weights is not None else msg["weights"]
        mu, tau = self.params.mu, self.params.tau

        def contrastive(params, x, y, logits, mask, fixed):
            return mu * model_contrastive(fixed["features"], fixed["moon_global.features"], fixed["moon_prev.features"], tau, weights=mask)

        contrastive.needs_features = True
        contrastive.frozen_features = ("moon_global", "moon_prev")
        return contrastive, {"moon_global": get_flat(client.model), "moon_prev": prev.to(torch.float32)}

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        return ()  # the global and previous models are two modules loaded in place

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        client.state["moon_prev"] = get_flat(client.model)  # prev[k] <- the weights this client uploads
        return {}
