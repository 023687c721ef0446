"""Our :class:`~fedistill.algorithms.base.Message` <-> Flower's ``RecordDict``, exactly.

A fedistill Message is a flat mapping of names to tensors and plain scalars. On Flower it travels as a
``RecordDict`` with three records:

- ``"fedistill.tensors"``: an ``ArrayRecord`` with one ``Array`` per tensor. The bytes are the tensor's raw
  little-endian memory (``stype = "fedistill.torch"``, ``dtype = "torch.float32"`` ...), so every dtype
  PyTorch has (bfloat16 and bool included) crosses unchanged, bit for bit;
- ``"fedistill.scalars"``: a ``ConfigRecord`` with the ints, floats, bools and strings (Flower keeps the
  four types apart: a bool stays a bool, an int an int);
- ``"fedistill.round"``: a ``ConfigRecord`` with the :class:`RoundInfo` (``round``, ``lr``) and the client
  id the message is for (server to client only).

The client's persistent state (a dict that may hold tensors, numbers and nested dicts) lives between
rounds in the ClientApp's ``context.state`` as ``torch.save`` bytes in a ``ConfigRecord``. It holds only
tensors and plain data, and is read back with ``torch.load(weights_only=True)``, like checkpoints: the
bytes pass through Flower's state store, and a pickled object in them must never run code in the
ClientApp. Such a record is refused with one line.
"""

from __future__ import annotations

import io
import pickle
import re
import sys
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from ..algorithms.base import Message, RoundInfo
from ..errors import ConfigError

TENSORS = "fedistill.tensors"
SCALARS = "fedistill.scalars"
ROUND = "fedistill.round"
STATE = "fedistill.client_state"
STYPE = "fedistill.torch"  # raw tensor bytes, little-endian, C order

_DTYPES: dict[str, torch.dtype] = {
    str(dt): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships wheels for is little-endian
    raise ImportError("fedistill.flower assumes a little-endian machine (raw tensor bytes on the wire)")


def tensor_to_array(tensor: torch.Tensor) -> Array:
    """A tensor as a Flower ``Array`` of its raw bytes (any dtype, any memory format, exact)."""
    t = tensor.detach().to("cpu").contiguous()
    if str(t.dtype) not in _DTYPES:
        raise TypeError(f"fedistill.flower: tensors of dtype {t.dtype} cannot be sent (supported: {', '.join(_DTYPES)})")
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return Array(dtype=str(t.dtype), shape=tuple(int(s) for s in t.shape), stype=STYPE, data=data)


def array_to_tensor(array: Array) -> torch.Tensor:
    """Inverse of :func:`tensor_to_array`; also accepts Flower's own NumPy arrays (``array.numpy()``)."""
    if array.stype != STYPE:
        return torch.from_numpy(array.numpy().copy())
    dtype = _DTYPES.get(array.dtype)
    if dtype is None:
        raise TypeError(f"fedistill.flower: unknown tensor dtype {array.dtype!r} in a received message")
    shape = tuple(array.shape)
    if not array.data:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(array.data), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def message_to_records(msg: Message, info: RoundInfo | None = None, cid: int | None = None) -> RecordDict:
    """A fedistill Message (plus, server to client, the round info and client id) as a ``RecordDict``."""
    records: dict[str, Any] = {
        TENSORS: ArrayRecord(array_dict={k: tensor_to_array(v) for k, v in msg.tensors().items()}),
        SCALARS: ConfigRecord(dict(msg.scalars())),
    }
    if info is not None:
        head: dict[str, Any] = {"round": int(info.round), "lr": float(info.lr)}
        if cid is not None:
            head["cid"] = int(cid)
        records[ROUND] = ConfigRecord(head)
    return RecordDict(records)


def records_to_message(content: RecordDict) -> Message:
    """The fedistill Message inside a ``RecordDict`` written by :func:`message_to_records`."""
    items: dict[str, Any] = {}
    if TENSORS in content.array_records:
        for key, array in content.array_records[TENSORS].items():
            items[key] = array_to_tensor(array)
    if SCALARS in content.config_records:
        for key, value in content.config_records[SCALARS].items():
            if key in items:
                raise ValueError(f"fedistill.flower: key {key!r} is both a tensor and a scalar")
            items[key] = value
    return Message(items)


def records_to_round(content: RecordDict) -> tuple[RoundInfo, int | None]:
    """(RoundInfo, client id or None) of a server-to-client ``RecordDict``."""
    if ROUND not in content.config_records:
        raise ValueError("fedistill.flower: the message carries no round information (not sent by a fedistill ServerApp?)")
    head = content.config_records[ROUND]
    cid = head.get("cid")
    return RoundInfo(round=int(head["round"]), lr=float(head["lr"])), (int(cid) if cid is not None else None)


# -- client state in context.state -----------------------------------------------------------------
def state_to_record(state: dict[str, Any]) -> ConfigRecord:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return ConfigRecord({"torch": buffer.getvalue()})


def record_to_state(record: ConfigRecord | None, what: str = "client state") -> dict[str, Any]:
    """The state :func:`state_to_record` stored; tensors and plain data only (anything else is refused)."""
    if record is None or "torch" not in record:
        return {}
    data = record["torch"]
    if not isinstance(data, bytes):
        raise ConfigError(f"{what} in context.state is not torch.save bytes (got {type(data).__name__}); it was not written by fedistill")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only refuses every pickled global that is not a tensor or plain data ("Unsupported global:
        # GLOBAL io.open ..."), before calling it; other unpickling errors are bytes that are not a pickle.
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if found is None:
            raise ConfigError(f"{what} in context.state cannot be read (not torch.save bytes); it is damaged") from None
        raise ConfigError(
            f"{what} in context.state holds objects other than tensors and plain data ({found[1]}) and was not "
            "loaded: it was not written by fedistill, or was tampered with"
        ) from None
    except Exception as exc:  # truncated or empty
        raise ConfigError(f"{what} in context.state cannot be read ({exc.__class__.__name__}); it is damaged") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{what} in context.state is a {type(state).__name__}, not a dict; it was not written by fedistill")
    return state


def load_client_state(context_state: RecordDict, cid: int) -> dict[str, Any]:
    """Client ``cid``'s persistent state from a ClientApp's ``context.state`` ({} before its first round)."""
    return record_to_state(context_state.config_records.get(f"{STATE}.{cid}"), f"client {cid}'s state")


def save_client_state(context_state: RecordDict, cid: int, state: dict[str, Any]) -> None:
    context_state.config_records[f"{STATE}.{cid}"] = state_to_record(state)
