"""LG-FedAvg (Liang et al., "Think Locally, Act Globally", 2020; HtFLlib's ``LG-FedAvg``): private feature
extractors of any architecture and one shared head, averaged by FedAvg. Card: spec/lg-fedavg.md.

Default (HtFLlib's heterogeneous form, card ambiguity 1): what is shared is the client model's ``classifier``,
Linear(d, C), every member of the assignment ending in the same feature dimension d (the engine refuses one that
does not, in one line). The server keeps the global head in its state, built from its own seeded stream (card
ambiguity 4). Client k, each round it is selected,

1. replaces its head by the broadcast one (L1, also in the first round);
2. trains E epochs of plain SGD on CE over its whole model, extractor and head jointly (L2);
3. uploads its trained head and its training-set size n_k (L3); the extractor never leaves it.

The server averages the arrived heads weighted by n_k / Σ n_j (L4; ``weighting="uniform"``: L5). Inference: the
client's own extractor with the new global head (personal model "assembled": the evaluation message is the next
round's broadcast, not counted as communication).

``variant="paper"`` (the authors' code): one architecture for all clients (refused otherwise, in one line); the
shared part is the last ``num_layers_keep`` parameterised layers, averaged uniformly unless ``weighting`` is set;
the first round sends nothing (every client of the one architecture starts from the same seeded weights).

Bytes (card §5): up 4·P_shared (+ 8 for n_k where the weighting uses it), down 4·P_shared per selected client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from ..engine.seeding import LG_FEDAVG
from ..models.flat import get_flat, set_flat
from ..protocol import Exchange, metric_items
from ..registry import ALGORITHMS
from .base import Algorithm, AlgorithmParams, ClientContext, Message, RoundInfo, ServerContext
from .hetero import SAMPLES_KEY, HtFLlibClientDefaults, global_head, load_own_model, mean_of_uploads, train_own_model
from .server_modules import PersistentModule

SHARED_KEY = "lg_shared"  # server state and broadcast: the global shared part as one flat vector


class LGFedAvgParams(AlgorithmParams):
    variant: Literal["htfllib", "paper"] = Field(
        "htfllib", description="htfllib: the head Linear(d, C) is shared, any extractors; paper: the top layers of one architecture"
    )
    num_layers_keep: int = Field(
        3, ge=1, description="variant=paper: how many parameterised layers, from the top, are shared (authors' MNIST script: 3)"
    )
    weighting: Literal["samples", "uniform"] | None = Field(
        None, description="the server's mean: samples (n_k/Σn, HtFLlib) or uniform (the authors'); unset: by the variant"
    )

    def resolved_weighting(self) -> str:
        return self.weighting or ("samples" if self.variant == "htfllib" else "uniform")


def shared_modules(model: nn.Module, params: LGFedAvgParams) -> list[nn.Module]:
    """The modules whose weights are shared: the head (default), or the last ``num_layers_keep`` leaf modules
    with parameters, in registration order (variant=paper)."""
    if params.variant == "htfllib":
        return [model.classifier]
    layers = [m for m in model.modules() if not list(m.children()) and any(True for _ in m.parameters(recurse=False))]
    if params.num_layers_keep > len(layers):
        raise ValueError(
            f"lg_fedavg: num_layers_keep={params.num_layers_keep} but the model has {len(layers)} parameterised layers"
        )
    return layers[-params.num_layers_keep :]


def get_shared(model: nn.Module, params: LGFedAvgParams) -> torch.Tensor:
    return torch.cat([get_flat(m) for m in shared_modules(model, params)])


def set_shared(model: nn.Module, params: LGFedAvgParams, vector: torch.Tensor) -> None:
    start = 0
    for module in shared_modules(model, params):
        size = get_flat(module).numel()
        set_flat(module, vector[start : start + size])
        start += size
    if start != vector.numel():
        raise ValueError(f"lg_fedavg: the shared part has {start} values here, the server sent {vector.numel()}")


@ALGORITHMS.register("lg_fedavg")
class LGFedAvg(HtFLlibClientDefaults, Algorithm):
    """LG-FedAvg: private extractors of any architecture, one shared head averaged by FedAvg (HtFLlib's form)."""

    name = "lg_fedavg"
    Params = LGFedAvgParams
    # A head Linear(d, C) is averaged across clients: every member needs one feature dimension (common_feature).
    exchange: ClassVar[Exchange] = Exchange("shared sub-model", "the head Linear(d, C)", common_feature=True)
    personal_model: ClassVar[str] = "assembled"  # its own extractor with the new global head

    def __init__(self, params: LGFedAvgParams, local: Any) -> None:
        super().__init__(params, local)
        if params.variant == "paper":  # layers of one architecture are averaged: refused for several, before any work
            self.exchange = Exchange("shared sub-model", f"its top {params.num_layers_keep} layers", one_architecture=True)
        self._head = PersistentModule(SHARED_KEY, LG_FEDAVG, global_head(self.name))

    # -- server ---------------------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        if self.params.variant == "htfllib":
            self._head.init_state(server)

    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        shared = server.state.get(SHARED_KEY)
        return Message({SHARED_KEY: shared}) if shared is not None else Message()  # (L1)

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        # (L4): n_k / Σ n_j over the arrived clients by default; (L5) uniform
        mean = mean_of_uploads(replies, SHARED_KEY, self.params.resolved_weighting(), self.name)
        if mean is not None:
            server.state[SHARED_KEY] = mean
        return {}

    # -- client ---------------------------------------------------------------------------------------------
    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        self.assemble_personal_model(client, msg)  # (L1): own model, the global shared part replacing its own
        result = train_own_model(client, info.lr, self.local)  # (L2): plain CE over every parameter
        upload: dict[str, Any] = {SHARED_KEY: get_shared(client.model, self.params)}  # (L3)
        if self.params.resolved_weighting() == "samples":
            upload[SAMPLES_KEY] = int(client.num_samples)
        return Message({**upload, **metric_items(result.mean_loss, client.num_samples)})

    # -- personalised evaluation: the own extractor with the new global shared part ---------------------------
    def assemble_personal_model(self, client: ClientContext, msg: Message) -> None:
        load_own_model(client)
        if SHARED_KEY in msg:
            set_shared(client.model, self.params, msg[SHARED_KEY])
