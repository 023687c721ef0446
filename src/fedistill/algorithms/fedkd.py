"""FedKD (Wu et al., Nature Communications 2022; HtFLlib's ``FedKD``): a private mentor and a shared mentee learn
from each other, and the mentee travels as truncated SVD factors. Card: spec/fedkd.md.

Each client keeps its mentor (its own model, any architecture, the one evaluated: personal model "local") and a
private map W_h (Linear(d̃, d), no bias) in its state; the mentee g is the engine's shared model (``model.shared``,
by default the assignment's first member). Per batch (K1-K4), both in train mode, the sum

    L = CE_p + CE_g + [KL̄(q ‖ p) + KL̄(p ‖ q) + 2·MSĒ(r, W_h r̃)] / (CE_p + CE_g)

(:func:`~fedistill.losses.adaptive_mutual_losses`; nothing detached, as HtFLlib and the authors) is back-propagated
into the mentor, the mentee and W_h, each gradient clipped to norm 10 on its own, plain-SGD steps at η, η_m, η.

What travels (K5-K8): every mentee parameter with more than one dimension and more than one row as its SVD
factors at energy E_t (:func:`compress`, K6: the smallest rank whose squared singular values exceed E_t of the
total, over ranks 1..k−1; a 4-D kernel per kh×kw slice with one rank for the tensor), the rest raw; buffers stay
on the client. The server averages the reconstructions plainly (K7) and sends the mean compressed at the same E_t
(K8); round 1 sends the initial mentee raw. E_t = T_s + (t/R)(T_e − T_s) for the 0-based round t (K9), R =
``schedule_rounds`` (by default the run's rounds).

Options (card §3): ``variant="paper"`` (the round's update compressed instead of the parameters, E_t with t + 1,
no W_h, no clipping), ``compress`` ∈ {parameters, updates, none}, ``rank_rule="fixed"`` (ranks up to k, a tensor sent
raw where its factors would not be smaller: HtFLlib's rule can send a tensor at rank 0, as zeros, card ambiguity 5;
each round reports how many tensors went at rank 0), ``detach_peers``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from ..engine.seeding import FEDKD
from ..losses import adaptive_mutual_losses
from ..models.flat import get_flat, set_flat
from ..protocol import Exchange, metric_items
from ..registry import ALGORITHMS
from .base import Algorithm, AlgorithmParams, ClientContext, Message, RoundInfo, ServerContext
from .hetero import (
    HTFLLIB_DEFAULTS,
    init_shared_state,
    keep_own_model,
    load_own_model,
    run_long_linear_init,
    train_parts_jointly,
)
from .local import autocast_context

PREFIX = "mentee."  # message keys: mentee.<parameter> (raw) or mentee.<parameter>.U / .S / .V (factors)
MENTEE_KEY = "mentee"  # client state: its mentee's flat vector at the round's start; server state: the global
SENT_KEY = "mentee_sent"  # server state: the last round's compressed mean (or mean update), the next broadcast
LAST_CLIENTS_KEY = "mentee_last_clients"  # server state: the clients of the last round (updates: who may add to it)
W_H_KEY = "w_h"  # client state: W_h's flat weight
RANK0 = "metric.rank0_tensors"  # uncounted report: tensors the client sent at rank 0 (zeros)


class FedKDParams(AlgorithmParams):
    mentee_lr: float = Field(0.01, gt=0, description="η_m, the mentee's SGD rate (HtFLlib -mlr 0.01)")
    t_start: float = Field(0.95, gt=0, le=1, description="T_s, the SVD energy of the first round (HtFLlib -Ts 0.95)")
    t_end: float = Field(0.98, gt=0, le=1, description="T_e, the energy the schedule reaches (HtFLlib -Te 0.98)")
    schedule_rounds: int = Field(30, ge=1, description="R of the schedule E_t = T_s + (t/R)(T_e − T_s); filled with the run's rounds")
    variant: Literal["htfllib", "paper"] = Field("htfllib", description="paper: the authors' code (updates compressed, no W_h, no clip)")
    compress: Literal["parameters", "updates", "none"] | None = Field(None, description="what travels as SVD factors; unset: by the variant")
    rank_rule: Literal["htfllib", "fixed"] = Field("htfllib", description="htfllib: ranks 1..k−1, else 0 (zeros); fixed: 1..k, raw where not smaller")
    hidden_map: Literal["learned", "identity"] | None = Field(None, description="W_h learned (HtFLlib) or none; unset: by the variant")
    clip_norm: float | None = Field(10.0, gt=0, description="each part's gradient clipped to this norm (HtFLlib); null: none")
    detach_peers: bool = Field(False, description="peer distribution, features and the denominator as constants")
    eval_model: Literal["mentor", "mentee"] = Field(
        "mentor", description="scored on each client's test split: its mentor (HtFLlib) or the mentee as the server sends it"
    )

    def resolved(self) -> tuple[str, str, float | None, int]:
        """(compress, hidden_map, clip_norm, schedule offset) after the variant: an explicit setting wins."""
        paper = self.variant == "paper"
        compress = self.compress or ("updates" if paper else "parameters")
        hidden = self.hidden_map or ("identity" if paper else "learned")
        clip = None if paper and "clip_norm" not in self.model_fields_set else self.clip_norm
        return compress, hidden, clip, 1 if paper else 0

    def energy(self, rnd: int) -> float:
        """E_t for the engine's 1-based round (K9; the paper's form one step ahead)."""
        t = rnd - 1 + self.resolved()[3]
        return self.t_start + (t / self.schedule_rounds) * (self.t_end - self.t_start)


# -- SVD compression (K6) -------------------------------------------------------------------------------------------
def svd_rank(squared: torch.Tensor, energy: float, rule: str) -> int:
    """The rank kept from the pooled squared singular values ``squared`` (descending, length k): htfllib, the
    smallest n in 1..k−1 with Σ_{j≤n} σ_j² > E·Σσ², else 0; fixed, the smallest n in 1..k with ≥."""
    target, cumulative = energy * float(squared.sum()), torch.cumsum(squared, 0)  # cumulative[n - 1]: ranks n
    if rule == "htfllib":
        hits = torch.nonzero(cumulative[:-1] > target).flatten()  # ranks 1..k−1 only
        return int(hits[0]) + 1 if hits.numel() else 0
    hits = torch.nonzero(cumulative >= target).flatten()
    return int(hits[0]) + 1 if hits.numel() else squared.numel()


def compress(name: str, tensor: torch.Tensor, energy: float, rule: str) -> tuple[dict[str, torch.Tensor], int | None]:
    """One parameter as message items (K6) and its rank (None where sent raw): its factors ``U`` (…, m, r), ``S``
    (…, r), ``V`` (…, r, n) where it has more than one dimension and more than one row, raw otherwise."""
    w = tensor.detach().float().cpu().clone()  # never the live parameter: the worker trains the next client in place
    if w.ndim < 2 or w.shape[0] <= 1:
        return {PREFIX + name: w}, None
    if w.ndim not in (2, 4):
        raise ValueError(f"fedkd: the mentee's {name} has {w.ndim} dimensions; only matrices and 4-D kernels are compressed")
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)  # a 4-D kernel: batched over its kh×kw slices
    squared = (s**2).reshape(-1, s.shape[-1]).sum(0)  # pooled over the slices
    if float(squared.sum()) == 0.0:
        return {PREFIX + name: w}, None
    r = svd_rank(squared, energy, rule)
    if rule == "fixed" and r * (w.shape[-2] + w.shape[-1] + 1) >= w.shape[-2] * w.shape[-1]:
        return {PREFIX + name: w}, None  # the factors would not be smaller than the tensor
    factors = {"U": u[..., :, :r], "S": s[..., :r], "V": vh[..., :r, :]}
    return {f"{PREFIX}{name}.{key}": value.float().contiguous() for key, value in factors.items()}, r


def reconstruct(msg: Mapping[str, Any], name: str) -> torch.Tensor:
    """A parameter back from its items: U diag(S) V (per slice), or the raw tensor."""
    if PREFIX + name in msg:
        return msg[PREFIX + name]
    u, s, v = (msg[f"{PREFIX}{name}.{key}"].double() for key in ("U", "S", "V"))
    return ((u * s[..., None, :]) @ v).float()


def compressed_items(named: Mapping[str, torch.Tensor], energy: float, rule: str) -> tuple[dict[str, torch.Tensor], int]:
    """Every parameter's items, and how many went at rank 0."""
    items: dict[str, torch.Tensor] = {}
    zeros = 0
    for name, tensor in named.items():
        part, r = compress(name, tensor, energy, rule)
        items.update(part)
        zeros += int(r == 0)
    return items, zeros


@ALGORITHMS.register("fedkd")
class FedKD(Algorithm):
    """FedKD: a private mentor and a shared mentee distil into each other; the mentee travels SVD-compressed."""

    name = "fedkd"
    Params = FedKDParams
    exchange: ClassVar[Exchange] = Exchange("shared sub-model", "the mentee's SVD factors", shared_model=True)
    personal_model: ClassVar[str] = "local"  # the mentor after its update, on its own test split

    @classmethod
    def config_defaults(cls, tree: dict[str, Any]) -> dict[str, Any]:
        defaults = copy.deepcopy(HTFLLIB_DEFAULTS)
        rounds = tree.get("rounds")
        defaults["algorithm"] = {"schedule_rounds": rounds if isinstance(rounds, int) and rounds >= 1 else 30}
        return defaults

    def __init__(self, params: FedKDParams, local: Any) -> None:
        super().__init__(params, local)
        self._w_h: dict[tuple[int, int], nn.Linear] = {}
        if params.eval_model == "mentee":  # the reconstruction of the next broadcast, assembled on each client
            self.personal_model = "assembled"

    # -- server ---------------------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        init_shared_state(server, MENTEE_KEY, self.name)

    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        sent = server.state.get(SENT_KEY)
        if sent is None:  # the first round: the initial mentee, raw
            return Message({MENTEE_KEY: server.state[MENTEE_KEY]})
        if self.params.resolved()[0] == "updates" and cid not in server.state[LAST_CLIENTS_KEY].tolist():
            # A mean update applies to the global the client started the last round from: one that was not in it
            # gets the global itself, raw (the authors' loop has every client in every round).
            return Message({MENTEE_KEY: server.state[MENTEE_KEY]})
        return Message(dict(sent))  # (K8): the compressed mean (or mean update) of the last round

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        uploads = [replies[c] for c in sorted(replies) if any(k.startswith(PREFIX) for k in replies[c])]  # client-id order
        if not uploads:
            return {}
        names = sorted({k[len(PREFIX) :].rsplit(".", 1)[0] if k.endswith((".U", ".S", ".V")) else k[len(PREFIX) :]
                        for k in uploads[0] if k.startswith(PREFIX)})  # fmt: skip
        mean = {name: torch.stack([reconstruct(r, name).double() for r in uploads]).mean(0).float() for name in names}  # (K7)
        compress_what = self.params.resolved()[0]
        zeros = 0
        if compress_what == "none":
            items = {PREFIX + name: value for name, value in mean.items()}
        else:
            items, zeros = compressed_items(mean, self.params.energy(info.round), self.params.rank_rule)  # (K8)
        server.state[SENT_KEY] = items
        # The global the broadcast stands for: the reconstruction of the mean, or the last global plus that of
        # the mean update (what a client that missed the round is sent raw).
        mentee = server.state[MENTEE_KEY].clone()
        offset = 0
        for name, shape, is_parameter in self._shapes(server):
            size = int(torch.Size(shape).numel())
            if is_parameter:  # buffers are not sent (K8): the server's stay as they were
                value = reconstruct(items, name).flatten()
                mentee[offset : offset + size] = mentee[offset : offset + size] + value if compress_what == "updates" else value
            offset += size
        server.state[MENTEE_KEY] = mentee
        server.state[LAST_CLIENTS_KEY] = torch.tensor(sorted(replies), dtype=torch.long)
        return {"server_rank0_tensors": float(zeros)}

    def _shapes(self, server: ServerContext) -> list[tuple[str, tuple[int, ...], bool]]:
        """The entries of the mentee's flat vector in order: (name, shape, whether a parameter)."""
        if server.shared_model_shapes is None:
            raise ValueError("fedkd: the engine gave the server no shared model (Exchange.shared_model)")
        return list(server.shared_model_shapes)

    # -- client ---------------------------------------------------------------------------------------------
    def _mentee(self, client: ClientContext, msg: Message) -> nn.Module:
        """The mentee as the server sent it: the raw first broadcast, or the client's last mentee (its buffers)
        with every sent parameter replaced by its reconstruction (or, for updates, start + the mean update)."""
        mentee = client.shared_model
        if mentee is None:
            raise ValueError("fedkd: the engine gave the client no shared model (Exchange.shared_model)")
        if MENTEE_KEY in msg:
            set_flat(mentee, msg[MENTEE_KEY])
            return mentee
        # The start of its last round (updates: the global the mean update applies to; parameters: its buffers).
        base = client.state.get(MENTEE_KEY, client.shared_initial)
        set_flat(mentee, base)
        updates = self.params.resolved()[0] == "updates"
        with torch.no_grad():
            for name, param in mentee.named_parameters():
                value = reconstruct(msg, name).to(param.device)
                param.copy_(param + value if updates else value)
        return mentee

    def _hidden_map(self, client: ClientContext, mentee_dim: int, mentor_dim: int) -> nn.Linear:
        """W_h, the client's own (created at its first round from its run-long stream, PyTorch's default Linear
        initialisation), loaded into a reused worker."""
        w_h = self._w_h.get((mentee_dim, mentor_dim))
        if w_h is None:
            w_h = self._w_h[(mentee_dim, mentor_dim)] = nn.Linear(mentee_dim, mentor_dim, bias=False).to(client.device)
        stored = client.state.get(W_H_KEY)
        set_flat(w_h, stored if stored is not None else run_long_linear_init(client, FEDKD, mentor_dim, mentee_dim, bias=False))
        return w_h

    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        load_own_model(client)
        mentor, mentee = client.model, self._mentee(client, msg)
        start = {name: p.detach().clone() for name, p in mentee.named_parameters()}
        start_flat = get_flat(mentee)
        compress_what, hidden, clip, _ = self.params.resolved()
        w_h = self._hidden_map(client, int(mentee.feature_dim), int(mentor.feature_dim)) if hidden == "learned" else None

        def batch_loss(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with autocast_context(client.precision, client.device):
                r, r_mentee = mentor.extract(x), mentee.extract(x)  # (K1)
                z, u = mentor.classifier(r), mentee.classifier(r_mentee)
                mapped = w_h(r_mentee) if w_h is not None else r_mentee
            loss = adaptive_mutual_losses(
                z.float(), u.float(), r.float(), mapped.float(), y, detach_peers=self.params.detach_peers
            )  # (K2)-(K3): the sum of both losses
            return loss, loss

        # (K4): the mentor and W_h at η, the mentee at η_m, each gradient clipped on its own
        parts = [(mentor, info.lr), (mentee, self.params.mentee_lr)] + ([(w_h, info.lr)] if w_h is not None else [])
        mean_loss = train_parts_jointly(client, parts, self.local, clip, batch_loss)
        keep_own_model(client)
        # updates: the global this round started from (the next mean update adds to it); parameters: the trained
        # mentee, whose buffers stay on the client while the next broadcast replaces its parameters (K8)
        client.state[MENTEE_KEY] = start_flat if compress_what == "updates" else get_flat(mentee)
        if w_h is not None:
            client.state[W_H_KEY] = get_flat(w_h)
        trained = dict(mentee.named_parameters())
        sent = {n: trained[n] - start[n] for n in trained} if compress_what == "updates" else trained
        if compress_what == "none":
            items, zeros = {PREFIX + n: t.detach().float().cpu().clone() for n, t in sent.items()}, 0
        else:
            items, zeros = compressed_items(sent, self.params.energy(info.round), self.params.rank_rule)  # (K5)-(K6)
        return Message({**items, RANK0: zeros, **metric_items(mean_loss, client.num_samples)})

    # -- eval_model="mentee": the mentee as the client would rebuild it from the next broadcast ----------------
    def assemble_personal_model(self, client: ClientContext, msg: Message) -> None:
        self._mentee(client, msg)

    def personal_predictor(self, client: ClientContext) -> nn.Module:
        return client.shared_model if self.params.eval_model == "mentee" else client.model
