"""Cohort training (issue 66): K clients of one architecture trained together, one batched step per step index.

The sequential path (``algorithms/local.py`` ``local_sgd``) trains a round's clients one after another, each step
a batch of a few dozen small images: on a GPU thousands of tiny launches. Here the K clients' weights are one
``(K, P)`` tensor (each row a client's flat vector, :mod:`fedistill.models.flat` order) and step s of every client
is one call: ``torch.func.vmap`` over the clients of ``grad`` of the loss of ``functional_call(model, client k's
weights, client k's batch s)``, then each client's SGD update on its own row. The math is the sequential step's
(``engine/cuda_graphs.eager_sgd_step``: mean cross-entropy on the batch plus a pure loss term, backward, SGD with
momentum ρ, dampening 0 and weight decay λ: ``g = ∇ + λ·w; b = ρ·b + g; w −= lr·b`` from a zero buffer, which is
PyTorch's first step ``b = g`` exactly), with what differs between the clients masked:

* **different numbers of steps**: at a step index past a client's last batch the client is *inactive*: its row,
  its momentum buffer and its loss sum do not change (a padded slot, counted in ``padded_slots``);
* **different batch sizes** (a client's last, partial batch): the batch is padded with zero rows of weight 0,
  and the loss is ``Σ_i w_i CE_i / Σ_i w_i``, the mean over the real rows (the sequential step's value up to the
  order of a float sum).

A loss term batches when it is a pure function of (the client's weights, its batch, its logits, fixed per-client
tensors): ``extra_loss(params, x, y, logits, mask, fixed)`` with ``fixed`` a dict of ``(K, ...)`` tensors, one row
per client (FedProx's global weights, FedLMD's majority classes), its batch means weighted by ``mask``; a term
marked :func:`with_teacher` also gets the logits of the round's global model on the batch; one with ``needs_features``
gets the client's features (``fixed["features"]``, the step then runs ``extract`` and ``classify`` as local_sgd's
``with_features`` does) and, for each key in its ``frozen_features``, the features of the weights ``fixed[key]``
(``fixed[key + ".features"]``, no gradient: MOON's global and previous models). A gradient correction
that adds a constant per client (SCAFFOLD's ``c − c_k``) is ``fixed["gradient_offset"]``, added to the gradient
before weight decay as its ``grad_correction`` adds it to ``.grad`` before the optimiser's step; a logit transform
that scales each class (FedRS's restricted softmax) is ``fixed["logit_scale"]``, applied to the logits the CE sees. A model with BatchNorm statistics does not: its
running statistics would see the padded rows, so such a model is refused (``ValueError``) and trains sequentially.

The same math up to the order of float sums (the global model within 5e-8 to 1e-6 in relative norm over three
rounds of digits at lr 0.02, tests/test_cohort.py); a trajectory that meets a knife edge within that rounding (a
unit's pre-activation at 0, a max-pooling tie) parts further, as two sequential runs with reordered sums would
(FedAvg+LS at lr 0.05: 6e-8 became 1.8e-5 in one step; FedNova's round 3 at 0.02: 4e-8 to 4e-5).

On the CPU the batched step does not pay (issue 66: 0.62x in fp32 for 10 stacked MNIST CNN clients on one thread),
so the CPU path keeps its sequential default; this module is the GPU lever, tested for equality on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

Batch = tuple[torch.Tensor, torch.Tensor]
GRADIENT_OFFSET = "gradient_offset"  # fixed[...] (K, P): a constant added to each client's gradient (SCAFFOLD)
LOGIT_SCALE = "logit_scale"  # fixed[...] (K, C): per-class factors of the logits the client's CE sees (FedRS's s_k)
# extra_loss(params, x, y, logits, row_mask, fixed) -> scalar: a pure loss term for one client (vmapped over them)
CohortLoss = Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class CohortResult:
    weights: torch.Tensor  # (K, P) the clients' trained flat weights
    loss_sum: torch.Tensor  # (K,) float64: Σ over a client's steps of its batch's mean loss × its batch size
    steps: torch.Tensor  # (K,) int64 steps each client took
    samples_seen: torch.Tensor  # (K,) int64
    padded_slots: int  # Σ_k (steps of the longest client − steps_k): the slots spent masked


def flat_layout(model: nn.Module) -> list[tuple[str, slice, torch.Size]]:
    """Where each parameter sits in the model's flat vector (``float_state`` order), refusing float buffers
    (BatchNorm statistics: their update in train mode would see the padded rows)."""
    layout, offset = [], 0
    parameters = dict(model.named_parameters())
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point():
            continue
        if name not in parameters:
            raise ValueError(f"cohort training: {type(model).__name__} has the floating-point buffer {name!r} (BatchNorm "
                             "statistics?), which a padded batched step would update wrongly; it trains sequentially")  # fmt: skip
        layout.append((name, slice(offset, offset + tensor.numel()), tensor.shape))
        offset += tensor.numel()
    return layout


def stack_batches(client_batches: Sequence[Sequence[Batch]], slot: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Step ``slot`` of every client as ``(x (K, B, ...), y (K, B), row mask (K, B), active (K,))``, B the largest
    batch of the slot; a client past its last batch is inactive with an all-zero mask."""
    present = [batches[slot] if slot < len(batches) else None for batches in client_batches]
    template = next(b for b in present if b is not None)
    width = max(int(b[1].shape[0]) for b in present if b is not None)
    xs, ys, masks = [], [], []
    for batch in present:
        n = 0 if batch is None else int(batch[1].shape[0])
        x = torch.zeros((width, *template[0].shape[1:]), dtype=template[0].dtype, device=device)
        y = torch.zeros(width, dtype=template[1].dtype, device=device)
        if n:
            x[:n], y[:n] = batch[0], batch[1]
        mask = torch.zeros(width, device=device)
        mask[:n] = 1.0
        xs.append(x), ys.append(y), masks.append(mask)
    active = torch.tensor([b is not None for b in present], device=device)
    return torch.stack(xs), torch.stack(ys), torch.stack(masks), active


def cohort_sgd(
    model: nn.Module,
    weights: torch.Tensor,
    client_batches: Sequence[Sequence[Batch]],
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    precision: str = "fp32",
    extra_loss: CohortLoss | None = None,
    fixed: Mapping[str, torch.Tensor] | None = None,
) -> CohortResult:
    """Train K clients of ``model``'s architecture from ``weights`` (K, P), client k on ``client_batches[k]`` (its
    batches in order, every epoch's), as K sequential ``local_sgd`` runs would (module docstring). ``model`` is a
    template: its own weights are not read or changed."""
    layout = flat_layout(model)
    k = weights.shape[0]
    if len(client_batches) != k:
        raise ValueError(f"cohort training: {k} weight rows but {len(client_batches)} clients' batches")
    device = weights.device
    fixed = dict(fixed or {})
    params = {name: weights[:, where].reshape(k, *shape).clone() for name, where, shape in layout}
    buffers = {name: torch.zeros_like(p) for name, p in params.items()}
    loss_sum = torch.zeros(k, dtype=torch.float64, device=device)
    steps = torch.tensor([len(b) for b in client_batches], dtype=torch.int64)
    seen = torch.tensor([sum(int(y.shape[0]) for _, y in b) for b in client_batches], dtype=torch.int64)
    longest = int(steps.max()) if k else 0

    def unflatten(flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[where].reshape(shape) for name, where, shape in layout}

    extract, classify = _Method(model, "extract"), _Method(model, "classify")
    prefixed = lambda p: {f"model.{name}": v for name, v in p.items()}  # noqa: E731  (the wrappers' parameter names)

    def client_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            if getattr(extra_loss, "needs_features", False):  # as local_sgd's with_features: extract, then classify
                features = functional_call(extract, prefixed(p), (x,))
                logits = functional_call(classify, prefixed(p), (features,))
                extra = {**extra, "features": features}
            else:
                logits = functional_call(model, p, (x,))
            if getattr(extra_loss, "needs_teacher", False):  # the round's global model on the same batch, a constant
                with torch.no_grad():
                    extra = {**extra, "teacher_logits": functional_call(model, unflatten(extra["teacher"]), (x,)).detach()}
            for key in getattr(extra_loss, "frozen_features", ()):  # features of fixed weights (MOON's global, previous)
                with torch.no_grad():
                    extra = {**extra, f"{key}.features": functional_call(extract, prefixed(unflatten(extra[key])), (x,)).detach()}
        ce_logits = logits.float() * extra[LOGIT_SCALE] if LOGIT_SCALE in extra else logits.float()  # FedRS's s_k
        rows = F.cross_entropy(ce_logits, y, reduction="none")
        loss = (rows * mask).sum() / mask.sum().clamp_min(1.0)  # the mean over the real rows; 0 for an inactive client
        if extra_loss is not None:
            loss = loss + extra_loss(p, x, y, logits, mask, extra) * (mask.sum() > 0)
        return loss

    # SCAFFOLD's c − c_k: added to each client's gradient before weight decay (its grad_correction), not a loss term
    offset = fixed.pop(GRADIENT_OFFSET, None)
    offsets = {name: offset[:, where].reshape(k, *shape) for name, where, shape in layout} if offset is not None else {}
    step = vmap(grad_and_value(client_loss))
    for slot in range(longest):
        x, y, mask, active = stack_batches(client_batches, slot, device)
        grads, losses = step(params, x, y, mask, fixed)
        gate = active.to(weights.dtype)
        with torch.no_grad():
            for name, p in params.items():
                shape = (k,) + (1,) * (p.dim() - 1)
                g = grads[name] + offsets[name] if offsets else grads[name]
                g = g + weight_decay * p if weight_decay else g
                if momentum:
                    b = buffers[name]
                    b.copy_(torch.where(active.view(shape), momentum * b + g, b))
                    g = b
                p.sub_(lr * g * gate.view(shape))
            loss_sum += losses.detach().double() * mask.sum(1).double()
    out = torch.cat([params[name].reshape(k, -1) for name, _, _ in layout], dim=1)
    padded = int((longest - steps).sum())
    return CohortResult(weights=out, loss_sum=loss_sum, steps=steps, samples_seen=seen, padded_slots=padded)


class _Method(nn.Module):
    """``model.<method>`` as a module's forward, so that ``functional_call`` can run it with a client's weights
    (their names prefixed ``model.``): the extractor and the head of a step that needs the features."""

    def __init__(self, model: nn.Module, method: str) -> None:
        super().__init__()
        self.model, self.method = model, method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.model, self.method)(x)


def with_teacher(term: CohortLoss) -> CohortLoss:
    """Mark a cohort term as reading ``fixed["teacher_logits"]``: the logits, on the client's batch, of the weights
    in its ``fixed["teacher"]`` row (the round's global model: FedNTD's, FedLMD's, FedAvg+KD's teacher), computed
    by the cohort step without gradient, as ``GlobalTeacher.logits`` computes them on the sequential path."""
    term.needs_teacher = True  # type: ignore[attr-defined]
    return term


def proximal_term(mu: float) -> CohortLoss:
    """FedProx's term ``(μ/2)·‖w − w_g‖²`` as a cohort loss (``fixed["global"]``: the round's global parameters per
    client, one ``(K, P_params)`` row each in the layout order): the same value as the sequential path's."""

    def term(params: dict[str, torch.Tensor], x: Any, y: Any, logits: Any, mask: Any, fixed: dict[str, torch.Tensor]) -> torch.Tensor:
        return 0.5 * mu * (params_vector(params) - fixed["global"]).pow(2).sum()

    return term


def params_vector(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """One client's parameters inside a cohort term as one vector, in the model's flat order (the order of
    ``trainable_parameters``, the models here having no buffers): what a term anchored on the received weights
    compares them with."""
    return torch.cat([p.reshape(-1) for p in params.values()])
