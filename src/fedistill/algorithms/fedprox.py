"""FedProx (Li et al., MLSys 2020). Card: spec/fedprox.md.

FedAvg plus one local loss term: ``(μ/2) Σ ||P − P_anchor||²`` pulls every trainable tensor back toward the
weights the client received this round (card §3). Server, sampling and aggregation are FedAvg's.

``implementation="grad_hook"`` is the equivalent form the card names in §3 "Numerics" (tested in §7): no
loss term, and ``μ (P − P_anchor)`` is added to ``.grad`` right before the optimizer step through the
``grad_correction`` hook. It gives the same weights up to float rounding; its reported ``train_loss`` is the
CE alone, since the penalty is never evaluated.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
from pydantic import Field

from ..engine.cohort import proximal_term as cohort_proximal_term
from ..losses import proximal_term
from ..models.flat import flat_parameters
from ..registry import ALGORITHMS
from .base import ClientContext, Message
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss


class FedProxParams(FedAvgParams):
    mu: float = Field(0.5, ge=0.0, description="proximal coefficient μ (FedLMD Table 6 uses 0.5 everywhere)")
    implementation: Literal["loss", "grad_hook"] = Field(
        "loss",
        description="loss: (μ/2)||w − w_anchor||² in the loss; grad_hook: μ(w − w_anchor) added to .grad before "
        "the step (card §3 'Numerics'; §7: both give the same weights)",
    )


@ALGORITHMS.register("fedprox")
class FedProx(FedAvg):
    """FedProx: FedAvg with a proximal term toward the round's global weights."""

    name = "fedprox"
    Params = FedProxParams
    resident_weights = True  # checked for run.resident_weights (protocol.Algorithm)
    adds_proximal_term = True

    @staticmethod
    def _anchored(client: ClientContext) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
        params = [p for p in client.model.parameters() if p.requires_grad]
        # Detached copies of the received weights: the anchor never changes during the round (card §3;
        # ambiguity 1: trainable parameters only, not BatchNorm buffers).
        return params, client.fixed_list("fedprox.anchor", [p.detach().clone() for p in params])

    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss | None:
        if self.params.implementation != "loss":
            return None
        params, anchors = self._anchored(client)
        mu = self.params.mu
        return lambda model, x, y, logits, features: proximal_term(params, anchors, mu)

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[object, dict[str, torch.Tensor]] | None:
        """The loss form batches (engine/cohort.py ``proximal_term``, the anchor each client's received weights);
        the gradient-hook form and a gradient clip keep the sequential step."""
        if self.params.implementation != "loss" or self.params.grad_clip is not None:
            return None
        return cohort_proximal_term(self.params.mu), {"global": flat_parameters(client.model)}

    def cohort_batches(self) -> bool:
        return super().cohort_batches() and self.params.implementation == "loss"

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        return ()  # anchors through client.fixed; μ and the implementation are the same for every client

    def grad_correction(self, client: ClientContext, msg: Message) -> Callable[[torch.nn.Module], None] | None:
        if self.params.implementation != "grad_hook":
            return None
        params, anchors = self._anchored(client)
        mu = self.params.mu

        @torch.no_grad()
        def proximal_gradient(model: torch.nn.Module) -> None:
            # The gradient of (μ/2)||P − P_anchor||², added where autograd would have added it (card §3);
            # a tensor the forward did not use gets it alone, as it would from the loss term.
            for p, a in zip(params, anchors):
                if p.grad is None:
                    p.grad = mu * (p - a)
                else:
                    p.grad.add_(p - a, alpha=mu)

        return proximal_gradient
