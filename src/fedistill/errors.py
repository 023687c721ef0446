"""User-facing errors.

Every error a user can cause (a bad config value, a missing or corrupt dataset file, an impossible
partition) is raised as a :class:`FedistillError` subclass whose message says what is wrong and how to
fix it. The CLI prints the message on one line and exits with code 2; it never shows a traceback for
these.
"""

from __future__ import annotations

import difflib
from typing import Iterable


class FedistillError(Exception):
    """Base class of errors caused by user input rather than by a bug."""


class ConfigError(FedistillError):
    """A configuration value is invalid (unknown name, out of range, inconsistent with another value)."""


class DatasetError(FedistillError):
    """A dataset file is missing, truncated, corrupt, or fails its checksum."""


class PartitionError(FedistillError):
    """The requested partition cannot be built (e.g. more clients than samples)."""


class TrainingDiverged(FedistillError):
    """The global model became non-finite; the run stops and keeps its last good checkpoint."""


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C or SIGTERM; ``hint`` says how to continue it (the run directory to resume)."""

    def __init__(self, hint: str) -> None:
        super().__init__(hint)
        self.hint = hint


def closest(key: str, valid: Iterable[object]) -> str:
    """`` (did you mean 'x'?)`` for a mistyped key, or ``""``."""
    match = difflib.get_close_matches(str(key), [str(v) for v in valid], n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""
