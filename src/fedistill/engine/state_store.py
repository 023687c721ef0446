"""Where the simulation keeps its clients' persistent state (control variates, previous models, ...).

In a real deployment every client keeps its own state; the in-process simulation keeps it on the clients'
behalf. With many clients that state is the largest thing in the run (MOON keeps a whole model per client:
6.6 MB for the MNIST CNN, so 660 MB at K=100 and 6.6 GB at K=1000), so it can live on disk:

* :class:`MemoryStateStore`: a dict of states; a checkpoint stores them all.
* :class:`DiskStateStore`: one file per client under ``<run dir>/client_states``; memory holds only the
  states of the clients training this round, and a checkpoint stores only which file version each client
  is at. Files are written under a new name and never modified, so the version a checkpoint refers to is
  still there if the run crashes later; at most two versions per client exist (the checkpointed one and the
  newest), and resuming deletes versions written after the checkpoint.

Both give identical numbers (tested), so the choice is about memory only (``run.client_state``).

``run.client_state_dtype: bf16`` halves what either store holds: every float32 tensor of a state is rounded
to bfloat16 when it is saved and widened back to float32 when it is loaded (SCAFFOLD's c_k of the MNIST CNN:
6.65 MB -> 3.33 MB per client). The rounding happens in :meth:`save`, before anything is written or kept,
so an uninterrupted run and a resumed one see the same rounded values and stay equal; it does change the
numbers against fp32 (benchmarks/RESULTS.md measures by how much), so a resume may not switch it.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..fileio import atomic_open, is_temporary

STATE_DIR_NAME = "client_states"
_FILE = re.compile(r"^client-(\d+)\.r(\d+)\.pt$")
_LEGACY_TEMPORARY = re.compile(r"^client-\d+\.r\d+\.pt\.tmp$")  # the fixed temporary name before fileio
STATE_DTYPES = ("fp32", "bf16")
# Names of the entries a bf16 store rounded, kept inside the stored state so that load widens exactly
# those (a tensor an algorithm keeps in bf16 itself stays bf16).
_ROUNDED_KEY = "__rounded_to_bf16__"


def _check_dtype(dtype: str) -> str:
    if dtype not in STATE_DTYPES:
        from ..errors import ConfigError

        raise ConfigError(f"run.client_state_dtype: {dtype!r} is not one of {', '.join(STATE_DTYPES)}")
    return dtype


def as_stored(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    """``tensor`` as a store of ``dtype`` will give it back after a save and a load (float32 through bfloat16
    for bf16; anything else unchanged). A client that uploads the change of a state entry the server sums
    (SCAFFOLD's ``c_k``, FedCurv's ``u_k``) computes that change from this value, so that the server's sum
    stays the sum of what the clients keep."""
    if dtype == "bf16" and tensor.dtype == torch.float32:
        return _narrow(tensor).float()
    return tensor


def _narrow(tensor: torch.Tensor) -> torch.Tensor:
    """The bf16 store's one rounding (to nearest even), shared by :func:`pack_state` and :func:`as_stored`."""
    return tensor.to(torch.bfloat16)


def pack_state(state: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The state as a store keeps it: unchanged for fp32; for bf16 a new dict whose float32 tensors are
    rounded to bfloat16 (round to nearest even), with the names of the rounded entries recorded."""
    if dtype == "fp32" or not state:
        return state
    rounded = [key for key, value in state.items() if isinstance(value, torch.Tensor) and value.dtype == torch.float32]
    if not rounded:
        return state
    packed = dict(state)
    for key in rounded:
        packed[key] = _narrow(state[key])
    packed[_ROUNDED_KEY] = rounded
    return packed


def unpack_state(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored state as the algorithm gets it: the entries :func:`pack_state` rounded widened to float32
    (exactly: every bfloat16 value is a float32 value), in a new dict."""
    rounded = stored.get(_ROUNDED_KEY) if isinstance(stored, dict) else None
    if rounded is None:
        return stored
    state = {key: value for key, value in stored.items() if key != _ROUNDED_KEY}
    for key in rounded:
        state[key] = state[key].float()
    return state


class MemoryStateStore(Mapping[int, dict[str, Any]]):
    """Every client's state in a dict (fast; memory grows with the number of clients that have state)."""

    kind = "memory"

    def __init__(self, dtype: str = "fp32") -> None:
        self.dtype = _check_dtype(dtype)
        self._states: dict[int, dict[str, Any]] = {}

    def __getitem__(self, cid: int) -> dict[str, Any]:
        return unpack_state(self._states[cid])

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._states))

    def __len__(self) -> int:
        return len(self._states)

    def load(self, cid: int) -> dict[str, Any]:
        """The client's state to hand to its update ({} before its first round)."""
        return unpack_state(self._states.get(cid, {}))

    def save(self, cid: int, state: dict[str, Any], rnd: int) -> None:
        if state or cid in self._states:
            self._states[cid] = pack_state(state, self.dtype)

    def snapshot(self) -> dict[str, Any]:
        return {"kind": self.kind, "states": self._states}

    def restore(self, payload: dict[str, Any], run_dir: Path | None) -> None:
        # Kept in this store's form (a disk checkpoint's states arrive widened to float32).
        self._states = {cid: pack_state(unpack_state(state), self.dtype) for cid, state in client_states_of(payload, run_dir).items()}

    def committed(self) -> None:
        """Called after a checkpoint is safely written (nothing to clean up in memory)."""


class DiskStateStore(Mapping[int, dict[str, Any]]):
    """Every client's state in its own file; only an index (client -> version) in memory."""

    kind = "disk"

    def __init__(self, root: Path | None, dtype: str = "fp32") -> None:
        self.dtype = _check_dtype(dtype)
        if root is None:  # no run directory: a private temp dir, removed when the store is garbage-collected
            self.root = Path(tempfile.mkdtemp(prefix="fedistill-states-"))
            weakref.finalize(self, shutil.rmtree, str(self.root), True)
        else:
            self.root = Path(root)  # created by the first save: stateless runs leave no empty folder
        self._current: dict[int, int] = {}  # client -> round of its newest file
        self._checkpointed: dict[int, int] = {}  # client -> round of the file the last checkpoint refers to

    def _path(self, cid: int, rnd: int) -> Path:
        return self.root / f"client-{cid:06d}.r{rnd:06d}.pt"

    def __getitem__(self, cid: int) -> dict[str, Any]:
        if cid not in self._current:
            raise KeyError(cid)
        return self.load(cid)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._current))

    def __len__(self) -> int:
        return len(self._current)

    def load(self, cid: int) -> dict[str, Any]:
        rnd = self._current.get(cid)
        if rnd is None:
            return {}
        from .checkpoint import load_tensor_file

        return unpack_state(load_tensor_file(self._path(cid, rnd), f"client {cid}'s state file"))

    def save(self, cid: int, state: dict[str, Any], rnd: int) -> None:
        if not state and cid not in self._current:
            return  # stateless methods (FedAvg) never touch the disk
        self.root.mkdir(parents=True, exist_ok=True)
        with atomic_open(self._path(cid, rnd)) as f:
            torch.save(pack_state(state, self.dtype), f)
        previous = self._current.get(cid)
        self._current[cid] = rnd
        # The previous version goes unless the last checkpoint still refers to it.
        if previous is not None and previous != rnd and previous != self._checkpointed.get(cid):
            self._path(cid, previous).unlink(missing_ok=True)

    def snapshot(self) -> dict[str, Any]:
        return {"kind": self.kind, "index": dict(self._current)}

    def committed(self) -> None:
        for cid, rnd in self._checkpointed.items():
            if self._current.get(cid) != rnd:
                self._path(cid, rnd).unlink(missing_ok=True)
        self._checkpointed = dict(self._current)

    def restore(self, payload: dict[str, Any], run_dir: Path | None) -> None:
        if payload.get("kind") == self.kind:
            self._current = {int(c): int(r) for c, r in payload["index"].items()}
            missing = [c for c, r in self._current.items() if not self._path(c, r).is_file()]
            if missing:
                from ..errors import ConfigError

                raise ConfigError(
                    f"resume: the checkpoint refers to client state files that are missing from {self.root} "
                    f"(clients {missing[:5]}{'...' if len(missing) > 5 else ''}); the run directory is incomplete"
                )
        else:  # the checkpoint kept states in memory: write them out
            self._current = {}
            for cid, state in client_states_of(payload, run_dir).items():
                self.save(cid, state, 0)
        self._checkpointed = dict(self._current)
        # Versions written after the checkpoint belong to rounds that will be run again; a temporary file is
        # a save the previous attempt was killed in (named ``<file>.tmp`` by earlier versions of fedistill).
        for path in self.root.iterdir() if self.root.is_dir() else []:
            match = _FILE.match(path.name)
            stale = match is not None and self._current.get(int(match[1])) != int(match[2])
            if stale or is_temporary(path.name) or _LEGACY_TEMPORARY.match(path.name):
                path.unlink()


def client_states_of(payload: dict[str, Any], run_dir: Path | None) -> dict[int, dict[str, Any]]:
    """All client states a checkpoint's ``client_store`` payload refers to, read into memory as the algorithm gets
    them (unpacked: see :func:`unpack_state`); ``run_dir`` is the run directory whose state files a disk store's
    payload names. Also for reading a finished run's clients (benchmarks/diagnose_fedproto_members.py)."""
    if payload.get("kind") == "memory":
        return {cid: unpack_state(state) for cid, state in payload["states"].items()}
    disk = DiskStateStore(run_dir / STATE_DIR_NAME if run_dir else None)
    disk._current = {int(c): int(r) for c, r in payload["index"].items()}
    return {cid: disk.load(cid) for cid in disk}


def make_state_store(kind: str, run_dir: Path | None, dtype: str = "fp32") -> MemoryStateStore | DiskStateStore:
    """``run.client_state``: memory, disk, or auto (disk when the run has a directory to put it in);
    ``dtype`` is ``run.client_state_dtype`` (fp32, or bf16 to halve the bytes per state)."""
    if kind == "memory" or (kind == "auto" and run_dir is None):
        return MemoryStateStore(dtype)
    return DiskStateStore(run_dir / STATE_DIR_NAME if run_dir is not None else None, dtype)
