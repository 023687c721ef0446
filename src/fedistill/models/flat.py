"""Flat parameter vectors.

Clients never get a deep copy of the global model: one worker module per process is reused, and weights
travel as a single float32 vector holding every floating-point entry of the state dict (parameters and
BatchNorm running statistics, in ``state_dict`` order). Integer buffers (BatchNorm's
``num_batches_tracked``) are not part of the vector: averaging a counter is meaningless (fedavg.md §3).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
from torch import nn


def float_state(model: nn.Module) -> list[torch.Tensor]:
    """The floating-point tensors of ``model.state_dict()``, in order (live references, not copies)."""
    return [t for t in model.state_dict(keep_vars=True).values() if t.is_floating_point()]


def num_flat(model: nn.Module) -> int:
    return sum(t.numel() for t in float_state(model))


# Whether flat vectors stay where their model lives (``run.resident_weights``, issue 66 item 3): set by the
# in-process round loop around a round, so that the broadcast, the uploads and the server's vectors are device
# tensors and the Message boundary makes no host copy. A Message that leaves the process (Flower) or a checkpoint
# makes its own host copy; outside the round loop every vector is on the host, as before.
_RESIDENT: ContextVar[bool] = ContextVar("fedistill_resident_weights", default=False)


@contextmanager
def weights_resident(enabled: bool = True) -> Iterator[None]:
    """Within this block :func:`get_flat` and :func:`flat_parameters` leave their vectors on the model's device
    (no device-to-host copy and no wait); with ``enabled`` False, a no-op."""
    token = _RESIDENT.set(enabled or _RESIDENT.get())
    try:
        yield
    finally:
        _RESIDENT.reset(token)


def resident() -> bool:
    """Whether flat vectors stay on their model's device here (:func:`weights_resident`)."""
    return _RESIDENT.get()


def mean_loss_of(loss_sum: torch.Tensor, seen: int) -> float | torch.Tensor:
    """``loss_sum / seen`` as the client reports it: a float (a wait for the device, per client), or, where the
    round keeps weights resident (run.resident_weights), the 0-d tensor itself, so that the GPU's queue is not
    emptied between clients; the server reads it once the round's clients are all queued (reported_train_loss),
    the same number. NaN when the client saw no sample."""
    if not seen:
        return float("nan")
    mean = loss_sum / seen
    return mean if resident() else float(mean)


@torch.no_grad()
def get_flat(model: nn.Module, host: bool | None = None) -> torch.Tensor:
    """A new float32 vector with the model's floating-point state, on the CPU; ``host=False``: where the model
    lives, with no device-to-host copy (a cohort's stacked weights on a GPU, engine/cohort.py). Unset ``host``
    is the host unless the round keeps weights resident on the device (:func:`weights_resident`)."""
    # Concatenated where the model lives, then copied once: one device-to-host wait per model, not per tensor.
    flat = torch.cat([t.detach().reshape(-1).float() for t in float_state(model)])
    keep = resident() if host is None else not host
    return flat if keep else flat.cpu()


@torch.no_grad()
def set_flat(model: nn.Module, vector: torch.Tensor) -> None:
    """Copy ``vector`` into the model's floating-point state in place (keeps memory formats)."""
    tensors = float_state(model)
    expected = sum(t.numel() for t in tensors)
    if vector.dim() != 1 or vector.numel() != expected:
        raise ValueError(f"flat vector has {vector.numel()} entries, the model needs {expected}")
    if tensors:  # one host-to-device copy of the whole vector, not one (synchronising) copy per tensor
        vector = vector.to(tensors[0].device)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(vector[offset : offset + n].view(t.shape))
        offset += n


def trainable_mask(model: nn.Module) -> torch.Tensor:
    """True for the entries of the flat vector that are trainable parameters (not BatchNorm statistics)."""
    params = {id(p) for p in model.parameters() if p.requires_grad}
    return torch.cat([torch.full((t.numel(),), id(t) in params, dtype=torch.bool) for t in float_state(model)])


def batchnorm_mask(model: nn.Module, statistics: bool = False) -> torch.Tensor:
    """True for the entries of the flat vector that are BatchNorm affine parameters (γ, β), and with
    ``statistics`` also their running mean and variance."""
    names = ("weight", "bias", "running_mean", "running_var") if statistics else ("weight", "bias")
    chosen = {
        id(t)
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase)
        for t in (getattr(m, n, None) for n in names)
        if t is not None
    }
    return torch.cat([torch.full((t.numel(),), id(t) in chosen, dtype=torch.bool) for t in float_state(model)])


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """A new float32 vector of the trainable parameters in ``model.parameters()`` order (no buffers), on the CPU,
    or on the model's device where the round keeps weights resident (:func:`weights_resident`)."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in trainable_parameters(model)])
    return flat if resident() else flat.cpu()  # one copy, as get_flat


def split_like(vector: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """A flat vector over ``params`` (as from :func:`flat_parameters`) cut into views shaped like each tensor,
    on its device."""
    return [piece.view_as(p).to(p.device) for piece, p in zip(vector.split([p.numel() for p in params]), params)]


def add_to_gradients(params: list[torch.Tensor], vector: torch.Tensor, sign: float = 1.0):
    """A ``before_step`` hook adding ``sign · vector`` (flat over ``params``) to their ``.grad`` (SCAFFOLD's
    ``c − c_k``, FedNova's quirk shift); tensors without a gradient this step are left alone."""
    pieces = split_like(vector, params)

    def shift(model: nn.Module) -> None:
        for p, piece in zip(params, pieces):
            if p.grad is not None:
                p.grad.add_(piece, alpha=sign)

    return shift


@contextmanager
def running_statistics_kept(*models: nn.Module) -> Iterator[None]:
    """Run forwards in train mode (normalised with the batch's statistics, as the gradient should see them)
    without changing any buffer of ``models``: BatchNorm's running mean, variance and batch counter are put
    back on exit. For a step that must move one module only while its loss runs through others (DaFKD's
    generator step, card §7: "changes only θ_k^g")."""
    buffers = [b for m in models for b in m.buffers()]
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(buffers, saved):
                b.copy_(value)
