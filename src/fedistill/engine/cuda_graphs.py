"""A client's SGD step captured as one CUDA graph (``run.cuda_graphs``, issue 29).

On a GPU the small CNNs of the papers' MNIST protocols are launch-bound: a FedAvg round on an H200 kept the GPU
busy 8-9 % of the time, with about 112 kernel launches per training step at about 46 µs of host time each
(benchmarks/RESULTS.md "The GPU path"). Capturing forward, cross-entropy, backward and the optimizer step once
and replaying them turns those launches into one graph launch per step; the arithmetic is the same kernels on the
same tensors.

What a capture needs, and how this module meets it:

- **Fixed tensors.** A graph replays on the memory it was captured with. The worker model is reused for every
  client (weights loaded in place by ``set_flat``), so its parameters keep their storage. The graph's one input
  is a batch's *columns* (the sample indices and their augmentation draws, ``TensorPipeline.epoch_columns``),
  copied into a static tensor: the gather, the augmentation and the normalisation are captured with the step
  (on the MNIST protocol they were about 30 of the launches a step left outside a graph of the step alone).
  Only full batches of the captured size replay; a client's last partial batch runs the same step eagerly on
  the same optimizer.
- **A persistent optimizer.** ``local_sgd`` makes a new SGD (empty momentum) for every client and round; here
  one optimizer lives with the graph and its momentum buffers are zeroed at each client's start. With dampening
  0, PyTorch's first step sets ``buf = g``; from a zero buffer the update computes ``ρ·0 + g = g``, the same
  number, so the trajectory is the one a fresh optimizer gives (tests/test_cuda_graphs.py checks it on CPU).
- **Warm-up without side effects.** CUDA wants a few eager iterations on a side stream before capture (lazy
  cuBLAS/autograd state, the optimizer's buffers). They are real steps on the current batch, so the model's
  parameters and buffers are saved first and restored after capture: whether a step is the process's first
  capture or not changes nothing in the run, so a resumed run equals an uninterrupted one.
- **Constants.** The learning rate, momentum, weight decay, clip and precision are baked into the captured
  kernels: they are part of the key, and a change (a decayed learning rate in the next round) captures anew.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

Optimizers = Callable[[nn.Module], torch.optim.Optimizer]
BatchMaker = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]  # columns -> (x, y), on the device

WARMUP_STEPS = 3  # eager iterations on a side stream before the capture (PyTorch's CUDA graphs notes use 3)


@dataclass(frozen=True)
class StepKey:
    """Everything that is baked into a captured step: a different value needs a new capture."""

    columns_shape: tuple[int, ...]  # (1 + random draws per sample, batch size)
    lr: float
    momentum: float
    weight_decay: float
    grad_clip: float | None
    precision: str


class GraphedSGDStep:
    """One captured training step of ``model`` (batch making included) on batches of one size, with its own SGD."""

    def __init__(self, model: nn.Module, key: StepKey, optimizer: torch.optim.Optimizer, make_batch: BatchMaker, cols: torch.Tensor):
        dropout = [name for name, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
        if dropout:
            # Its masks would come from CUDA's generator inside the graph and in the warm-up, which this module
            # does not put back: a resumed run would draw other masks.
            raise ConfigError(
                f"run.cuda_graphs does not support models with dropout ({', '.join(dropout[:3])}); drop run.cuda_graphs"
            )
        self.key = key
        self.optimizer = optimizer
        self.make_batch = make_batch
        self.static_cols = cols.clone()
        saved = [t.detach().clone() for t in _state_tensors(model)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step(model, *make_batch(self.static_cols))
        torch.cuda.current_stream().wait_stream(side)
        # The captured backward must create the gradients in the graph's pool (AccumulateGrad "steals" them).
        optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call (a client state written to disk) does not break the capture.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            # Detached: the captured autograd graph is not kept alive (its AccumulateGrad nodes would meet the next
            # capture's warm-up on another stream).
            self.static_loss = self._step(model, *make_batch(self.static_cols), zero_grad=False).detach()
        with torch.no_grad():  # undo the warm-up: the run continues from the weights it had
            for t, s in zip(_state_tensors(model), saved):
                t.copy_(s)

    def _step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, zero_grad: bool = True) -> torch.Tensor:
        key = self.key
        return eager_sgd_step(model, self.optimizer, x, y, key.precision, key.grad_clip, zero_grad=zero_grad)

    def start_client(self) -> None:
        reset_momentum(self.optimizer)

    def step(self, model: nn.Module, cols: torch.Tensor) -> torch.Tensor:
        """One training step on the batch ``cols``: the graph when it has the captured size, else eagerly."""
        if tuple(cols.shape) == self.key.columns_shape:
            self.static_cols.copy_(cols)
            self.graph.replay()
            return self.static_loss
        return self._step(model, *self.make_batch(cols))


def eager_sgd_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    precision: str,
    grad_clip: float | None,
    zero_grad: bool = True,
) -> torch.Tensor:
    """The plain step ``local_sgd`` takes (fedavg.md §3): mean CE on the batch, backward, optional clip, SGD step."""
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
    # No autocast weight cache: a cached cast would be captured once and not refreshed as the weights move.
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16", cache_enabled=False):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    if grad_clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss


def reset_momentum(optimizer: torch.optim.Optimizer) -> None:
    """A fresh SGD's state for the next client, in place: every momentum buffer at zero.

    PyTorch's first SGD step sets ``buf = g`` (dampening 0); from a zero buffer the next step computes
    ``buf = ρ·0 + g``, the same number, and then the same update, so a kept optimizer reset here follows a new
    one's trajectory bit for bit (tests/test_cuda_graphs.py).
    """
    for state in optimizer.state.values():
        buf = state.get("momentum_buffer")
        if buf is not None:
            buf.zero_()


def _state_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [p.data for p in model.parameters()] + list(model.buffers())


# One captured step per worker model, dropped with the model (a process holds one worker per architecture).
_STEPS: "weakref.WeakKeyDictionary[nn.Module, GraphedSGDStep]" = weakref.WeakKeyDictionary()


def graphed_sgd_step(model: nn.Module, key: StepKey, optimizer_for: Optimizers, make_batch: BatchMaker, cols: torch.Tensor) -> GraphedSGDStep:
    """The captured step of ``model`` for ``key``, capturing it (and its optimizer) when there is none yet."""
    step = _STEPS.get(model)
    if step is None or step.key != key or step.make_batch != make_batch:
        step = None
        _STEPS.pop(model, None)  # release the old graph's memory before capturing the new one
        step = _STEPS[model] = GraphedSGDStep(model, key, optimizer_for(model), make_batch, cols)
    step.start_client()
    return step
