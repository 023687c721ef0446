"""Checkpoints: everything needed to continue a run to exactly the numbers of an uninterrupted one.

Because every random stream is derived from (seed, round, client) (see :mod:`.seeding`), no RNG state
has to be stored: the global model (full state dict), the server's and every client's persistent state,
and the metrics so far are enough. Files are written to a temporary name and renamed, so a crash while
saving never leaves a half-written checkpoint in place of the last good one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

FORMAT_VERSION = 1
CHECKPOINT_NAME = "checkpoint.pt"

# Keys that may differ between the checkpointed run and its continuation.
RESUMABLE_DIFFERENCES = {"rounds", "run"}


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format_version": FORMAT_VERSION, **payload}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"--resume: no checkpoint at {path}; run without --resume to start this run")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file: say which and why
        raise ConfigError(f"--resume: checkpoint {path} cannot be read ({exc.__class__.__name__}: {exc})") from None
    if payload.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"--resume: checkpoint {path} has format {payload.get('format_version')}, expected {FORMAT_VERSION}")
    return payload


def check_compatible(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """A resumed run must have the checkpointed configuration, except for ``rounds`` and ``run.*``."""
    for key in sorted(set(saved) | set(current)):
        if key in RESUMABLE_DIFFERENCES:
            continue
        if saved.get(key) != current.get(key):
            raise ConfigError(
                f"--resume: {key} differs from the checkpointed run ({saved.get(key)!r} vs {current.get(key)!r}); "
                "only rounds and run.* may change when resuming"
            )
