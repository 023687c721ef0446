"""Process-level settings: the CPU allocator (below) and, on CUDA, deterministic cuDNN kernels.

glibc returns large freed blocks (over the dynamic mmap threshold) to the operating system, so every
training step re-maps and re-zeroes its activation buffers: with the FedLMD CNN in fp32 that was about
3,000-4,500 minor page faults per step and a third of the step time (benchmarks/RESULTS.md). Raising the
mmap and trim thresholds keeps freed memory in the heap for reuse. This changes only when memory goes back
to the OS (resident memory stays at its peak), never any result.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied = False


def keep_freed_memory_in_heap(threshold_bytes: int = 1 << 28) -> bool:
    """Ask glibc's malloc to reuse freed blocks below ``threshold_bytes``; False where not glibc."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc without mallopt: nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1 and mallopt(_M_TRIM_THRESHOLD, 4 * threshold_bytes) == 1
    _applied = ok
    return ok


def deterministic_kernels(device: torch.device) -> None:
    """On CUDA, make cuDNN pick the same convolution algorithms every run.

    By default cuDNN may time several algorithms per shape and keep the fastest (``benchmark``), and some of its
    backward algorithms accumulate with atomics: either makes two runs of one configuration differ, and a
    resumed run differ from an uninterrupted one. The deterministic algorithms keep fedistill's guarantee
    (seeded per (seed, round, client), resume exact) on a GPU, at some speed. CPU and MPS: nothing to do.
    """
    import torch

    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        # cuDNN's flag is not enough (issue 29 on an H200: FedAvg, FedFTG and FedICT resumed bit for bit, DaFKD's
        # GAN rounds did not, off in the 4th decimal): ops outside cuDNN (scatter/index adds in backward passes,
        # cuBLAS's split reductions) pick atomics too. Ask for the deterministic variants everywhere; warn_only
        # so that an op without one warns instead of stopping the run. cuBLAS reads its workspace setting
        # when it starts, so it is set before the first matrix product (an existing setting is kept).
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Deterministic mode also fills every new tensor's memory with NaN (fill_uninitialized_memory), one kernel
        # launch per allocation: 18-21 thousand fill_ launches in a FedAvg round of the MNIST protocol on an H100,
        # about 43 a training step (benchmarks/RESULTS.md "The GPU path"). It only exposes code that reads memory
        # before writing it; the numbers of a run that does not are the same without it.
        torch.utils.deterministic.fill_uninitialized_memory = False
