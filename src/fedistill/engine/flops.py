"""Counting a round's floating-point operations (the bench's "GFLOP per round" and "% of peak").

``torch.utils.flop_counter.FlopCounterMode`` counts the operations it has formulas for (matmul, convolution,
attention: the bulk of the work). The bench counts round 1 of a cell's first seed: inside the run itself where
it can (:attr:`fedistill.engine.loop.RoundLoop.count_first_round`, so that no second copy of the round runs
only to be counted), else on a one-round copy of the run (``fedistill.studies.bench.count_round_flops``). The
"% of peak" divides by this machine's bf16 matmul rate, measured here (:func:`measure_bf16_peak`) and kept at its
best per output directory (:func:`best_bf16_peak`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..fileio import atomic_write

# The metric row's mark on a round that ran under the counter: its seconds include the counter's per-operator
# Python overhead, so per-round seconds (the bench's and reproduce's "s/round") leave that round out.
FLOPS_COUNTED_KEY = "flops_counted"


class _TotalOnly:
    """Stands in for FlopCounterMode's module tracker, whose backward hooks make ``torch.autograd.grad`` on a
    leaf fail ("A leaf node was passed to _will_engine_execute_node ...": DaFKD's gradient penalty); the
    bench needs only the total, which the counter files under "Global"."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def counted_flops(work: Callable[[], Any]) -> int:
    """The floating-point operations ``work()`` runs, as torch.utils.flop_counter counts them (no per-module
    breakdown, so that autograd.grad inside ``work`` is counted too)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _TotalOnly()
    with counter:
        work()
    return int(counter.get_total_flops())


def peak_matmul_size(probe_gflops: float, size: int = 2048, slow_seconds: float = 1.0, step_seconds: float = 0.1) -> int:
    """The side of the square matmuls that measure the peak: ``size`` wherever one of them takes at most
    ``slow_seconds`` at the probe's rate (every CPU with bf16 in hardware: about 200 GFLOP/s a thread, 0.09 s),
    else the side whose matmul takes ``step_seconds`` (at least 256). A CPU without bf16 in hardware (an
    AVX2-only AMD EPYC host measured 0.9 GFLOP/s) would otherwise spend about 20 s on each 2048-square matmul."""
    if 2 * size**3 / (probe_gflops * 1e9) <= slow_seconds:
        return size
    return max(256, min(size, int((probe_gflops * 1e9 * step_seconds / 2) ** (1 / 3))))


def _probe_rate(dtype: Any, side: int = 256, repeats: int = 3) -> float:
    """GFLOP/s of the fastest of ``repeats`` ``side``-square matmuls in ``dtype`` (after one to warm up)."""
    import torch

    a = torch.randn(side, side, dtype=dtype)
    torch.mm(a, a)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - start)
    return 2 * side**3 / max(best, 1e-9) / 1e9


def measure_bf16_peak(threads: int, size: int = 2048, seconds: float = 1.0) -> float | None:
    """This machine's bf16 matmul rate in GFLOP/s on ``threads`` threads (square matmuls, best of a second; their
    side from a 256-square probe, :func:`peak_matmul_size`), or None where bf16 is not in the hardware: its probe
    slower than an fp32 one (an AVX2-only AMD EPYC: 1.2 against 44 GFLOP/s). A "% of bf16 peak" against an
    emulated rate would read several hundred percent for cells that train in fp32."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        probe_rate = _probe_rate(torch.bfloat16)
        if probe_rate < _probe_rate(torch.float32):
            return None
        size = peak_matmul_size(probe_rate, size)
        a = torch.randn(size, size, dtype=torch.bfloat16)
        b = torch.randn(size, size, dtype=torch.bfloat16)
        torch.mm(a, b)  # warm-up
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * size**3 / (time.perf_counter() - start) / 1e9)
        return best
    finally:
        torch.set_num_threads(previous)


PEAK_FILE = "bf16_peak.json"


def best_bf16_peak(root: Path, measured: float | None, threads: int = 1) -> float | None:
    """The highest bf16 matmul rate on ``threads`` threads that any bench of this output directory measured,
    ``measured`` included (kept in ``root/bf16_peak.json``, one entry per thread count). A peak is a best case:
    one measured while other work held the cores (a later bench that re-ran a few cells beside other jobs read
    82 GFLOP/s where the idle machine gave 181) would inflate every cell's "% of peak", so a lower reading never
    replaces a higher one. (Files written before the per-thread-count entries held one all-core reading: it is
    not a one-thread peak and is not read.)"""
    path = Path(root) / PEAK_FILE
    try:
        stored = json.loads(path.read_text())
        by_threads = {str(k): float(v) for k, v in stored.get("by_threads", {}).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        by_threads = {}  # none yet (or unreadable: the fresh measurement stands)
    if measured is None:  # no bf16 in this machine's hardware: an earlier bench's reading, if any, stands
        return by_threads.get(str(threads))
    best = max(by_threads.get(str(threads), 0.0), measured)
    by_threads[str(threads)] = best
    atomic_write(path, json.dumps({"by_threads": by_threads, "last_measured": {"threads": threads, "gflops_per_s": measured}}))
    return best
