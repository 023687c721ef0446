"""FedDyn (Acar et al., ICLR 2021): dynamic regularisation. Card: spec/feddyn.md.

Client loss ``CE − ⟨g_k, w⟩ + (α/2)||w − w_anchor||²`` with a persistent linear term ``g_k``, refreshed after
training as ``g_k ← g_k − α (w_k − w_anchor)``. The server keeps ``h ← h − (α/K) Σ_k (w_k − w_anchor)`` and sets
``w_g = mean_k w_k − h/α`` (card §3). Trainable parameters only; BatchNorm statistics are averaged plainly.

``adaptive_alpha=True`` reproduces the official code's per-client coefficient (card §3 and ambiguity 2):
client k uses ``α_k = α·N/(n_k·K)`` (``N = Σ_all n_j``) in its loss and in its ``g_k`` update. The server
computes ``α_k`` from the population's sizes (``ServerContext.client_num_samples``) and sends it with the
weights. The server update stays as above with the global α: the official server adds the plain mean of the
clients' accumulated drifts, ``(1/K) Σ_all Σ_t (w_k − w_anchor)``, which is exactly ``−h/α`` whatever the α_k,
so with the flag on ``h/α == (1/K) Σ_k g_k/α_k`` replaces the invariant ``h == (1/K) Σ_k g_k``. The official
code's gradient clipping (norm 10, in all its methods) is not tied to this flag: set ``grad_clip: 10``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from ..engine.cohort import params_vector
from ..errors import ConfigError
from ..losses import dynamic_regulariser
from ..models.flat import flat_parameters, split_like, trainable_mask, trainable_parameters
from ..registry import ALGORITHMS
from .base import ClientContext, Message, RoundInfo, ServerContext
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss, LocalResult


class FedDynParams(FedAvgParams):
    alpha: float = Field(0.1, gt=0.0, description="α (Lee-Gihun/FedNTD default); 0 would divide by zero")
    weighting: Literal["samples", "uniform"] = Field("uniform", description="mean over S_t (card ambiguity 1)")
    adaptive_alpha: bool = Field(
        False,
        description="per-client α_k = α·N/(n_k·K) of the official code (card §3 and ambiguity 2); "
        "needs the server to know every client's n_j",
    )


def client_alpha(alpha: float, client_num_samples: tuple[int, ...], cid: int) -> float:
    """``α_k = α·N/(n_k·K)`` with ``N = Σ_j n_j`` over all K clients (official ``alpha / weight_list[k]``).

    A client without data never takes a step, so its coefficient is irrelevant; it gets α.
    """
    n_k = int(client_num_samples[cid])
    if n_k <= 0:
        return float(alpha)
    return float(alpha) * sum(int(n) for n in client_num_samples) / (n_k * len(client_num_samples))


@ALGORITHMS.register("feddyn")
class FedDyn(FedAvg):
    """FedDyn: FedAvg with a dynamic linear + proximal regulariser and a server correction h."""

    name = "feddyn"
    Params = FedDynParams
    adds_proximal_term = True

    # -- client ---------------------------------------------------------------------------------
    def _alpha(self, msg: Message) -> float:
        # α_k travels with the weights when adaptive (the client does not know the population); else α.
        return float(msg["feddyn_alpha"]) if self.params.adaptive_alpha else self.params.alpha

    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss:
        params = trainable_parameters(client.model)
        anchors = client.fixed_list("feddyn.anchor", [p.detach().clone() for p in params])
        g = client.state.setdefault("feddyn_g", torch.zeros(sum(p.numel() for p in params)))
        g_pieces = split_like(client.fixed("feddyn.g", g), params)
        alpha = self._alpha(msg)

        return lambda model, x, y, logits, features: dynamic_regulariser(params, anchors, g_pieces, alpha)

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[object, dict[str, torch.Tensor]] | None:
        """The same terms on a cohort step (engine/cohort.py): the anchor, g_k and α_k as each client's rows."""
        if self.params.grad_clip is not None:
            return None
        anchor = flat_parameters(client.model)  # the received trainable weights
        g = client.state.setdefault("feddyn_g", torch.zeros(anchor.numel()))

        def dyn(params, x, y, logits, mask, fixed):
            return dynamic_regulariser([params_vector(params)], [fixed["anchor"]], [fixed["feddyn_g"]], fixed["alpha"])

        alpha = torch.tensor(float(self._alpha(msg)), device=anchor.device)
        return dyn, {"anchor": anchor, "feddyn_g": g.to(anchor.device), "alpha": alpha}

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        return (self._alpha(msg),)  # anchors and g_k through client.fixed; α_k is a Python number (per client when adaptive)

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        anchor = msg["weights"][trainable_mask(client.model)]  # the broadcast trainable weights
        drift = flat_parameters(client.model).double() - anchor.double()
        # .cpu(): on a GPU the executor hands the stored g_k over on the device, the message is on the host (issue 29).
        client.state["feddyn_g"] = (client.state["feddyn_g"].double().cpu() - self._alpha(msg) * drift).float()
        return {}

    # -- server ---------------------------------------------------------------------------------
    def broadcast_extras(self, server: ServerContext, info: RoundInfo, cid: int) -> dict[str, Any]:
        if not self.params.adaptive_alpha:
            return {}
        sizes = server.client_num_samples
        if sizes is None or len(sizes) != server.num_clients:
            raise ConfigError(
                "algorithm.adaptive_alpha: FedDyn's α_k = α·N/(n_k·K) needs every client's sample count on the "
                "server (ServerContext.client_num_samples), and this deployment does not provide it"
            )
        return {"feddyn_alpha": client_alpha(self.params.alpha, sizes, cid)}

    def adjust_combined(
        self, server: ServerContext, global_vec: torch.Tensor, combined: torch.Tensor, replies: list[Message]
    ) -> torch.Tensor:
        mask = trainable_mask(server.model)
        drift_sum = torch.zeros(int(mask.sum()), dtype=torch.float64)
        global_trainable = global_vec[mask].double()  # once, not once per reply: the same numbers
        for r in replies:
            drift_sum += r["weights"][mask].double() - global_trainable
        h = server.state.get("feddyn_h", torch.zeros(int(mask.sum()))).double()
        h = h - (self.params.alpha / server.num_clients) * drift_sum
        server.state["feddyn_h"] = h.float()
        corrected = combined.double()
        corrected[mask] -= h / self.params.alpha  # w_g = mean_k w_k − h/α (card §3)
        return corrected.float()
