"""Rounds during which the process was stopped (SIGSTOP, SIGTSTP: Ctrl-Z, a job scheduler's suspend).

A stopped process's wall clock runs on, so a round that spans a stop reports the stop's minutes as its own seconds,
and a cell's mean seconds per round (the bench's and reproduce's "s/round") would carry them: one 4-minute freeze
adds 9 s to every round of a 30-round cell's mean. When a stopped process continues, the kernel sends it SIGCONT;
the handler installed here notes the moment, and the server marks a row whose round began before that moment with
:data:`PAUSED_KEY`, which the per-round seconds leave out as they leave out the round run under the FLOP counter.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

# The metric row's mark on a round the process was stopped in: its seconds include the stop.
PAUSED_KEY = "paused"

_last_continued_at: float | None = None
_installed = False


def _note_continued(signum: int, frame: Any, previous: Any = None) -> None:
    global _last_continued_at
    _last_continued_at = time.perf_counter()
    if callable(previous):
        previous(signum, frame)


def install() -> bool:
    """Note every SIGCONT from now on (once per process; chains a handler already there). Returns whether the
    handler is in place: not on a platform without SIGCONT, nor from a thread other than the main one (Python
    installs signal handlers from the main thread only), where rows are simply never marked."""
    global _installed
    if _installed:
        return True
    if not hasattr(signal, "SIGCONT") or threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGCONT)
    chained = previous if callable(previous) else None
    signal.signal(signal.SIGCONT, lambda signum, frame: _note_continued(signum, frame, chained))
    _installed = True
    return True


def stopped_since(started: float) -> bool:
    """Whether the process was continued after a stop at some point after ``started`` (a ``time.perf_counter()``
    value): the handler runs when the main thread next executes Python, so a stop is seen by the round it fell in
    unless it ended in that round's last bytecodes."""
    return _last_continued_at is not None and _last_continued_at > started
