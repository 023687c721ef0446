"""Global average pooling whose gradient keeps the input's memory layout.

``flatten(adaptive_avg_pool2d(x, 1))`` on a channels-last ``x`` (every zoo model runs channels-last on the
CPU, ``run.channels_last``) has a backward that returns the gradient in the *contiguous* (NCHW) layout: the
gradient reaching the pooling is a ``(N, C)`` view, which PyTorch reads as NCHW. The ReLU before the pooling
then computes its backward from an NCHW gradient and a channels-last saved output, and an elementwise kernel
over two layouts gathers across memory: on fd-mnist's FedICT client, ``(32, 64, 28, 28)`` bf16 on one thread,
8.5 ms for that one ReLU backward against 0.31 ms when both are channels-last (benchmarks/RESULTS.md, "The
pooling's gradient layout"), a sixth of the client's training step.

:func:`global_average_pool` computes the same forward (``adaptive_avg_pool2d`` itself) and the same gradient
values, ``grad / (H·W)`` broadcast over the pooled positions: PyTorch's CPU kernel divides once by the
window's size (checked in tests/test_pooling.py against the native backward, fp32 and bf16, both layouts), so
only the gradient's layout changes, and with it nothing downstream (the ReLU's backward already returned a
channels-last result). Every model is therefore trained bit for bit as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _GlobalAveragePool(torch.autograd.Function):
    """``(N, C, H, W) -> (N, C)`` mean over the spatial positions; backward in the input's layout."""

    generate_vmap_rule = True  # forward and backward are plain torch ops (FedCurv's per-sample vmap)

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        (x,) = inputs
        ctx.input_shape = x.shape
        try:
            channels_last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        except RuntimeError:  # under vmap (FedCurv's per-sample gradients) a layout cannot be asked for
            channels_last = False
        ctx.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        height, width = ctx.input_shape[-2:]
        # One division by the window's size, as aten's adaptive average pooling backward does.
        spread = (grad / (height * width))[..., None, None].expand(ctx.input_shape)
        return spread.contiguous(memory_format=ctx.memory_format)  # out of place: vmap can batch it


def global_average_pool(x: torch.Tensor) -> torch.Tensor:
    """``flatten(adaptive_avg_pool2d(x, 1), 1)``, the same numbers, with the gradient in ``x``'s layout."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
    return _GlobalAveragePool.apply(x)


class GlobalAveragePool(nn.Module):
    """Module form of :func:`global_average_pool` (``AdaptiveAvgPool2d(1)`` followed by ``Flatten(1)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return global_average_pool(x)
