"""SIGTERM raised where it is safe: never inside the worker pool's own bookkeeping.

cli.py turns SIGTERM into an exception raised in the main thread (the Ctrl-C path: the round is abandoned, the
run can resume). Raised at an arbitrary bytecode, that exception can land inside concurrent.futures' submit,
which holds the pool's lock and writes to its wake-up pipe; left half-done, the pool's later shutdown can wait
forever (seen once: a SIGTERM'd two-worker run that had not exited two minutes later). Code that must not be
cut in the middle runs under ``uninterrupted()``; a termination that arrives there is held and raised when the
block ends.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

_depth = 0
_held: BaseException | None = None


def raise_or_hold(exc: BaseException) -> None:
    """Raise ``exc`` now (called from a signal handler), or hold it while an ``uninterrupted()`` block runs."""
    global _held
    if _depth:
        _held = exc
        return
    raise exc


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold terminations for the duration of the block; one that arrived meanwhile is raised at its end."""
    global _depth, _held
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _held is not None:
            exc, _held = _held, None
            raise exc
