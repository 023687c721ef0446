"""Local training on a client: mini-batch SGD over the client's index set.

Semantics follow fedavg.md §3: ``torch.optim.SGD`` (dampening 0, no Nesterov, coupled weight decay), a new
optimizer (empty momentum buffer) in every round, ``E * ceil(n_k / B)`` steps, last partial batch kept,
mean cross-entropy per batch. Methods that add something to the local objective pass ``extra_loss`` (a
loss term such as FedProx's proximal term) and/or ``logit_transform``; the loop itself stays one loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import torch
from torch import nn

from ..engine.cuda_graphs import (
    GraphedSGDStep,
    StepKey,
    cuda_learning_rate,
    fixed_generation,
    graphed_sgd_step,
    plain_train_step,
    tensor_learning_rate,
)
from ..engine.evaluation import Evaluation, autocast_context, evaluate  # noqa: F401  (the methods import them from here)
from ..models.flat import mean_loss_of
from .base import ClientContext

# extra_loss(model, x, y, logits, features) -> scalar tensor added to the CE loss; ``features`` is the
# penultimate representation when the caller asked for it (with_features=True), else None. A term that draws
# random inputs on the host each step (FedGen's noise) may carry ``prepare_step(m)``: local_sgd calls it before
# every step, outside any captured graph, with the batch's size (see prepare_hook).
ExtraLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def prepare_hook(extra_loss: ExtraLoss | None) -> Callable[[int], None] | None:
    """The term's per-step host hook (``extra_loss.prepare_step``), or None.

    A captured step cannot draw from the client's CPU generator (the draw would be baked into the graph): a term
    whose inputs are random draws makes them here, before each step, into ``client.fixed`` buffers that its loss
    reads. The eager loop calls it at the same point, so the draws keep their order in the client's stream.
    """
    return getattr(extra_loss, "prepare_step", None)


@dataclass(frozen=True)
class LocalResult:
    steps: int
    samples_seen: int
    # The sample-weighted mean of the batch losses (CE + extra terms): a float, or under run.resident_weights a 0-d
    # float64 tensor on the device (:func:`mean_loss_of`), which the server reads when the round ends.
    mean_loss: float | torch.Tensor


def effective_local_steps(steps: int, momentum: float) -> float:
    """``Σ_{s=1}^{τ} (1 − ρ^s)/(1 − ρ)``: local steps counted with heavy-ball momentum (τ when ρ = 0).

    FedNova's normaliser ``a_k`` (fednova.md §3) and SCAFFOLD's ``K_eff`` (scaffold.md §3). PyTorch's
    momentum buffer starts at the first gradient, so one step counts as exactly 1.
    """
    if steps < 0:
        raise ValueError("steps must be >= 0")
    if momentum == 0.0:
        return float(steps)
    rho = float(momentum)
    return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)


def fused(device: torch.device) -> dict[str, bool]:
    """``fused=True`` for ``torch.optim.SGD``/``Adam`` where PyTorch has the fused kernels (CPU, CUDA).

    One pass per tensor instead of the foreach implementation's several: the SGD step of the FedLMD CNN was up
    to half of a CPU training step without it, and a foreach Adam step is 7x slower once ``exp_avg_sq`` holds
    denormal floats (gradients around 1e-20, as a distillation student close to its teachers gets: 14.5 vs
    1.1 ms for the 1.6 M-weight fc1 of that CNN, FedDF's server spending a quarter of its time there;
    benchmarks/RESULTS.md, issue 15 target 2). The result equals the foreach update up to rounding.
    """
    return {"fused": True} if device.type in ("cpu", "cuda") else {}


def local_sgd(
    client: ClientContext,
    *,
    lr: float,
    epochs: int,
    batch_size: int,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    extra_loss: ExtraLoss | None = None,
    logit_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    with_features: bool = False,
    before_step: Callable[[nn.Module], None] | None = None,
    grad_clip: float | None = None,
    graph_key: Hashable | None = None,
) -> LocalResult:
    """Train ``client.model`` in place for ``epochs`` passes over the client's data.

    ``graph_key``: under ``run.cuda_graphs``, what the loss terms and corrections bake into a captured step as
    Python values (engine/cuda_graphs.py); None means they cannot be captured and the step runs eagerly. The
    plain step (no terms) is always captured.
    """
    model = client.model
    model.train()
    # On CUDA rounded to float32, as a captured step reads it from a tensor (engine/cuda_graphs.cuda_learning_rate).
    lr = cuda_learning_rate(lr, client.device)
    # run.cuda_graphs on a GPU: the learning rate lives in a device tensor, so a decayed one needs no new capture.
    tensor_lr = client.cuda_graphs and client.device.type == "cuda"

    def new_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        # The fused kernel does weight decay, momentum and the update in one pass per tensor, without the
        # temporary gradient copies of the default implementation: on CPU the optimizer step of the FedLMD
        # CNN is memory-bound and was up to half of the step time (benchmarks/RESULTS.md).
        step_lr = tensor_learning_rate(lr, client.device) if tensor_lr else lr
        return torch.optim.SGD(module.parameters(), lr=step_lr, momentum=momentum, weight_decay=weight_decay, **fused(client.device))

    # On the client's device: a CPU accumulator would copy (and so synchronise) an accelerator's loss every step.
    loss_sum = torch.zeros((), dtype=torch.float64, device=client.device)
    steps = seen = 0
    prepare = prepare_hook(extra_loss)
    # run.cuda_graphs: the step is replayed from one CUDA graph that also makes the batch from its index columns
    # (engine/cuda_graphs.py), a partial batch from a graph of its size. Loss terms and corrections are captured
    # when the method says what they bake in (graph_key) and reads its per-client tensors through client.fixed.
    plain = extra_loss is None and logit_transform is None and before_step is None and not with_features
    graphs = client.cuda_graphs and (plain or graph_key is not None)
    # One step, eager or captured (engine/cuda_graphs.eager_sgd_step): CE on the (transformed) logits plus the loss
    # term, backward, the gradient correction (SCAFFOLD acts on .grad before the step), the optional clip, SGD.
    # The eager loop keeps autocast's weight cache (its bits, FedGen's included); a captured step cannot.
    train_step = plain_train_step(
        client.precision, grad_clip, extra_loss=extra_loss, logit_transform=logit_transform,
        with_features=with_features, before_step=before_step, autocast_cache=not graphs,
    )
    if graphs:
        terms = () if plain else (graph_key, fixed_generation(model))
        graphed: GraphedSGDStep | None = None
        eager_optimizer: torch.optim.Optimizer | None = None
        for _ in range(epochs):
            for cols in client.data.epoch_columns(client.train_indices, batch_size, client.generator):
                m = int(cols.shape[1])
                if prepare is not None:
                    prepare(m)
                if graphed is None and eager_optimizer is None and m == batch_size:
                    baked_lr = None if tensor_lr else lr
                    key = StepKey(tuple(cols.shape), baked_lr, momentum, weight_decay, grad_clip, client.precision, terms)
                    graphed = graphed_sgd_step(
                        model, key, new_optimizer, client.data.batch_from_columns, cols, train_step, lr=lr if tensor_lr else None
                    )
                if graphed is not None:
                    loss = graphed.step(model, cols, train_step)
                else:  # a client smaller than one batch: never a full batch to capture
                    eager_optimizer = eager_optimizer or new_optimizer(model)
                    loss = train_step(model, eager_optimizer, *client.data.batch_from_columns(cols), True)
                loss_sum += loss.detach().double() * m
                steps += 1
                seen += m
        return LocalResult(steps=steps, samples_seen=seen, mean_loss=mean_loss_of(loss_sum, seen))

    optimizer = new_optimizer(model)
    for _ in range(epochs):
        for x, y in client.data.epoch_batches(client.train_indices, batch_size, client.generator):
            if prepare is not None:
                prepare(int(y.shape[0]))
            loss = train_step(model, optimizer, x, y, True)
            # Accumulate on-device; a single .item() at the end avoids a sync per step.
            loss_sum += loss.detach().double() * y.shape[0]
            steps += 1
            seen += int(y.shape[0])
    return LocalResult(steps=steps, samples_seen=seen, mean_loss=mean_loss_of(loss_sum, seen))
