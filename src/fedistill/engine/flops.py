"""Counting a round's floating-point operations (the bench's "GFLOP per round" and "% of peak").

``torch.utils.flop_counter.FlopCounterMode`` counts the operations it has formulas for (matmul, convolution,
attention: the bulk of the work). The bench counts round 1 of a cell's first seed: inside the run itself where
it can (:attr:`fedistill.engine.loop.RoundLoop.count_first_round`, so that no second copy of the round runs
only to be counted), else on a one-round copy of the run (``fedistill.studies.bench.count_round_flops``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
