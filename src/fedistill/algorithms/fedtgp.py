"""FedTGP (Zhang et al., AAAI 2024; the authors' code, identical to HtFLlib's ``FedTGP``): trainable global
prototypes learned on the server with an adaptive-margin contrastive loss. Card: spec/fedtgp.md.

Every client model is an extractor ending in a feature of one dimension d shared by all clients and a linear head.
The server keeps a prototype generator G: Embedding(C, d) → Linear(d, h) → ReLU → Linear(h, d) in its state (a
:class:`PersistentModule`, checkpointed; initial weights from the run seed's FedTGP stream, A9); the global
prototypes are P̂ = G(0..C−1), one for every class. Client k, each round it is selected,

1. trains E epochs of SGD on ``CE + λ · (1/(|b|·d)) Σ_i ‖r_i − P̂^{y_i}‖²`` (T1, HtFLlib's MSE as FedProto's P1;
   ``client_distance: euclidean`` for the paper's distance φ), CE alone before the first P̂ (A5);
2. uploads its prototypes: the class means of an eval-mode pass over its training samples, with their ids and
   counts (T2), made by default from the model as it was at the start of the round (``proto_timing:
   round_start``, the authors' code, A3); ``after_training`` from the trained model (the paper's procedure).

The server (T3-T7) averages each uploaded class over its holders (Q, unweighted), sets the margin δ = min(max_c
min_{c'≠c} ‖Q^c − Q^{c'}‖, τ), then trains G for ``server_epochs`` passes over the stacked uploaded rows (a fresh
permutation per pass from ``make_generator(seed, FEDTGP, round)``, batches of ``server_batch_size``, last partial
kept, plain SGD at ``server_lr``) on the contrastive loss with P̂ recomputed at every step, and broadcasts G(c)
for all C classes. Inference is the nearest global prototype over all classes (``inference: head`` for the
client's own head; the head before the first P̂ exists), scored after each round's server update.

Bytes (card §5): up |C_k|·(4d + 16) per client, down C·(4d + 8) per selected client, 0 in the first round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from ..class_losses import (
    adaptive_margin,
    margin_contrastive_loss,
    mean_over_holders,
    prototype_distance_regulariser,
    prototype_regulariser,
)
from ..engine.seeding import FEDTGP, make_generator
from ..protocol import ClassRows, Exchange, metric_items
from ..registry import ALGORITHMS
from .base import Algorithm, AlgorithmParams, ClientContext, Message, RoundInfo, ServerContext
from .hetero import (
    PROTOTYPE_UPLOAD,
    HtFLlibClientDefaults,
    NearestPrototypeInference,
    eval_class_means,
    load_own_model,
    received_table,
    sgd_on_rows,
    stacked_uploads,
    train_own_model,
)
from .server_modules import PersistentModule

# Server-state keys: the generator's flat weights, and whether it has been trained (P̂ is sent from then on).
GENERATOR_KEY, TRAINED_KEY = "tgp_generator", "tgp_trained"


class PrototypeGenerator(nn.Module):
    """G(c; ω) = Linear(h, d)(ReLU(Linear(d, h)(Embedding(C, d)(c)))) (card §2): one trainable prototype per class."""

    def __init__(self, num_classes: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, dim)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.num_classes = num_classes

    def forward(self) -> torch.Tensor:
        """All C prototypes, (C, d)."""
        classes = torch.arange(self.num_classes, device=self.embedding.weight.device)
        return self.net(self.embedding(classes))


class FedTGPParams(AlgorithmParams):
    lam: float = Field(10.0, ge=0, description="λ, weight of the client's distance to the global prototypes (HtFLlib -lam 10, with its MSE)")
    margin_threshold: float = Field(100.0, ge=0, description="τ, the cap of the adaptive margin δ (HtFLlib -mart 100)")
    server_epochs: int = Field(100, ge=0, description="S, passes of the server over the round's uploaded rows (HtFLlib -se 100)")
    server_lr: float | None = Field(
        None, gt=0, description="η_s, the server's plain-SGD learning rate; unset: the round's client lr (the code, A7)"
    )
    server_batch_size: int | None = Field(None, ge=1, description="B_s, rows per server step; unset: the client batch size (the code)")
    hidden_dim: int | None = Field(None, ge=1, description="h, the generator's hidden width; unset: the feature dimension d (the code)")
    proto_timing: Literal["round_start", "after_training"] = Field(
        "round_start",
        description="uploaded prototypes: eval-mode class means of the model at the start of the round (the authors' "
        "and HtFLlib's code, card A3) or of the trained model (the paper's procedure)",
    )
    client_distance: Literal["mse", "euclidean"] = Field(
        "mse", description="the client term: per-element squared distance (the code, as FedProto) or the distance φ (the paper, A1)"
    )
    inference: Literal["prototype", "head"] = Field(
        "prototype", description="a client's prediction: the nearest global prototype (the code) or its own head"
    )


@ALGORITHMS.register("fedtgp")
class FedTGP(NearestPrototypeInference, HtFLlibClientDefaults, Algorithm):
    """FedTGP: the server learns one prototype per class with an adaptive-margin contrastive loss on the clients'."""

    name = "fedtgp"
    Params = FedTGPParams
    exchange: ClassVar[Exchange] = PROTOTYPE_UPLOAD
    personal_model: ClassVar[str] = "assembled"  # its trained model with the new global prototypes


    def __init__(self, params: FedTGPParams, local: Any) -> None:
        super().__init__(params, local)
        self._generator = PersistentModule(GENERATOR_KEY, FEDTGP, self._build_generator)

    def _build_generator(self, server: ServerContext) -> nn.Module:
        if server.feature_dim <= 0:
            raise ValueError("fedtgp: the server needs the clients' common feature dimension (ServerContext.feature_dim)")
        d = server.feature_dim
        return PrototypeGenerator(server.num_classes, d, self.params.hidden_dim or d)

    # -- server ---------------------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        self._generator.init_state(server)

    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        if not server.state.get(TRAINED_KEY, False):
            return Message()  # no P̂ before the first server update (0 bytes, A5)
        with torch.no_grad():
            prototypes = self._generator.load(server)().float().cpu()
        return Message(ClassRows(torch.arange(server.num_classes), prototypes).items())

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        p = self.params
        uploads = [rows for r in replies.values() if (rows := ClassRows.read(r)) is not None]  # client-id order
        if not uploads:
            return {"margin": float("nan")}
        # (T3)-(T5): the margin from the unweighted per-class means of this round's uploads
        means, present = mean_over_holders([(u.classes, u.rows, None) for u in uploads], server.num_classes)
        margin = adaptive_margin(means, present, p.margin_threshold)
        rows, labels = stacked_uploads(uploads)
        generator = self._generator.load(server)
        loss = sgd_on_rows(  # (T7): P̂ = G(all classes) recomputed at every step
            generator,
            lambda x, y: margin_contrastive_loss(x, y, generator(), margin),
            rows,
            labels,
            epochs=p.server_epochs,
            batch_size=p.server_batch_size or self.local.batch_size,
            lr=p.server_lr if p.server_lr is not None else info.lr,
            generator=make_generator(server.seed, FEDTGP, info.round),
        )
        self._generator.store(server, generator)
        server.state[TRAINED_KEY] = True
        return {"margin": margin, "server_loss": loss}

    # -- client ---------------------------------------------------------------------------------------------
    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        p = self.params
        num_classes = client.data.num_classes
        load_own_model(client)
        prototypes, present = received_table(msg, num_classes, client.device, use=p.lam != 0)
        # (T2), default: the prototypes of the model passed into the round (A3), before any step
        upload = eval_class_means(client) if p.proto_timing == "round_start" else None
        term = prototype_regulariser if p.client_distance == "mse" else prototype_distance_regulariser

        regulariser = None
        if prototypes is not None:

            def regulariser(model: Any, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, features: Any) -> torch.Tensor:
                return p.lam * term(features.float(), y, prototypes, present)  # (T1)

        result = train_own_model(
            client, info.lr, self.local, extra_loss=regulariser, with_features=regulariser is not None
        )
        if p.proto_timing == "after_training":
            upload = eval_class_means(client)
        return Message({**(upload.items() if upload is not None else {}), **metric_items(result.mean_loss, client.num_samples)})

    # -- personalised evaluation: the trained model with the new global prototypes ----------------------------

    def step_sizes(self) -> dict[str, float]:
        return {"algorithm.server_lr": self.params.server_lr} if self.params.server_lr is not None else {}
