"""SCAFFOLD (Karimireddy et al., ICML 2020), option II with momentum-aware K_eff. Card: spec/scaffold.md.

Every local gradient is corrected by ``c − c_k`` (server and client control variates) before the optimizer
step. After training the client refreshes ``c_k⁺ = c_k − c + (w_g − y)/(K_eff η_t)`` and uploads
``Δc_k = c_k⁺ − c_k`` with its weights; the server averages the weights as FedAvg and moves
``c ← c + (1/N) Σ_k Δc_k`` with N the whole population (card §3). Control variates cover trainable
parameters only, flattened in ``model.parameters()`` order, and are stored in float32.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..engine.cohort import GRADIENT_OFFSET
from ..engine.state_store import as_stored
from ..models.flat import add_to_gradients, flat_parameters, trainable_mask, trainable_parameters
from ..registry import ALGORITHMS
from .base import ClientContext, Message, RoundInfo, ServerContext
from .fedavg import FedAvg, FedAvgParams
from .local import LocalResult, effective_local_steps


@ALGORITHMS.register("scaffold")
class Scaffold(FedAvg):
    """SCAFFOLD: FedAvg with control variates correcting client drift."""

    name = "scaffold"
    Params = FedAvgParams
    resident_weights = True  # checked for run.resident_weights (protocol.Algorithm)

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        server.state["scaffold_c"] = torch.zeros_like(flat_parameters(server.model))

    def broadcast_extras(self, server: ServerContext, info: RoundInfo, cid: int) -> dict[str, Any]:
        return {"control": server.state["scaffold_c"]}

    def after_aggregate(self, server: ServerContext, info: RoundInfo, replies: list[Message], cids: list[int]) -> dict[str, float]:
        total = torch.zeros_like(server.state["scaffold_c"], dtype=torch.float64)
        for reply in replies:
            total += reply["control_delta"].double()
        # c ← c + (1/N) Σ Δc_k over the sampled clients, N = every client (card §3 and ambiguity 4).
        server.state["scaffold_c"] = (server.state["scaffold_c"].double() + total / server.num_clients).float()
        return {}

    # -- client ---------------------------------------------------------------------------------
    def _client_control(self, client: ClientContext, like: torch.Tensor) -> torch.Tensor:
        """c_k, on the device of the server's c as received (``like``): the host, or the GPU where the round keeps
        weights resident (run.resident_weights); add_to_gradients moves the correction to the parameters."""
        if "scaffold_c" not in client.state:
            client.state["scaffold_c"] = torch.zeros(like.numel(), device=like.device)  # c_k starts at 0 (card §2)
        # On a GPU the executor hands a stored c_k over on the device (issue 29): read it where the messages are.
        return client.state["scaffold_c"].to(like.device)

    def grad_correction(self, client: ClientContext, msg: Message) -> Callable[[torch.nn.Module], None]:
        correction = client.fixed("scaffold.correction", msg["control"] - self._client_control(client, msg["control"]))
        # ĝ = g − c_k + c, then the optimizer adds weight decay and momentum as usual (card §3).
        return add_to_gradients(trainable_parameters(client.model), correction)

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[object, dict[str, torch.Tensor]] | None:
        """On a cohort step (engine/cohort.py) c − c_k is the client's gradient offset (no loss term)."""
        if self.params.grad_clip is not None:
            return None
        c = msg["control"]
        return None, {GRADIENT_OFFSET: c - self._client_control(client, c)}

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        return ()  # c − c_k through client.fixed

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        c = msg["control"]
        c_k = self._client_control(client, c)
        if result.steps == 0 or info.lr <= 0:
            return {"control_delta": torch.zeros_like(c_k)}  # no step taken: c_k stays (card §3 numerics)
        k_eff = effective_local_steps(result.steps, self.local.momentum)
        # The global trainable weights this round are the broadcast vector restricted to parameters.
        global_params = msg["weights"][trainable_mask(client.model).to(msg["weights"].device)]
        drift = global_params.double() - flat_parameters(client.model).double()
        c_new = (c_k.double() - c.double() + drift / (k_eff * info.lr)).float()
        # Δc_k of the value the client keeps (rounded when the state is stored in bf16), so that the server's
        # c stays the mean of the c_k the clients hold (card §7) instead of drifting by the rounding.
        c_new = as_stored(c_new, client.state_dtype)
        delta = c_new - c_k
        client.state["scaffold_c"] = c_new
        return {"control_delta": delta}
