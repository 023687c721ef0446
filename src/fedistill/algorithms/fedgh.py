"""FedGH (Yi et al., ACM MM 2023; HtFLlib's ``FedGH``): the server trains one generalised global header on the
clients' uploaded class prototypes and every client's head is replaced by it. Card: spec/fedgh.md.

Every client model is an extractor ending in a feature of one dimension d shared by all clients (``extract``,
``feature_dim``; the engine refuses an assignment whose members differ, in one line) and a linear head Linear(d,
C). The server keeps the header H = Linear(d, C) in its state (a :class:`PersistentModule`, checkpointed; its
initial weights from the run seed's FedGH stream, card ambiguity 2). Client k, each round it is selected,

1. replaces its head by the broadcast header (GH1, also in the first round);
2. trains E epochs of plain SGD on CE over its whole model, extractor and head (GH2);
3. uploads its prototypes: the class means of an eval-mode pass of the trained model over its training samples,
   with their ids and counts (GH3).

The server stacks the uploaded rows in client-id order and trains H on them with CE (GH4): ``server_epochs``
passes, each a fresh permutation from ``make_generator(seed, FEDGH, round)``, batches of ``server_batch_size``
rows (the last partial one kept), one plain-SGD step at ``server_lr`` per batch, every row counting once whatever
its count (ambiguity 6). Inference: the client's trained extractor with the new header (personal_model
"assembled": the evaluation message is the next round's broadcast, not counted as communication).

Bytes (card §5): up |C_k|·(4d + 16) per client, down 4·(d·C + C) per selected client every round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field

from ..class_losses import header_loss
from ..engine.seeding import FEDGH, make_generator
from ..models.flat import set_flat
from ..protocol import ClassRows, Exchange, metric_items
from ..registry import ALGORITHMS
from .base import Algorithm, AlgorithmParams, ClientContext, Message, RoundInfo, ServerContext
from .hetero import (
    PROTOTYPE_UPLOAD,
    HtFLlibClientDefaults,
    eval_class_means,
    global_head,
    load_own_model,
    sgd_on_rows,
    stacked_uploads,
    train_own_model,
)
from .server_modules import PersistentModule

# Server-state key of the global header's flat vector (weight then bias); the broadcast key of the same vector.
HEADER_KEY = "header"


class FedGHParams(AlgorithmParams):
    server_lr: float = Field(0.01, gt=0, description="η_s, the server's plain-SGD learning rate on the header (HtFLlib -slr 0.01)")
    server_epochs: int = Field(1, ge=0, description="E_s, passes over the round's uploaded rows (HtFLlib total.sh -se 1)")
    server_batch_size: int | None = Field(
        None, ge=1, description="B_s, rows per server step; unset: the client batch size (HtFLlib, 10)"
    )


@ALGORITHMS.register("fedgh")
class FedGH(HtFLlibClientDefaults, Algorithm):
    """FedGH: the server trains a global header on the clients' class prototypes; it replaces every client's head."""

    name = "fedgh"
    Params = FedGHParams
    exchange: ClassVar[Exchange] = PROTOTYPE_UPLOAD
    personal_model: ClassVar[str] = "assembled"  # its trained extractor with the new global header


    def __init__(self, params: FedGHParams, local: Any) -> None:
        super().__init__(params, local)
        self._header = PersistentModule(HEADER_KEY, FEDGH, global_head(self.name))

    # -- server ---------------------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        self._header.init_state(server)

    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        return Message({HEADER_KEY: self._header.init_state(server)})  # (GH1), also in the first round

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        uploads = [rows for r in replies.values() if (rows := ClassRows.read(r)) is not None]  # client-id order
        if not uploads or self.params.server_epochs == 0:
            return {"header_rows": float(sum(len(u) for u in uploads))}
        rows, labels = stacked_uploads(uploads)
        header = self._header.load(server)
        loss = sgd_on_rows(
            header,
            lambda p, c: header_loss(header, p, c),
            rows,
            labels,
            epochs=self.params.server_epochs,
            batch_size=self.params.server_batch_size or self.local.batch_size,
            lr=self.params.server_lr,
            generator=make_generator(server.seed, FEDGH, info.round),
        )
        self._header.store(server, header)
        return {"header_rows": float(rows.shape[0]), "header_loss": loss}

    # -- client ---------------------------------------------------------------------------------------------
    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        load_own_model(client)
        set_flat(client.model.classifier, msg[HEADER_KEY])  # (GH1): the global header replaces the client's head
        # (GH2): plain CE over every parameter, the head included
        result = train_own_model(client, info.lr, self.local)
        upload = eval_class_means(client)  # (GH3): eval-mode class means of the trained model
        return Message({**(upload.items() if upload is not None else {}), **metric_items(result.mean_loss, client.num_samples)})

    # -- personalised evaluation: the trained extractor with the new global header -----------------------------
    def assemble_personal_model(self, client: ClientContext, msg: Message) -> None:
        load_own_model(client)
        set_flat(client.model.classifier, msg[HEADER_KEY])

    def step_sizes(self) -> dict[str, float]:
        return {"algorithm.server_lr": self.params.server_lr}

