"""FedProto (Tan et al., AAAI 2022; HtFLlib's ``FedProto``): clients exchange class prototypes and pull their
features towards the global ones. Card: spec/fedproto.md.

Every client model is an extractor ending in a feature of one dimension d shared by all clients (``extract``,
``feature_dim``; the engine refuses an assignment whose members differ, in one line) and a linear head. Client k
keeps its model in its state and, each round it is selected,

1. trains E epochs of SGD on ``CE + λ · (1/(|b|·d)) Σ_{i: y_i ∈ G} ‖r_i − P̄^{y_i}‖²`` (P1, HtFLlib's MSE), with the
   global prototypes G of the previous round (none in the first: CE only), a row whose label has no prototype
   adding 0 but counting in |b| (card ambiguity 4);
2. uploads its prototypes: the per-class mean of its detached train-mode features over every forward pass of the
   round (P2, all E epochs, before each step), with their ids and counts; ``proto_timing: after_training`` makes
   them from an eval-mode pass of the trained model instead (ambiguity 3).

The server averages each class over the clients that uploaded it, unweighted (P3: HtFLlib and the official code;
``proto_weighting: count`` is the paper's count-weighted mean, P4), from this round's uploads only, and sends them
back. Inference is the nearest global prototype (P5, ``inference: prototype``; ``head`` for the model's own head):
after each round's aggregation every client of the round is scored with its trained model and the new prototypes,
as HtFLlib evaluates at the start of the next round (personal_model "assembled": the evaluation message is the
next round's broadcast and is not counted as communication).

Bytes (card §5): up |C_k|·(4d + 16) per client, down |G|·(4d + 8), 0 in the first round; the training loss goes up
as an uncounted metric report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from ..class_losses import mean_over_holders, prototype_regulariser
from ..protocol import ClassRows, Exchange, metric_items
from ..registry import ALGORITHMS
from .base import Algorithm, AlgorithmParams, ClientContext, Message, RoundInfo, ServerContext
from .hetero import (
    PROTOTYPE_UPLOAD,
    HtFLlibClientDefaults,
    ClassAccumulator,
    NearestPrototypeInference,
    eval_class_means,
    load_own_model,
    received_table,
    train_own_model,
)

# Server-state keys: the global prototypes of the last round (held classes' ids and rows).
PROTO_CLASSES, PROTO_ROWS = "prototype_classes", "prototype_rows"


class FedProtoParams(AlgorithmParams):
    lam: float = Field(10.0, ge=0, description="λ, weight of the prototype regulariser (HtFLlib -lam 10, with its per-element MSE)")
    proto_weighting: Literal["uniform", "count"] = Field(
        "uniform",
        description="global prototype: the plain mean over the clients holding the class (HtFLlib, official code) or "
        "the count-weighted mean (the paper's P4)",
    )
    inference: Literal["prototype", "head"] = Field(
        "prototype", description="a client's prediction: the nearest global prototype (HtFLlib, paper) or its own head"
    )
    proto_timing: Literal["training", "after_training"] = Field(
        "training",
        description="uploaded prototypes: means of the round's train-mode features (HtFLlib, official code) or of an "
        "eval-mode pass of the trained model (card ambiguity 3)",
    )


@ALGORITHMS.register("fedproto")
class FedProto(NearestPrototypeInference, HtFLlibClientDefaults, Algorithm):
    """FedProto: clients upload class prototypes, the server averages them, clients pull their features towards them."""

    name = "fedproto"
    Params = FedProtoParams
    exchange: ClassVar[Exchange] = PROTOTYPE_UPLOAD
    personal_model: ClassVar[str] = "assembled"  # its trained model with the new global prototypes (P5)


    # -- server ---------------------------------------------------------------------------------------------
    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        if PROTO_CLASSES not in server.state:
            return Message()  # round 1: no global prototype yet (0 bytes)
        return Message(ClassRows(server.state[PROTO_CLASSES], server.state[PROTO_ROWS]).items())

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        uploads = [rows for r in replies.values() if (rows := ClassRows.read(r)) is not None]  # client-id order
        # Rebuilt from this round's uploads only (card ambiguity 6).
        server.state.pop(PROTO_CLASSES, None)
        server.state.pop(PROTO_ROWS, None)
        if not uploads:
            return {"prototype_classes": 0.0}
        listed = [(u.classes, u.rows, u.counts) for u in uploads]
        glob = ClassRows.from_dense(*mean_over_holders(listed, server.num_classes, self.params.proto_weighting))
        server.state[PROTO_CLASSES], server.state[PROTO_ROWS] = glob.classes, glob.rows
        return {"prototype_classes": float(len(glob))}

    # -- client ---------------------------------------------------------------------------------------------
    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        p = self.params
        num_classes = client.data.num_classes
        load_own_model(client)
        # λ = 0 or no prototypes yet: CE alone, the same steps as local_only (card invariant 6).
        prototypes, present = received_table(msg, num_classes, client.device, use=p.lam != 0)
        recorded = ClassAccumulator(num_classes) if p.proto_timing == "training" else None

        def regulariser(model: Any, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, features: Any) -> torch.Tensor:
            r = features.float()
            if recorded is not None:
                recorded.add(r, y)  # P2: this step's train-mode features, before the step
            if prototypes is None:
                return r.new_zeros(())
            return p.lam * prototype_regulariser(r, y, prototypes, present)

        result = train_own_model(client, info.lr, self.local, extra_loss=regulariser, with_features=True)
        upload = recorded.upload() if recorded is not None else eval_class_means(client)
        return Message({**(upload.items() if upload is not None else {}), **metric_items(result.mean_loss, client.num_samples)})

    # -- personalised evaluation: the trained model with the new global prototypes ----------------------------
