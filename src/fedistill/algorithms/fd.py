"""FD (FedDistill; Jeong et al., NeurIPS-W 2018; HtFLlib's ``FD``): clients exchange per-class mean logits and
distil towards their average. Card: spec/fd.md.

No weights travel, so every client may hold its own architecture (``model.clients``, ``model.group``) as long as
all share the C outputs. Client k keeps its model in its state and, each round it is selected,

1. trains E epochs of SGD on ``CE + λ · (1/|b|) Σ_{i: y_i ∈ T} −Σ_j t^{y_i}_j log softmax(z_i)_j`` (FD1), the teacher
   table T from the previous round (none in the first: CE only, card ambiguity 6), rows without a teacher adding 0
   but counting in |b| (ambiguity 5);
2. records, per class, the mean of its detached train-mode logits over every forward pass of the round (FD2: all
   E epochs, before each step), and uploads the held classes' rows with their ids and counts.

The server averages each class over the clients that uploaded it, unweighted, the client's own row included (FD3,
HtFLlib's ``proto_aggregation``), from this round's uploads only, and sends the table back. Switches keep the
other readings: ``teacher: logits`` (HtFLlib's current raw target, unbounded below: it diverges on digits, so the
default is its earlier softmax form, ambiguity 1), ``teacher: probs`` (the paper's softmax vectors), ``exclude_self`` (the paper's
(sum − own)/(M − 1), FD4), ``teacher_weighting: count``. Accuracy is personal: each client's own model (its head)
on its own test split right after its update.

Bytes (card §5): up |C_k|·(4C + 16) per client (float32 rows, int64 ids and counts), down |G|·(4C + 8) (rows and
ids), 0 in the first round; the training loss goes up as an uncounted metric report. Randomness is the run's
per-(seed, round, client) stream only (batch order); the server draws nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from ..class_losses import class_table_distillation, mean_over_holders
from ..protocol import ClassRows, Exchange, metric_items
from ..registry import ALGORITHMS
from .base import Algorithm, AlgorithmParams, ClientContext, Message, RoundInfo, ServerContext
from .hetero import ClassAccumulator, HtFLlibClientDefaults, load_own_model, received_table, train_own_model

# Server-state keys: the round's teacher table (held classes' ids and rows), and with exclude_self every upload.
TEACHER_CLASSES, TEACHER_ROWS, UPLOADS = "teacher_classes", "teacher_rows", "uploads"


class FDParams(AlgorithmParams):
    lam: float = Field(1.0, ge=0, description="λ, weight of the distillation term (HtFLlib -lam 1; the paper's γ)")
    teacher: Literal["logits", "softmax", "probs"] = Field(
        "softmax",
        description="the soft target of a class: the softmax of its mean logits (default; HtFLlib before 2025-11-29), "
        "the raw mean logits (HtFLlib since; unbounded below, diverges on digits), or the mean of the clients' "
        "softmax probabilities (the paper's; card ambiguity 1)",
    )
    exclude_self: bool = Field(
        False, description="client k's teacher is the mean of the other holders only (the paper's (sum − own)/(M − 1), FD4)"
    )
    teacher_weighting: Literal["uniform", "count"] = Field(
        "uniform", description="average over holders: each client once (HtFLlib) or weighted by its counts n_k^c"
    )


@ALGORITHMS.register("fd")
class FD(HtFLlibClientDefaults, Algorithm):
    """FD: clients upload per-class mean logits, the server averages them, clients distil towards the average (HtFLlib's FD)."""

    name = "fd"
    Params = FDParams
    exchange: ClassVar[Exchange] = Exchange("class statistics", "per-class mean logits of the classes each holds")
    personal_model: ClassVar[str] = "local"  # the client's own model (its head) after its update


    # -- server ---------------------------------------------------------------------------------------------
    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        if self.params.exclude_self:
            teacher = self._teacher_without(server, cid)
        elif TEACHER_CLASSES in server.state:
            teacher = ClassRows(server.state[TEACHER_CLASSES], server.state[TEACHER_ROWS])
        else:
            teacher = None  # round 1: nothing exists yet, nothing is sent (0 bytes)
        return Message(teacher.items()) if teacher is not None and len(teacher) else Message()

    def _teacher_without(self, server: ServerContext, cid: int) -> ClassRows | None:
        """FD4: the mean over the holders other than ``cid`` (no row for a class only ``cid`` holds)."""
        others = [(u["classes"], u["rows"], u["counts"]) for k, u in server.state.get(UPLOADS, {}).items() if k != cid]
        if not others:
            return None
        return ClassRows.from_dense(*mean_over_holders(others, server.num_classes, self.params.teacher_weighting))

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        uploads = {cid: rows for cid, r in replies.items() if (rows := ClassRows.read(r)) is not None}
        for cid, rows in uploads.items():
            if rows.counts is None:
                raise ValueError(f"client {cid}: its per-class logits came without their counts")
        # The table is rebuilt from this round's uploads only (card ambiguity 7).
        for key in (TEACHER_CLASSES, TEACHER_ROWS, UPLOADS):
            server.state.pop(key, None)
        if not uploads:
            return {"teacher_classes": 0.0}
        listed = [(u.classes, u.rows, u.counts) for u in uploads.values()]  # client-id order (the engine sorts)
        teacher = ClassRows.from_dense(*mean_over_holders(listed, server.num_classes, self.params.teacher_weighting))
        server.state[TEACHER_CLASSES], server.state[TEACHER_ROWS] = teacher.classes, teacher.rows
        if self.params.exclude_self:
            server.state[UPLOADS] = {cid: {"classes": u.classes, "rows": u.rows, "counts": u.counts} for cid, u in uploads.items()}
        return {"teacher_classes": float(len(teacher))}

    # -- client ---------------------------------------------------------------------------------------------
    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        p = self.params
        num_classes = client.data.num_classes
        load_own_model(client)
        # λ = 0 or no teacher yet: CE alone, the same steps as local_only (card invariant 6).
        table, present = received_table(msg, num_classes, client.device, use=p.lam != 0)
        if table is not None and present is not None:
            if p.teacher == "softmax":  # the target is a distribution again; rows without a teacher stay zero
                table = torch.where(present[:, None], table.softmax(1), table)
        recorded = ClassAccumulator(num_classes)
        probs = p.teacher == "probs"

        def distillation(model: Any, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, features: Any) -> torch.Tensor:
            z = logits.float()
            recorded.add(z.softmax(1) if probs else z, y)  # FD2: this step's train-mode outputs, before the step
            if table is None:
                return z.new_zeros(())
            return p.lam * class_table_distillation(z, y, table, present)

        result = train_own_model(client, info.lr, self.local, extra_loss=distillation)
        upload = recorded.upload()
        return Message({**(upload.items() if upload is not None else {}), **metric_items(result.mean_loss, client.num_samples)})
