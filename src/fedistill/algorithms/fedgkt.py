"""FedGKT (He et al., NeurIPS 2020): group knowledge transfer. Card: spec/fedgkt.md.

The federated-distillation protocol that FedDKC and FedICT build on; no weights travel. Every client keeps
its own model ``W^k = {W_e^k, W_c^k}`` (possibly its own architecture, ``model.clients``), split into an
extractor and a predictor (:mod:`fedistill.models.split`). Each round a client

1. trains its whole model on ``CE + β τ² KL(σ_τ(z_s) ‖ σ_τ(z_c))`` (card §3), where ``z_s`` is the server's
   knowledge about the same sample from the previous round (none in round 1: CE only, A5);
2. in eval mode extracts the features ``H^k`` of every training sample and its own logits ``Z^k`` on them
   (the augmented training view by default, A6; ``extract_view: clean`` for the un-augmented one);
3. uploads ``H^k``, ``Z^k`` and the labels ``Y^k`` (every round, as FedGKT's algorithm does, A8).

The server trains its predictor ``W_s`` (``model.server``) on the uploaded features, client after client
in client-id order, with ``CE + β τ² KL(σ_τ(z_c) ‖ σ_τ(o))`` (``server_loss_style: code``: ``β CE + τ² KL``),
for ``server_epochs`` epochs. Its knowledge ``Z_s^k`` for client k (A4) is, by default, its train-mode output on
each of k's samples in the last epoch's training pass (``zs_mode: train_pass``, the authors' code), or
``W_s(H^k)`` in eval mode right after finishing client k (``eval``, Alg. 2); it goes to client k at the start of
the next round.

Knowledge is keyed by sample, never by batch position (A3): a client uploads its samples in the fixed order
of its index set (``client.train_indices``), the server's answer keeps that order, and in training the
client looks the teacher row up by each sample's position in that order, however the batches are shuffled.

Persistent state: each client's model (flat, BatchNorm statistics included) and SGD momentum (A7) in
``client.state``; the server's predictor is ``server.model`` (the engine builds ``model.server`` on the
clients' feature shape) with its momentum, and the knowledge for every client in ``server.state``. Both
survive checkpoint/resume. Randomness: the client's batch order and augmentation come from its (seed,
round, client) stream; the server's batch order from ``(seed, FD_SERVER, round)``.

Hyperparameters follow the FedICT protocol column of the card (§5): β = 1.5, τ = 3, one server epoch, SGD
with Nesterov momentum 0.9 and weight decay 5e-4 on both sides (the run's ``local`` momentum and weight
decay on the client, the ``server_*`` parameters here on the server), constant server learning rate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..engine.seeding import FD_SERVER, make_generator
from ..losses import distillation_kl
from ..models.flat import get_flat, set_flat, split_like
from ..registry import ALGORITHMS
from .base import Algorithm, AlgorithmParams, ClientContext, Message, RoundInfo, ServerContext
from .local import autocast_context

FEATURES, LOGITS, LABELS, KNOWLEDGE = "features", "logits", "labels", "knowledge"


class FedGKTParams(AlgorithmParams):
    kd_weight: float = Field(1.5, ge=0, description="β on the KL term of client and server (FedICT protocol; FedGKT paper 1)")
    temperature: float = Field(3.0, gt=0, description="τ of every distillation softmax (×τ² on the KL terms)")
    server_epochs: int = Field(1, ge=1, le=1000, description="E_s: server passes over the uploaded features per round")
    server_lr: float = Field(0.01, gt=0, description="constant server learning rate (card A12)")
    server_momentum: float = Field(0.9, ge=0, lt=1)
    server_weight_decay: float = Field(5e-4, ge=0)
    server_batch_size: int | None = Field(None, ge=1, description="null = the clients' local.batch_size (card: B_s = B)")
    nesterov: bool = Field(True, description="Nesterov momentum on client and server (FedML/FedICT code)")
    extract_view: Literal["augmented", "clean"] = Field(
        "augmented", description="which view of each training sample the uploaded features come from (A6/A10)"
    )
    server_loss_style: Literal["paper", "code"] = Field(
        "paper",
        description="server loss CE + β·KD (paper: FedICT Eq. 4) or the released code's KD + β·CE (card A1; FedICT A6)",
    )
    # Default train_pass, the released code's: with the eval-mode pass (the card's first resolution) the server's
    # BatchNorm statistics mix the features of every client architecture, its knowledge was right on 12-42 % of a
    # client's own samples after 20 rounds, and FedICT collapsed on 2 of 3 seeds (RESULTS "FedICT's ranking claim").
    zs_mode: Literal["eval", "train_pass"] = Field(
        "train_pass",
        description="the server's knowledge Z_S: the released code's logits of the last epoch's training pass (train "
        "mode, before each step), or an eval-mode pass after training on client k (Alg. 2 l.16-17; card A11)",
    )
    init_knowledge: Literal["none", "uniform"] = Field(
        "none", description="round 1 without server knowledge: CE only (none, code) or a uniform teacher (the FedICT paper's zeros)"
    )


@ALGORITHMS.register("fedgkt")
class FedGKT(Algorithm):
    """FedGKT: clients upload features and logits of their samples, the server trains on them and returns per-sample knowledge."""

    name = "fedgkt"
    Params = FedGKTParams
    exchange: ClassVar[str] = "knowledge"
    @classmethod
    def config_defaults(cls, tree: dict[str, Any]) -> dict[str, Any]:
        """An extractor/predictor split is required (the default dataset's digits_cnn has none): the FedICT paper's
        A^C_3 client (unless model.clients or model.client_mix name them) and its ResNet-56 server predictor; and
        per-client test splits, since there is no global model to test."""
        model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
        defaults: dict[str, Any] = {"model": {"server": "fd_server_resnet56"}, "partition": {"per_client_test": True}}
        if not (model.get("clients") or model.get("client_mix")):
            defaults["model"]["name"] = "fd_resnet8"
        return defaults
    personal_model: ClassVar[str] = "local"
    # Labels travel with every upload (FedGKT's Algorithm 1); FedICT sends them once at setup.
    labels_every_round: ClassVar[bool] = True

    # -- hooks that FedDKC and FedICT change -------------------------------------------------------
    def client_distillation(self, client: ClientContext, logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """The client's knowledge term: ``β τ² KL(σ_τ(z_s) ‖ σ_τ(z_c))`` (card §3)."""
        p = self.params
        return p.kd_weight * distillation_kl(logits, teacher, p.temperature)

    def server_distillation(
        self, server: ServerContext, cid: int, outputs: torch.Tensor, client_logits: torch.Tensor
    ) -> torch.Tensor:
        """The server's knowledge term for a batch of client ``cid``: ``β τ² KL(σ_τ(z_c) ‖ σ_τ(o))``."""
        p = self.params
        return self.server_kd_weight * distillation_kl(outputs, client_logits, p.temperature)

    @property
    def server_kd_weight(self) -> float:
        """β on the server's plain KL term; 1 in ``server_loss_style: code``, where β weighs the CE instead."""
        return self.params.kd_weight if self.params.server_loss_style == "paper" else 1.0

    @property
    def server_ce_weight(self) -> float:
        """The server's CE weight: 1 (paper, Eq. 4), β (the FedML/FedICT code's ``loss_kd + alpha * loss_true``)."""
        return 1.0 if self.params.server_loss_style == "paper" else self.params.kd_weight

    def setup_payload(self, client: ClientContext, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a client sends once, with its first upload (FedICT: d^k, N^k, Y^k). FedGKT: nothing."""
        return {}

    def receive_setup(self, server: ServerContext, cid: int, reply: Message) -> None:
        """Keep what a client sent once (FedICT's distribution vectors). FedGKT: nothing."""

    # -- client ---------------------------------------------------------------------------------------
    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        knowledge = server.state.get("knowledge", {}).get(cid)
        # Nothing exists before a client's first upload; zeros are not sent (fedict.md A8).
        return Message() if knowledge is None else Message({KNOWLEDGE: knowledge})

    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        p = self.params
        model, state = client.model, client.state
        set_flat(model, state["model"] if "model" in state else client.initial_weights)
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=info.lr,
            momentum=self.local.momentum,
            nesterov=p.nesterov and self.local.momentum > 0,
            weight_decay=self.local.weight_decay,
        )
        if "momentum" in state:
            restore_momentum(optimizer, state["momentum"])
        n = client.num_samples
        teacher_all = msg.get(KNOWLEDGE)
        if teacher_all is not None and tuple(teacher_all.shape) != (n, client.data.num_classes):
            raise ValueError(f"client {client.cid}: knowledge of shape {tuple(teacher_all.shape)} for {n} samples")
        if teacher_all is None and p.init_knowledge == "uniform":
            teacher_all = torch.zeros(n, client.data.num_classes)  # all-zero logits: a uniform teacher
        if teacher_all is not None:
            teacher_all = teacher_all.to(client.device)  # once, not a host-to-device copy per step
        model.train()
        # On the device: a CPU accumulator cannot add a GPU loss, and reading it back per step would stall.
        loss_sum, seen = torch.zeros((), dtype=torch.float64, device=client.device), 0
        for _ in range(self.local.epochs):
            # Positions into the client's index set: the key of every sample's knowledge (card A3).
            order = torch.randperm(n, generator=client.generator)
            for start in range(0, n, self.local.batch_size):
                positions = order[start : start + self.local.batch_size]
                x, y = client.data.train_batch(client.train_indices[positions], client.generator)
                with autocast_context(client.precision, client.device):
                    logits = model(x).float()
                    loss = F.cross_entropy(logits, y)
                    if teacher_all is not None:
                        teacher = teacher_all[positions].to(logits.device)
                        loss = loss + self.client_distillation(client, logits, teacher)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_sum += loss.detach().double() * y.shape[0]
                seen += int(y.shape[0])
        features, logits, labels = self._extract(client)
        state["model"] = get_flat(model)
        state["momentum"] = momentum_vector(optimizer)
        payload: dict[str, Any] = {FEATURES: features, LOGITS: logits}
        if self.labels_every_round:
            payload[LABELS] = labels
        if not state.get("setup_sent", False):
            payload.update(self.setup_payload(client, labels))
            state["setup_sent"] = True
        return Message(payload, train_loss=float(loss_sum / max(seen, 1)), num_samples=n)

    @torch.no_grad()
    def _extract(self, client: ClientContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Features ``H^k`` and logits ``Z^k`` of every training sample, in index-set order (eval mode, A6)."""
        model = client.model
        model.eval()
        features, logits, labels = [], [], []
        for start in range(0, client.num_samples, 256):
            ix = client.train_indices[start : start + 256]
            if self.params.extract_view == "augmented":
                x, y = client.data.train_batch(ix, client.generator)
            else:
                x, y = client.data.clean_batch(ix)
            with autocast_context(client.precision, client.device):
                h = model.split_features(x)
                z = model.split_predict(h)
            # float32 on the wire (4 bytes per element, fedict.md §2), contiguous in NCHW order
            features.append(h.float().contiguous().cpu())
            logits.append(z.float().cpu())
            labels.append(y.to(torch.int32).cpu())
        return torch.cat(features), torch.cat(logits), torch.cat(labels)

    # -- server ---------------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        server.state.setdefault("knowledge", {})  # cid -> (N^k, C) float32, the server's last answer
        server.state.setdefault("labels", {})  # cid -> (N^k,) int64 (kept from the uploads)

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        p = self.params
        model = server.model
        for cid, reply in replies.items():
            if LABELS in reply:
                server.state["labels"][cid] = reply[LABELS].long()
            self.receive_setup(server, cid, reply)
            if cid not in server.state["labels"]:
                raise ValueError(f"client {cid}: features arrived before its labels (no setup upload seen)")
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=p.server_lr,
            momentum=p.server_momentum,
            nesterov=p.nesterov and p.server_momentum > 0,
            weight_decay=p.server_weight_decay,
        )
        if "server_momentum" in server.state:
            restore_momentum(optimizer, server.state["server_momentum"])
        generator = make_generator(server.seed, FD_SERVER, info.round)
        batch_size = p.server_batch_size or self.local.batch_size
        loss_sum, seen = torch.zeros((), dtype=torch.float64, device=server.device), 0
        cids = sorted(replies)
        for epoch in range(1, p.server_epochs + 1):
            for cid in cids:
                features = replies[cid][FEATURES]
                client_logits = replies[cid][LOGITS].float()
                labels = server.state["labels"][cid]
                if features.shape[0] != labels.shape[0] or client_logits.shape[0] != labels.shape[0]:
                    raise ValueError(
                        f"client {cid}: {features.shape[0]} feature rows and {client_logits.shape[0]} logit rows "
                        f"for {labels.shape[0]} labels"
                    )
                model.train()
                order = torch.randperm(labels.shape[0], generator=generator)
                # zs_mode train_pass (the code): the last epoch's training outputs are the knowledge, row by row.
                passed = None
                if epoch == p.server_epochs and p.zs_mode == "train_pass":
                    passed = torch.empty(labels.shape[0], client_logits.shape[1], device=server.device)
                    device_order = order.to(server.device)  # one copy, not one per batch
                for start in range(0, labels.shape[0], batch_size):
                    rows = order[start : start + batch_size]
                    h = self._server_input(server, features[rows])
                    with autocast_context(server.precision, server.device):
                        outputs = model(h).float()
                        loss = self.server_ce_weight * F.cross_entropy(outputs, labels[rows].to(server.device))
                        loss = loss + self.server_distillation(server, cid, outputs, client_logits[rows].to(server.device))
                    if passed is not None:
                        passed[device_order[start : start + batch_size]] = outputs.detach()
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    loss_sum += loss.detach().double() * rows.numel()
                    seen += int(rows.numel())
                if epoch == p.server_epochs:
                    # Z_S of client k: its rows of the training pass above (train_pass), or Alg. 2 l.16-17's
                    # eval-mode pass right after finishing client k in the last epoch (eval).
                    knowledge = passed.cpu() if passed is not None else self._server_logits(server, features)
                    server.state["knowledge"][cid] = knowledge
        server.state["server_momentum"] = momentum_vector(optimizer)
        return {"server_loss": float(loss_sum / max(seen, 1))}

    def _server_input(self, server: ServerContext, features: torch.Tensor) -> torch.Tensor:
        h = features.to(server.device, non_blocking=True)
        return h.contiguous(memory_format=torch.channels_last) if h.dim() == 4 else h

    @torch.no_grad()
    def _server_logits(self, server: ServerContext, features: torch.Tensor) -> torch.Tensor:
        model = server.model
        model.eval()
        out = []
        for start in range(0, features.shape[0], 256):
            with autocast_context(server.precision, server.device):
                out.append(model(self._server_input(server, features[start : start + 256])).float().cpu())
        return torch.cat(out)


def momentum_vector(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The SGD momentum buffers of every parameter as one flat vector (zeros where none exists yet)."""
    parts = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            buf = optimizer.state.get(param, {}).get("momentum_buffer")
            parts.append((buf if buf is not None else torch.zeros_like(param)).detach().reshape(-1).float().cpu())
    return torch.cat(parts) if parts else torch.zeros(0)


def restore_momentum(optimizer: torch.optim.Optimizer, vector: torch.Tensor) -> None:
    """Put the buffers of :func:`momentum_vector` back, so the optimizer continues as if never rebuilt (A7)."""
    params: list[nn.Parameter] = [q for group in optimizer.param_groups for q in group["params"]]
    expected = sum(q.numel() for q in params)
    if vector.numel() != expected:
        raise ValueError(f"momentum state of {vector.numel()} values for {expected} parameters")
    for param, buf in zip(params, split_like(vector, params)):
        optimizer.state[param]["momentum_buffer"] = buf.to(param.device, param.dtype).view_as(param).clone()
