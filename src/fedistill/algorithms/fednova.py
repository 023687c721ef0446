"""FedNova (Wang et al., NeurIPS 2020). Card: spec/fednova.md.

Clients train exactly as in FedAvg and also report how many local steps they took. The server divides
each client's change by its effective number of steps ``a_k`` (momentum-aware), averages those normalised
directions and rescales by ``τ_eff = Σ p_k a_k``, so clients that ran more steps no longer dominate (card §3):

    w_g ← w_g − τ_eff · Σ_k p_k (w_g − w_k) / a_k

Optional ``ccvr="fedntd_quirk"`` (card §3 "Optional variant", ambiguity 1; off by default): the reference
code's cross-client variance reduction as it actually runs. Every local gradient is shifted by
``c_k = d̄ − d_k^prev`` where ``d̄`` is never updated (≡ 0), so ``g ← g − d_k^prev`` with
``d_k = (w_g − w_k) / (η_t a_k)`` stored by client k after each participation (zero before its first).
``d_k^prev`` is client state over the trainable parameters; it is checkpointed like SCAFFOLD's ``c_k``.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch
from pydantic import Field

from ..engine.cohort import GRADIENT_OFFSET
from ..models.flat import add_to_gradients, flat_parameters, trainable_mask, trainable_parameters
from ..registry import ALGORITHMS
from .aggregate import aggregation_weights
from .base import ClientContext, Message, RoundInfo
from .fedavg import FedAvg, FedAvgParams
from .local import LocalResult, effective_local_steps


# FedNova's a_k is the momentum-aware step count shared with SCAFFOLD.
nova_normaliser = effective_local_steps


class FedNovaParams(FedAvgParams):
    ccvr: Literal["none", "fedntd_quirk"] = Field(
        "none",
        description="fedntd_quirk: shift every local gradient by −d_k^prev as the reference code does "
        "(card §3 'Optional variant' and ambiguity 1; not part of published FedNova)",
    )


@ALGORITHMS.register("fednova")
class FedNova(FedAvg):
    """FedNova: FedAvg whose aggregation normalises each client's update by its local steps."""

    name = "fednova"
    Params = FedNovaParams
    assumes_plain_sgd = True  # a_k counts momentum-SGD steps on the CE alone (card §3)

    def grad_correction(self, client: ClientContext, msg: Message) -> Callable[[torch.nn.Module], None] | None:
        d_prev = client.state.get("fednova_d") if self.params.ccvr == "fedntd_quirk" else None
        if d_prev is None:  # ccvr off, or the client's first participation: the shift is zero (card ambiguity 1)
            return None
        # g ← g + (d̄ − d_k^prev) with d̄ ≡ 0 in the reference code; weight decay and momentum follow.
        return add_to_gradients(trainable_parameters(client.model), client.fixed("fednova.d_prev", d_prev), sign=-1.0)

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[object, dict[str, torch.Tensor]] | None:
        """On a cohort step (engine/cohort.py) the plain step, or with the quirk's shift −d_k^prev as the client's
        gradient offset. Every client of a cohort has the same fixed keys, so a client without d_k^prev (its first
        participation) gets a zero offset when the quirk is on."""
        if self.params.grad_clip is not None:
            return None
        if self.params.ccvr != "fedntd_quirk":
            return None, {}
        size = sum(p.numel() for p in trainable_parameters(client.model))
        d_prev = client.state.get("fednova_d")
        return None, {GRADIENT_OFFSET: -(d_prev if d_prev is not None else torch.zeros(size))}

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        return ()  # d_k^prev through client.fixed (a client without one has the plain step)

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        if self.params.ccvr == "fedntd_quirk" and result.steps > 0 and info.lr > 0:
            # d_k = (w_g − w_k) / (η_t a_k) over the trainable parameters (card §3); with no step taken
            # the previous d_k is kept, since nothing was learnt to replace it (and η_t = 0 would divide by 0).
            a_k = nova_normaliser(result.steps, self.local.momentum)
            drift = msg["weights"][trainable_mask(client.model)].double() - flat_parameters(client.model).double()
            client.state["fednova_d"] = (drift / (info.lr * a_k)).float()
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
