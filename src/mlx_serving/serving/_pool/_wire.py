"""Wire format between a `ServingPool` and its worker processes.

Every message is a msgspec Struct with an explicit tag, encoded as MessagePack and framed by an
8-byte big-endian length prefix. Payloads (a caller's input, a result, a stream item) are encoded
separately and embedded as `msgspec.Raw`, so a payload that cannot be decoded fails only its own
request: the envelope (and with it the request id) always decodes.

Payload values keep their Python types:

* ``None``, ``bool``, ``int`` (64-bit), ``float``, ``str``, ``bytes``, ``list`` and ``dict`` with
  ``str``/``int`` keys are MessagePack-native;
* numpy arrays and numpy scalars travel as an extension carrying (dtype descr, shape, raw bytes),
  without pickle, and arrive as writable arrays that own their memory;
* tuples travel as an extension and come back as tuples;
* anything else (dataclasses, enums, sets, object arrays, subclasses of the native types, ...) is
  pickled (protocol 5); the receiving process must be able to import its class.

A payload that cannot be encoded raises `TypeError`; one that cannot be decoded raises `ValueError`,
both naming the cause.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any, Union

import msgspec
import numpy as np

__all__ = [
    "Call",
    "Cancel",
    "End",
    "ErrorInfo",
    "Failed",
    "FromWorker",
    "Heartbeat",
    "Item",
    "Ready",
    "Result",
    "Shutdown",
    "StartFailed",
    "StatsQuery",
    "StatsReply",
    "ToWorker",
    "decode_from_worker",
    "decode_payload",
    "decode_to_worker",
    "encode_message",
    "encode_payload",
    "recv_frame",
    "send_frame",
]

_HEADER = struct.Struct("!Q")
_EXT_NDARRAY = 1
_EXT_NPSCALAR = 2
_EXT_TUPLE = 3
_EXT_PICKLE = 4
_ARRAY_HEADER = struct.Struct("!I")
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


class ErrorInfo(msgspec.Struct, array_like=True):
    """An exception raised in a worker: ``module.qualname``, ``str(exc)``, the formatted traceback
    (with its chain), the pickled exception when it could be pickled (None otherwise), and the
    same for its ``__cause__``."""

    type_name: str
    message: str
    traceback: str
    pickled: bytes | None = None
    cause: ErrorInfo | None = None


# --- parent -> worker -------------------------------------------------------------------------


class Call(msgspec.Struct, tag="call", array_like=True):
    """Run one request (``stream=False``: one `Result`; ``stream=True``: `Item`s then `End`);
    ``deadline``: seconds the request may take from its arrival in the worker (None: no limit)."""

    id: int
    stream: bool
    payload: msgspec.Raw
    deadline: float | None = None


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    """The caller of request ``id`` gave up: drop or stop it."""

    id: int


class StatsQuery(msgspec.Struct, tag="stats", array_like=True):
    """Ask for the worker's serving statistics; answered by `StatsReply` with the same id."""

    id: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Finish in-flight requests (up to ``timeout`` seconds), stop the serving, exit."""

    timeout: float


ToWorker = Union[Call, Cancel, StatsQuery, Shutdown]

# --- worker -> parent -------------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The worker built and started its serving and accepts calls."""

    pid: int


class StartFailed(msgspec.Struct, tag="start_failed", array_like=True):
    """The factory or the serving's start raised; the worker exits after sending this."""

    error: ErrorInfo


class Result(msgspec.Struct, tag="result", array_like=True):
    """The result of a non-streaming call."""

    id: int
    payload: msgspec.Raw


class Item(msgspec.Struct, tag="item", array_like=True):
    """One item of a streaming call."""

    id: int
    payload: msgspec.Raw


class End(msgspec.Struct, tag="end", array_like=True):
    """A streaming call finished normally."""

    id: int


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """A call (streaming or not) raised."""

    id: int
    error: ErrorInfo


class StatsReply(msgspec.Struct, tag="stats_reply", array_like=True):
    """The worker serving's statistics as plain data."""

    id: int
    stats: dict[str, Any]


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    """Sent by the worker's event loop every ``heartbeat_interval`` seconds: the loop runs (any
    message shows that too; this one is for a worker with nothing else to say)."""


FromWorker = Union[Ready, StartFailed, Result, Item, End, Failed, StatsReply, Heartbeat]

_message_encoder = msgspec.msgpack.Encoder()
_to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
_from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)


def encode_message(message: ToWorker | FromWorker) -> bytearray:
    """Encode one message as a complete frame (length prefix included)."""
    frame = bytearray(_HEADER.size)
    _message_encoder.encode_into(message, frame, _HEADER.size)
    _HEADER.pack_into(frame, 0, len(frame) - _HEADER.size)
    return frame


def decode_to_worker(frame: bytearray | bytes) -> ToWorker:
    """Decode a frame body sent by the parent. Raises msgspec.DecodeError on a corrupt frame."""
    return _to_worker_decoder.decode(frame)


def decode_from_worker(frame: bytearray | bytes) -> FromWorker:
    """Decode a frame body sent by a worker. Raises msgspec.DecodeError on a corrupt frame."""
    return _from_worker_decoder.decode(frame)


def send_frame(sock: socket.socket, frame: bytearray) -> None:
    """Write one frame built by `encode_message` (blocking; callers serialise writers)."""
    sock.sendall(frame)


def recv_frame(sock: socket.socket) -> bytearray | None:
    """Read one frame body; None on a clean end of stream before a frame starts.

    Raises ConnectionError when the stream ends inside a frame."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    body = _recv_exactly(sock, size)
    if body is None:
        raise ConnectionError("connection closed inside a frame")
    return body


def _recv_exactly(sock: socket.socket, size: int) -> bytearray | None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            if received == 0:
                return None
            raise ConnectionError("connection closed inside a frame")
        received += count
    return buffer


# --- payloads ---------------------------------------------------------------------------------

_SCALARS = frozenset({str, float, bool, bytes, type(None)})


def encode_payload(value: object) -> msgspec.Raw:
    """Encode a payload value (see the module docstring). Raises TypeError if it cannot be sent."""
    try:
        return msgspec.Raw(_payload_encoder.encode(_prepare(value)))
    except TypeError:
        raise
    except Exception as exc:  # pickling can raise almost anything
        raise TypeError(f"cannot send {type(value).__name__} to another process: {exc!r}") from exc


def decode_payload(raw: msgspec.Raw | bytes | bytearray | memoryview) -> object:
    """Decode a payload. Raises ValueError naming the cause if it cannot be decoded."""
    try:
        return _payload_decoder.decode(raw)
    except Exception as exc:
        raise ValueError(f"cannot decode a payload received from another process: {exc!r}") from exc


def _prepare(value: Any) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is int:
        return value if _INT_MIN <= value <= _INT_MAX else _pickled(value)
    if kind is list:
        return [_prepare(item) for item in value]
    if kind is dict:
        if all(type(key) is str or type(key) is int for key in value):
            return {key: _prepare(item) for key, item in value.items()}
        return _pickled(value)
    if kind is tuple:
        return msgspec.msgpack.Ext(_EXT_TUPLE, _payload_encoder.encode([_prepare(v) for v in value]))
    if kind is np.ndarray and not value.dtype.hasobject:
        return msgspec.msgpack.Ext(_EXT_NDARRAY, _pack_array(value))
    if isinstance(value, np.generic) and not value.dtype.hasobject:
        return msgspec.msgpack.Ext(_EXT_NPSCALAR, _pack_array(np.asarray(value)))
    return _pickled(value)


def _pickled(value: Any) -> msgspec.msgpack.Ext:
    try:
        data = pickle.dumps(value, protocol=5)
    except Exception as exc:
        raise TypeError(
            f"cannot send {type(value).__qualname__} to another process: it is not MessagePack-"
            f"native, not a numpy array, and pickling failed: {exc!r}"
        ) from exc
    return msgspec.msgpack.Ext(_EXT_PICKLE, data)


def _pack_array(array: np.ndarray) -> bytes:
    # _prepare keeps the tuples of structured dtype descrs (and of the shape) as tuples
    descr = np.lib.format.dtype_to_descr(array.dtype)
    header = _payload_encoder.encode(_prepare((descr, array.shape)))
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data  # its buffer, not copied
    return b"".join((_ARRAY_HEADER.pack(len(header)), header, data))


def _unpack_array(data: memoryview) -> np.ndarray:
    (header_size,) = _ARRAY_HEADER.unpack_from(data)
    start = _ARRAY_HEADER.size
    descr, shape = _payload_decoder.decode(data[start : start + header_size])
    dtype = np.lib.format.descr_to_dtype(descr)
    array = np.frombuffer(data[start + header_size :], dtype=dtype).reshape(shape)
    # the received buffer is read-only (msgspec.Raw): give the receiver an array it may write to
    return array if array.flags.aligned and array.flags.writeable else array.copy()


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _EXT_NDARRAY:
        return _unpack_array(data)
    if code == _EXT_NPSCALAR:
        return _unpack_array(data)[()]
    if code == _EXT_TUPLE:
        return tuple(_payload_decoder.decode(data))
    if code == _EXT_PICKLE:
        return pickle.loads(data)
    raise ValueError(f"unknown payload extension code {code}")


_payload_encoder = msgspec.msgpack.Encoder()
_payload_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
