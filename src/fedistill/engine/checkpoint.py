"""Checkpoints: everything needed to continue a run to exactly the numbers of an uninterrupted one.

Because every random stream is derived from (seed, round, client) (see :mod:`.seeding`), no RNG state
has to be stored: the global model (full state dict), the server's and every client's persistent state,
and the metrics so far are enough. Files are written to a temporary name, synced and renamed
(:func:`fedistill.fileio.atomic_open`), so a crash while saving never leaves a half-written checkpoint in place
of the last good one.

A checkpoint holds only tensors and plain data (numbers, strings, None, lists, tuples, dicts), and is
read with ``torch.load(weights_only=True)``: a run directory can come from anywhere (a colleague, a shared
disk), and a pickled object in a tampered file must never run code on resume. Such a file is refused with
one line.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..fileio import atomic_open

FORMAT_VERSION = 1
CHECKPOINT_NAME = "checkpoint.pt"

# Keys that may differ between the checkpointed run and its continuation.
RESUMABLE_DIFFERENCES = {"rounds", "run"}
# Where the dataset files are, and whether they are fetched or md5-checked: not what the run computes (a
# moved data directory or a run directory from another machine must resume; different data is caught by the
# partition check and the files' checksums).
DATASET_FILE_SETTINGS = ("data_dir", "download", "verify")


def comparable_setting(key: str, value: Any) -> Any:
    """A top-level config entry as resume compares it: the dataset section without its file locations."""
    if key == "dataset" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in DATASET_FILE_SETTINGS}
    return value


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path) as f:
        torch.save({"format_version": FORMAT_VERSION, **payload}, f)


def load_tensor_file(path: Path, what: str) -> Any:
    """``torch.load`` of a file that must hold only tensors and plain data; one-line errors otherwise.

    ``what`` names the file in the message ("checkpoint", "client state file").
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        globals_ = [line for line in lines if "GLOBAL" in line or "Unsupported global" in line]
        if globals_:
            # weights_only refused a pickled object that is not a tensor or plain data: a tampered or foreign file.
            raise ConfigError(
                f"{what} {path} holds objects other than tensors and plain data and was not loaded "
                f"(it was not written by fedistill, or was tampered with: {globals_[0][:160]})"
            ) from None
        detail = next((line for line in lines if line.startswith("Unsupported")), lines[-1] if lines else "")
        raise ConfigError(f"{what} {path} cannot be read ({detail[:160]}); the file is damaged") from None
    except Exception as exc:  # truncated, empty or not a torch file at all
        raise ConfigError(
            f"{what} {path} cannot be read ({exc.__class__.__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else 'no detail'}); "
            "the file is damaged"
        ) from None


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"resume: no checkpoint at {path}")
    payload = load_tensor_file(path, "checkpoint")
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        version = payload.get("format_version") if isinstance(payload, dict) else None
        raise ConfigError(f"resume: checkpoint {path} has format {version}, expected {FORMAT_VERSION}")
    return payload


# Settings under ``run`` that change the numbers a run produces: a continuation with another value would
# not reproduce the uninterrupted run. (``client_state``, ``workers`` at equal threads per client,
# ``checkpoint_every``, ``progress``, ``out_dir``, ``name`` and ``tune_allocator`` do not.)
NUMERIC_RUN_SETTINGS = ("precision", "channels_last", "device", "client_threads", "client_state_dtype", "cuda_graphs", "cohort")


def check_compatible(
    saved: dict[str, Any],
    current: dict[str, Any],
    saved_numerics: dict[str, Any] | None = None,
    current_numerics: dict[str, Any] | None = None,
    allow_numeric_change: bool = False,
    hint: str = "",
) -> list[str]:
    """A resumed run must have the checkpointed configuration, except for ``rounds`` and ``run.*``.

    Among ``run.*``, the settings of :data:`NUMERIC_RUN_SETTINGS` change results: a change is refused
    unless ``allow_numeric_change``; the changes are returned (the caller records them in the run
    directory). ``hint`` says how to allow it where the message is shown (CLI flag or Flower run config).
    """
    for key in sorted(set(saved) | set(current)):
        if key in RESUMABLE_DIFFERENCES:
            continue
        if comparable_setting(key, saved.get(key)) != comparable_setting(key, current.get(key)):
            raise ConfigError(
                f"resume: {key} differs from the checkpointed run ({saved.get(key)!r} vs {current.get(key)!r}); "
                "only rounds and run settings that do not change results may change when resuming"
            )
    changes: list[str] = []
    if saved_numerics is not None and current_numerics is not None:
        for key in NUMERIC_RUN_SETTINGS:
            if saved_numerics.get(key) != current_numerics.get(key):
                changes.append(f"{key}: {saved_numerics.get(key)!r} -> {current_numerics.get(key)!r}")
    if changes and not allow_numeric_change:
        # Runs from before run.threads defaulted to 1 recorded every core (client_threads 2 on two cores).
        threads = saved_numerics.get("client_threads") if saved_numerics else None
        how = f" (--set run.threads={threads})" if any(c.startswith("client_threads") for c in changes) and threads else ""
        raise ConfigError(
            f"resume: {'; '.join(changes)} would change the numbers of the rest of this run, so it would no longer "
            f"equal an uninterrupted run; resume with the checkpointed settings{how}, or {hint or 'allow the change explicitly'}"
        )
    return changes
