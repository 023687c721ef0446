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
  Full batches replay the captured step; a client's last partial batch replays a graph of its size, captured
  on first use into the same memory pool (``GraphedSGDStep._capture_partial``; eagerly if that capture fails).
- **A persistent optimizer.** ``local_sgd`` makes a new SGD (empty momentum) for every client and round; here
  one optimizer lives with the graph and its momentum buffers are zeroed at each client's start. With dampening
  0, PyTorch's first step sets ``buf = g``; from a zero buffer the update computes ``ρ·0 + g = g``, the same
  number, so the trajectory is the one a fresh optimizer gives (tests/test_cuda_graphs.py checks it on CPU).
- **Warm-up without side effects.** CUDA wants a few eager iterations on a side stream before capture (lazy
  cuBLAS/autograd state, the optimizer's buffers). They are real steps on the current batch, so the model's
  parameters and buffers are saved first and restored after capture: whether a step is the process's first
  capture or not changes nothing in the run, so a resumed run equals an uninterrupted one.
- **Constants.** Momentum, weight decay, clip and precision are baked into the captured kernels: they are part of
  the key, and a change captures anew.
- **The learning rate is a device tensor** (issue 41), so that its decay from round to round does not capture
  every step again (ten captures a round on the MNIST protocol, each draining the GPU's queue). The fused SGD
  kernel reads a tensor learning rate as float32 and a Python one as float64 (``p -= lr * g`` in double), so on
  CUDA ``local_sgd`` rounds the learning rate to float32 for the eager step too (:func:`cuda_learning_rate`):
  graphs and eager then compute the same numbers, and a CPU run is untouched.
- **Loss terms and gradient corrections** (issue 41: FedProx, FedNTD, FedLMD, MOON, SCAFFOLD, FedDyn, FedRS,
  FedCurv, ...). Their closures read tensors that change from client to client: the round's broadcast weights
  as an anchor, a control variate, a class mask, a frozen teacher. A graph captured with the first client's
  closure replays the kernels on the *addresses* that closure read, so every such tensor goes through
  :func:`fixed_input` (``ClientContext.fixed``): one buffer per name and worker model, overwritten in place for
  each client, so the next client's values sit where the captured kernels look. Teachers are persistent modules
  loaded in place already (``GlobalTeacher``). What a closure bakes in as a Python value (its structure: teacher
  or teacher-free; a per-client scalar) is the method's ``graph_key``, part of the key. A method that does not
  declare one keeps the eager step.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .evaluation import Evaluation, EvaluationTotals, evaluate, evaluation_totals, read_totals

Optimizers = Callable[[nn.Module], torch.optim.Optimizer]
BatchMaker = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]  # columns -> (x, y), on the device
# train_step(model, optimizer, x, y, zero_grad) -> loss: one client step, loss terms and corrections included
TrainStep = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor, bool], torch.Tensor]

WARMUP_STEPS = 3  # eager iterations on a side stream before the capture (PyTorch's CUDA graphs notes use 3)
# A client's partial last batch replayed from a graph of its size (GraphedSGDStep._capture_partial); False: eager.
CAPTURE_PARTIAL_BATCHES = True


@dataclass(frozen=True)
class StepKey:
    """Everything that is baked into a captured step: a different value needs a new capture."""

    columns_shape: tuple[int, ...]  # (1 + random draws per sample, batch size)
    lr: float | None  # None: read from the optimizer's device tensor (set per client), not baked in
    momentum: float
    weight_decay: float
    grad_clip: float | None
    precision: str
    # The method's graph_key (what its loss terms bake in as Python values) and the fixed inputs' generation
    # (a buffer reallocated at another shape or device has another address): () for the plain step.
    terms: Hashable = ()


class GraphedSGDStep:
    """One captured training step of ``model`` (batch making included) on batches of one size, with its own SGD."""

    def __init__(
        self,
        model: nn.Module,
        key: StepKey,
        optimizer: torch.optim.Optimizer,
        make_batch: BatchMaker,
        cols: torch.Tensor,
        train_step: TrainStep | None = None,
    ):
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
        self.train_step = train_step or plain_train_step(key.precision, key.grad_clip)
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

        # Graphs of the partial batches, by size (None: that size's capture failed and it runs eagerly).
        self.partial: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor] | None] = {}

    def _step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, zero_grad: bool = True) -> torch.Tensor:
        return self.train_step(model, self.optimizer, x, y, zero_grad)

    def start_client(self, lr: float | None = None) -> None:
        """A fresh optimizer's state for the next client; ``lr`` into the device tensor the graph reads."""
        reset_momentum(self.optimizer)
        if lr is not None:
            set_tensor_learning_rate(self.optimizer, lr)

    def step(self, model: nn.Module, cols: torch.Tensor, train_step: TrainStep | None = None) -> torch.Tensor:
        """One training step on the batch ``cols``: the graph when it has the captured size, a partial batch's
        graph (captured on first use) else, or eagerly with ``train_step`` (the current client's closures)."""
        if tuple(cols.shape) == self.key.columns_shape:
            self.static_cols.copy_(cols)
            self.graph.replay()
            return self.static_loss
        size = int(cols.shape[1])
        if CAPTURE_PARTIAL_BATCHES and cols.shape[0] == self.key.columns_shape[0]:
            if size not in self.partial:
                self.partial[size] = self._capture_partial(model, cols, train_step or self.train_step)
            entry = self.partial[size]
            if entry is not None:
                graph, static_cols, static_loss = entry
                static_cols.copy_(cols)
                graph.replay()
                return static_loss
        return (train_step or self.train_step)(model, self.optimizer, *self.make_batch(cols), True)

    def _capture_partial(self, model: nn.Module, cols: torch.Tensor, train_step: TrainStep):
        """The step on a partial batch of ``cols``'s size as a graph sharing the full step's memory pool.

        On the MNIST protocol a client's last batch of each epoch is partial: 50 of a round's 600 steps, and as
        eager steps about a third of the round's time on an H100 (issue 41). No warm-up: the full step's capture
        made the lazy state (cuBLAS handles, the optimizer's buffers), and a capture only records, so the weights
        are not touched. The pool is shared (one step's memory, not one per size): the replays run one after
        another on one stream, each graph writes its intermediates before reading them, and what one graph
        leaves for later (its loss) is read before the next replay.
        """
        static_cols = cols.clone()
        # This graph's backward must create its own gradients (AccumulateGrad steals them), not add to the last one's.
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.graph.pool(), capture_error_mode="thread_local"):
                static_loss = train_step(model, self.optimizer, *self.make_batch(static_cols), False).detach()
        except RuntimeError as exc:  # the step on this size runs eagerly instead: same numbers, slower
            warnings.warn(f"run.cuda_graphs: the partial batch of {int(cols.shape[1])} could not be captured ({exc}); it runs eagerly")
            self.optimizer.zero_grad(set_to_none=True)
            return None
        return graph, static_cols, static_loss


def eager_sgd_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    precision: str,
    grad_clip: float | None,
    zero_grad: bool = True,
    *,
    extra_loss: Callable | None = None,
    logit_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    with_features: bool = False,
    before_step: Callable[[nn.Module], None] | None = None,
    autocast_cache: bool = False,
) -> torch.Tensor:
    """The step ``local_sgd`` takes (fedavg.md §3): mean CE on the batch (its logits through ``logit_transform``)
    plus ``extra_loss``, backward, ``before_step`` (a gradient correction), optional clip, SGD step.

    ``autocast_cache``: bf16 autocast's weight cache, off for a captured step (a cached cast would be captured
    once and not refreshed as the weights move), on in local_sgd's eager loop. It changes bits only where a loss
    term runs a weight through the forward twice (FedGen's head): with the cache both uses share one bf16 copy,
    whose gradient is summed in bf16 before the cast back; without it each use's gradient is cast back and summed
    in fp32.
    """
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16", cache_enabled=autocast_cache):
        if with_features:
            features = model.extract(x)
            logits = model.classify(features)
        else:
            features, logits = None, model(x)
        ce_logits = logits.float() if logit_transform is None else logit_transform(logits.float())
        loss = F.cross_entropy(ce_logits, y)
        if extra_loss is not None:
            loss = loss + extra_loss(model, x, y, logits, features)
    loss.backward()
    if before_step is not None:
        before_step(model)
    if grad_clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss


def plain_train_step(precision: str, grad_clip: float | None, **terms) -> TrainStep:
    """:func:`eager_sgd_step` with its settings and ``terms`` bound: a :data:`TrainStep`."""

    def train_step(model, optimizer, x, y, zero_grad=True):
        return eager_sgd_step(model, optimizer, x, y, precision, grad_clip, zero_grad, **terms)

    return train_step


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


def graphed_sgd_step(
    model: nn.Module,
    key: StepKey,
    optimizer_for: Optimizers,
    make_batch: BatchMaker,
    cols: torch.Tensor,
    train_step: TrainStep | None = None,
    lr: float | None = None,
) -> GraphedSGDStep:
    """The captured step of ``model`` for ``key``, capturing it (and its optimizer) when there is none yet.

    ``lr``: with ``key.lr`` None, this client's learning rate, written into the optimizer's tensor."""
    step = _STEPS.get(model)
    if step is None or step.key != key or step.make_batch != make_batch:
        step = None
        _STEPS.pop(model, None)  # release the old graph's memory before capturing the new one
        step = _STEPS[model] = GraphedSGDStep(model, key, optimizer_for(model), make_batch, cols, train_step)
    step.start_client(lr)
    return step


def cuda_learning_rate(lr: float, device: torch.device) -> float:
    """The learning rate a client step uses on ``device``: on CUDA rounded to float32 (module docstring).

    The fused SGD kernel computes ``p -= lr * g`` in double with the Python learning rate, and with ``(double)
    *lr_ptr`` when the learning rate is a float32 tensor, as a captured step's must be to change between rounds
    without a new capture. Rounding the Python value to float32 makes the two the same number (a relative change
    below 6e-8); on other devices the learning rate is unchanged.
    """
    return float(torch.tensor(lr, dtype=torch.float32)) if device.type == "cuda" else lr


def tensor_learning_rate(lr: float, device: torch.device) -> torch.Tensor:
    """``lr`` as the float32 device tensor a captured optimizer reads (its address is baked into the graph)."""
    return torch.tensor(lr, dtype=torch.float32, device=device)


def set_tensor_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into each parameter group's learning-rate tensor, in place (the captured kernels read it)."""
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            raise TypeError("set_tensor_learning_rate: this optimizer's learning rate is a Python number, baked into its graph")
        group["lr"].fill_(lr)


class FixedInputs:
    """The fixed buffers of one worker model's captured step: one per name, overwritten in place per client."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        # Bumped when a buffer is reallocated (another shape, dtype or device): a graph captured before reads its old
        # address. A new name is not counted: no graph captured before can have read it.
        self.generation = 0

    def put(self, name: str, value: torch.Tensor) -> torch.Tensor:
        value = value.detach()
        buffer = self.buffers.get(name)
        if buffer is None:
            self.buffers[name] = buffer = value.clone()
        elif buffer.shape != value.shape or buffer.dtype != value.dtype or buffer.device != value.device:
            self.buffers[name] = buffer = value.clone()
            self.generation += 1
        else:
            buffer.copy_(value)
        return buffer


_FIXED: "weakref.WeakKeyDictionary[nn.Module, FixedInputs]" = weakref.WeakKeyDictionary()


def fixed_input(model: nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into the fixed buffer ``name`` of ``model``'s captured step (module docstring: loss terms).

    The buffer has ``value``'s shape, dtype and device and keeps its address from client to client, so a graph
    captured with one client's loss term reads the next client's values. Not a copy to keep: the next client's
    call overwrites it.
    """
    inputs = _FIXED.get(model)
    if inputs is None:
        inputs = _FIXED[model] = FixedInputs()
    return inputs.put(name, value)


def fixed_generation(model: nn.Module) -> int:
    """How many times ``model``'s fixed buffers were (re)allocated: part of a capture's key."""
    inputs = _FIXED.get(model)
    return 0 if inputs is None else inputs.generation


class GraphedEvaluation:
    """The server's evaluation of the whole test split as one CUDA graph (``run.cuda_graphs``, issue 41).

    After the client steps were captured, the largest host cost of a graphed FedAvg round on the MNIST protocol was
    the global model's evaluation: 100 test batches of eager kernels (about 0.14 s of a 0.58 s round on an H100,
    benchmarks/RESULTS.md "The GPU, fourth lease"). Everything it reads keeps its address from round to round: the
    test images and labels live on the device for the run, and the server model's weights are loaded in place. So
    the loop over every batch (:func:`~fedistill.engine.evaluation.evaluation_totals`: normalisation, forward,
    cross-entropy, hits and the class histogram, summed on the device) is recorded once, unrolled, and each later
    evaluation is one replay: the same kernels in the same order on the same memory, so the same bits.

    The key holds the address, shape and dtype of every weight, buffer and data tensor read: a model whose weights
    were replaced (not loaded in place) or another test split is captured anew, never read at stale addresses.
    """

    def __init__(self, run: Callable[[], EvaluationTotals], key: Hashable):
        self.key = key
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy cuDNN/cuBLAS state for these shapes, outside the capture
            run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.totals = run()

    def replay(self) -> EvaluationTotals:
        self.graph.replay()
        return self.totals


# The captured evaluations of each model by key (None: that key's capture failed, so it is evaluated eagerly). A
# run can ask for the per-sample hits in some rounds and not in others: both graphs are kept. A key whose weights
# moved (replaced, not loaded in place) is never met again, so past MAX_EVALUATION_GRAPHS keys the oldest goes.
_EVALUATIONS: "weakref.WeakKeyDictionary[nn.Module, dict[Hashable, GraphedEvaluation | None]]" = weakref.WeakKeyDictionary()
MAX_EVALUATION_GRAPHS = 4


def _addresses(tensors) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors)


def graphed_evaluate(
    model: nn.Module,
    make_batches: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
    precision: str,
    per_sample: bool,
    data: tuple[torch.Tensor, ...],
    settings: Hashable = (),
) -> Evaluation:
    """:func:`~fedistill.engine.evaluation.evaluate` of ``model`` on ``make_batches()`` replayed from one CUDA graph.

    ``data``: every tensor the batches are cut from (the test images and labels on the device); ``settings``: what
    else shapes the batches (the batch size). Both are part of the capture's key with the model's weight addresses.
    """
    key = (precision, per_sample, settings, _addresses(_state_tensors(model)), _addresses(data))
    with torch.inference_mode():
        model.eval()
        graphs = _EVALUATIONS.setdefault(model, {})
        if key not in graphs:
            while len(graphs) >= MAX_EVALUATION_GRAPHS:  # release the oldest graph's memory before capturing anew
                graphs.pop(next(iter(graphs)))
            try:
                graphs[key] = GraphedEvaluation(lambda: evaluation_totals(model, make_batches(), precision, per_sample), key)
            except RuntimeError as exc:  # this model's forward cannot be captured: eager evaluation, same numbers
                warnings.warn(f"run.cuda_graphs: the evaluation of {type(model).__name__} could not be captured ({exc}); it runs eagerly")
                graphs[key] = None
        graphed = graphs[key]
        if graphed is None:
            return evaluate(model, make_batches(), precision, per_sample)
        return read_totals(graphed.replay())
