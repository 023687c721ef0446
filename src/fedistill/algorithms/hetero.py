"""Shared pieces of the heterogeneous-model family (HtFLlib's baselines: Local, FD, FedProto; FedGH and FedTGP
build on the same): each client keeps a model of its own architecture as a flat vector in its state, and what
travels is per-class rows (:class:`~fedistill.protocol.ClassRows`), never weights.

Not a method: the methods compose these (their own files read top to bottom next to their cards). The pure maths
(sums, the server's mean over holders, the losses, nearest-prototype scores) is in :mod:`fedistill.class_losses`.
"""

from __future__ import annotations

import copy

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..class_losses import class_sums, nearest_prototype_scores
from ..models.flat import get_flat, set_flat
from ..protocol import ClassRows, ClientContext, Exchange
from .local import autocast_context, fused, local_sgd

# HtFLlib's pre-tuned client settings (system/total.sh; spec/experiments-hetero.md §4): plain SGD at 0.01 (no
# momentum, no weight decay, no decay of the rate), batches of 10, one local epoch; and per-client test splits,
# since these methods have no global model to test. ``config_defaults`` of each method fills them where the user
# left them unset. (HtFLlib's join ratio 1 is the run's clients_per_round = partition.num_clients.)
HTFLLIB_DEFAULTS: dict[str, Any] = {
    "local": {"lr": 0.01, "batch_size": 10, "epochs": 1, "momentum": 0.0, "weight_decay": 0.0, "lr_decay": 1.0},
    "partition": {"per_client_test": True},
}

class HtFLlibClientDefaults:
    """Mixin of the methods of HtFLlib's family (put before ``Algorithm`` among the bases): their ``config_defaults``
    are :data:`HTFLLIB_DEFAULTS`, filled where the user left a setting unset."""

    @classmethod
    def config_defaults(cls, tree: dict[str, Any]) -> dict[str, Any]:
        return copy.deepcopy(HTFLLIB_DEFAULTS)


# What FedProto, FedGH and FedTGP upload: the mean feature of each class a client holds, in the common dimension.
PROTOTYPE_UPLOAD = Exchange("class statistics", "class prototypes (mean features of the classes each holds)", common_feature=True)

# Client-state key of the client's own model (a flat vector: parameters and BatchNorm statistics).
OWN_MODEL = "model"


def load_own_model(client: ClientContext) -> None:
    """Put the client's own model into the reused worker (its architecture's seeded initial weights before its
    first round)."""
    stored = client.state.get(OWN_MODEL)
    set_flat(client.model, stored if stored is not None else client.initial_weights)


def keep_own_model(client: ClientContext) -> None:
    client.state[OWN_MODEL] = get_flat(client.model)


def train_own_model(client: ClientContext, lr: float, local: Any, **options: Any) -> Any:
    """The run's local SGD (``local``: epochs, batch size, momentum, weight decay) at ``lr`` on the client's own
    model, already loaded (:func:`load_own_model`), which is then kept; ``options`` go to ``local_sgd``
    (``extra_loss``, ``with_features``). Returns ``local_sgd``'s result."""
    result = local_sgd(
        client, lr=lr, epochs=local.epochs, batch_size=local.batch_size, momentum=local.momentum,
        weight_decay=local.weight_decay, **options,
    )  # fmt: skip
    keep_own_model(client)
    return result


def received_table(msg: Any, num_classes: int, device: torch.device, use: bool = True) -> tuple[Any, Any]:
    """The per-class rows the server sent (a teacher table, global prototypes) as a dense ``(C, d)`` table and its
    ``(C,)`` mask of classes present, or ``(None, None)`` when nothing came yet or ``use`` is false (λ = 0): then
    the client trains on CE alone, the same steps as ``local_only``."""
    received = ClassRows.read(msg)
    if not use or received is None or not len(received):
        return None, None
    return received.dense(num_classes, device)


class NearestPrototypeInference:
    """Personal evaluation by the nearest global prototype (FedProto P5, FedTGP): the evaluation message's
    prototypes are kept by :meth:`assemble_personal_model` and scored by :meth:`personal_predictor`; with
    ``params.inference: head``, or before any prototype exists, the client's own head."""

    params: Any

    def assemble_personal_model(self, client: ClientContext, msg: Any) -> None:
        load_own_model(client)
        self._evaluated = (client.cid, ClassRows.read(msg))  # the prototypes personal_predictor scores with

    def personal_predictor(self, client: ClientContext) -> nn.Module:
        cid, prototypes = getattr(self, "_evaluated", (None, None))
        if self.params.inference == "head" or cid != client.cid or prototypes is None or not len(prototypes):
            return client.model
        return NearestPrototype(client.model, *prototypes.dense(client.data.num_classes, client.device))


class ClassAccumulator:
    """Per-class sums and counts of detached rows over a round's forward passes (FD2, P2), on the client's device;
    :meth:`upload` makes the held classes' means."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def add(self, values: torch.Tensor, labels: torch.Tensor) -> None:
        sums, counts = class_sums(values, labels, self.num_classes)
        if self.sums is None or self.counts is None:
            self.sums, self.counts = sums, counts
        else:
            self.sums += sums
            self.counts += counts

    def upload(self) -> ClassRows | None:
        """The classes seen at least once (ascending), their mean rows (float32) and counts; None if none."""
        if self.sums is None or self.counts is None:
            return None
        counts, sums = self.counts.cpu(), self.sums.cpu()
        held = torch.nonzero(counts > 0).flatten()
        return ClassRows(held, (sums[held] / counts[held, None].to(torch.float64)).float(), counts[held])


@torch.no_grad()
def eval_class_means(client: ClientContext, batch_size: int = 256) -> ClassRows | None:
    """Class means of the features of every training sample, in eval mode, un-augmented (fedproto.md
    ``proto_timing: after_training``; FedGH's GH3 and FedTGP's T2 make their prototypes this way)."""
    model = client.model
    model.eval()
    acc = ClassAccumulator(client.data.num_classes)
    for start in range(0, client.num_samples, batch_size):
        x, y = client.data.clean_batch(client.train_indices[start : start + batch_size])
        with autocast_context(client.precision, client.device):
            features = model.extract(x)
        acc.add(features.float(), y)
    return acc.upload()


class NearestPrototype(nn.Module):
    """A classifier over ``model``'s features: the nearest of the global prototypes (spec/fedproto.md P5); its
    outputs are :func:`~fedistill.class_losses.nearest_prototype_scores`, so their argmax is the prediction."""

    def __init__(self, model: nn.Module, prototypes: torch.Tensor, present: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.prototypes, self.present = prototypes, present

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nearest_prototype_scores(self.model.extract(x), self.prototypes, self.present)


def stacked_uploads(uploads: Sequence[ClassRows]) -> tuple[torch.Tensor, torch.Tensor]:
    """All uploaded rows and their class ids, one row per (client, class), in the uploads' (client-id) order:
    the tiny labelled set FedGH's header and FedTGP's prototypes are trained on (fedgh.md GH4, fedtgp.md T7)."""
    return torch.cat([u.rows.float() for u in uploads]), torch.cat([u.classes.long() for u in uploads])


def sgd_on_rows(
    module: nn.Module,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
) -> float:
    """The server's training on the uploaded rows (fedgh.md GH4, fedtgp.md T7): ``epochs`` passes, each a fresh
    permutation from ``generator`` cut into batches of ``batch_size`` (the last partial batch kept), one
    plain-SGD step of ``module``'s parameters (a new, stateless optimiser) on ``loss(rows, labels)`` per batch.
    Returns the sample-weighted mean loss of the last epoch (nan when nothing was trained)."""
    device = next(module.parameters()).device
    rows, labels = rows.to(device), labels.to(device)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    module.train()
    last = float("nan")
    for _ in range(epochs):
        order = torch.randperm(rows.shape[0], generator=generator).to(device)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for start in range(0, rows.shape[0], batch_size):
            batch = order[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            value = loss(rows[batch], labels[batch])
            value.backward()
            optimizer.step()
            total += value.detach().double() * batch.numel()
        last = float(total / max(rows.shape[0], 1))
    return last


# -- the shared-part methods (LG-FedAvg, FML, FedKD, FedMRL): one part every client holds in one shape ------------
SAMPLES_KEY = "num_samples"  # an upload's n_k, where the server weights by samples


def init_shared_state(server: Any, key: str, method: str) -> None:
    """The shared model's seeded initial weights into ``server.state[key]`` (once; a resumed state is kept)."""
    if key not in server.state:
        if server.shared_initial is None:
            raise ValueError(f"{method}: the engine gave the server no shared model (Exchange.shared_model)")
        server.state[key] = server.shared_initial.clone()


def mean_of_uploads(replies: Mapping[int, Any], key: str, weighting: str, method: str) -> torch.Tensor | None:
    """The mean of the arrived flat vectors ``reply[key]``, in client-id order: plain (``"uniform"``) or weighted by
    n_k / Σ n_j (``"samples"``, each reply's ``num_samples``); float64 sums, float32 result. None when none
    arrived; vectors of different sizes are refused (they cannot be averaged)."""
    uploads = [replies[cid] for cid in sorted(replies) if key in replies[cid]]
    if not uploads:
        return None
    sizes = {int(r[key].numel()) for r in uploads}
    if len(sizes) > 1:
        raise ValueError(f"{method}: the clients' {key} vectors differ in size ({sorted(sizes)}): they cannot be averaged")
    if weighting == "samples":
        weights = torch.tensor([float(r[SAMPLES_KEY]) for r in uploads], dtype=torch.float64)
    else:
        weights = torch.ones(len(uploads), dtype=torch.float64)
    weights = weights / weights.sum()
    return (weights @ torch.stack([r[key].double() for r in uploads])).float()


def run_long_linear_init(client: ClientContext, tag: int, out_features: int, in_features: int, bias: bool) -> torch.Tensor:
    """A client's private Linear layer's initial weights (flat: weight, then bias) drawn once for the whole run
    from ``make_generator(seed, tag, 0, cid)`` with PyTorch's default Linear distribution (uniform in
    ±1/sqrt(in_features)): the same in every round, process and resume (FedMRL's P_k^0, FedKD's W_h)."""
    from ..engine.seeding import make_generator

    g = make_generator(client.seed, tag, 0, client.cid)
    count = out_features * in_features + (out_features if bias else 0)
    return (torch.rand(count, generator=g) * 2 - 1) * in_features**-0.5


def train_parts_jointly(
    client: ClientContext,
    parts: Sequence[tuple[nn.Module, float]],
    local: Any,
    clip_norm: float | None,
    batch_loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> float:
    """``local.epochs`` passes over the client's batches training several modules on one objective (FML's
    private model and meme, FedKD's mentor, mentee and W_h, FedMRL's private model, projector and shared model):
    per batch ``batch_loss(x, y)`` gives (the loss to back-propagate, the loss to report); one backward through
    all parts (HtFLlib's consecutive backward passes accumulate to the same gradients), each part's gradient
    clipped to ``clip_norm`` on its own, then one SGD step of each at its rate (``parts``: (module, rate); new
    optimisers each round, momentum and weight decay as ``local`` says). Returns the sample-weighted mean
    reported loss (nan without a batch)."""
    optimizers = []
    for module, rate in parts:
        module.train()
        optimizers.append(torch.optim.SGD(
            module.parameters(), lr=rate, momentum=local.momentum, weight_decay=local.weight_decay, **fused(client.device)
        ))  # fmt: skip  (local_sgd's fused kernel: one pass per tensor)
    loss_sum = torch.zeros((), dtype=torch.float64, device=client.device)
    seen = 0
    for _ in range(local.epochs):
        for x, y in client.data.epoch_batches(client.train_indices, local.batch_size, client.generator):
            loss, reported = batch_loss(x, y)
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if clip_norm is not None:
                for module, _ in parts:
                    torch.nn.utils.clip_grad_norm_(module.parameters(), clip_norm)
            for optimizer in optimizers:
                optimizer.step()
            loss_sum += reported.detach().double() * y.shape[0]
            seen += int(y.shape[0])
    return float(loss_sum / seen) if seen else float("nan")


def global_head(method: str) -> Callable[[Any], nn.Module]:
    """A builder of the server's Linear(d, C) over the clients' common feature dimension (FedGH's header,
    LG-FedAvg's head), for a :class:`~fedistill.algorithms.server_modules.PersistentModule`."""

    def build(server: Any) -> nn.Module:
        if server.feature_dim <= 0:
            raise ValueError(f"{method}: the server needs the clients' common feature dimension (ServerContext.feature_dim)")
        return nn.Linear(server.feature_dim, server.num_classes)

    return build
