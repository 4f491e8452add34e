"""The pool's wire format: tagged messages, framing, payload round trips without pickle for arrays."""

from __future__ import annotations

import dataclasses
import enum
import pickle
import socket
import threading

import msgspec
import numpy as np
import pytest

from mlx_serving.serving._pool import _wire


@dataclasses.dataclass
class Point:
    x: int
    y: float


class Color(enum.Enum):
    RED = 1


def roundtrip(value):
    return _wire.decode_payload(_wire.encode_payload(value))


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(10, dtype=np.int64)[::3],  # not contiguous
        np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        np.array([True, False]),
        np.zeros((0, 5), dtype=np.float16),
        np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8", (2,))]),
        np.array(3.5, dtype=np.float64),
    ],
)
def test_array_round_trip_keeps_dtype_shape_values(array):
    out = roundtrip({"x": array})["x"]
    assert type(out) is np.ndarray
    assert out.dtype == array.dtype and out.shape == array.shape
    np.testing.assert_array_equal(out, array)
    out[...] = out  # writable


def test_arrays_do_not_use_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "dumps", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    out = roundtrip([np.ones(4, np.float32), np.int32(7), {"k": (1, "a")}])
    assert type(out[1]) is np.int32 and out[1] == 7
    assert out[2] == {"k": (1, "a")}


def test_python_types_survive():
    value = {
        "tuple": (1, (2, "x"), []),
        "list": [1, 2.5, None, True, b"\x00"],
        "int_keys": {1: "a"},
        "tuple_keys": {(1, 2): "b"},
        "set": {1, 2},
        "dataclass": Point(1, 2.0),
        "enum": Color.RED,
        "big": 2**70,
        "negative": -(2**63),
        "objects": np.array([1, "a"], dtype=object),
    }
    out = roundtrip(value)
    for key, expected in value.items():
        assert type(out[key]) is type(expected), key
    assert out["tuple"] == value["tuple"] and out["dataclass"] == Point(1, 2.0)
    assert out["tuple_keys"] == {(1, 2): "b"} and out["big"] == 2**70
    assert list(out["objects"]) == [1, "a"]


def test_unpicklable_payload_raises_type_error():
    lock = threading.Lock()
    with pytest.raises(TypeError, match="lock"):
        _wire.encode_payload({"x": [lock]})


def test_undecodable_payload_raises_value_error():
    raw = _wire.encode_payload(Point(1, 2.0))
    broken = bytes(raw).replace(b"Point", b"Pnint")
    with pytest.raises(ValueError, match="cannot decode"):
        _wire.decode_payload(broken)


def test_messages_round_trip_over_a_socket():
    left, right = socket.socketpair()
    with left, right:
        payload = _wire.encode_payload(np.arange(100_000, dtype=np.float64))
        sent = [
            _wire.Call(7, True, payload),
            _wire.Cancel(7),
            _wire.Shutdown(1.5),
        ]
        writer = threading.Thread(
            target=lambda: [_wire.send_frame(left, _wire.encode_message(m)) for m in sent]
        )
        writer.start()
        received = [_wire.decode_to_worker(_wire.recv_frame(right)) for _ in sent]
        writer.join(5)
        assert [type(m) for m in received] == [_wire.Call, _wire.Cancel, _wire.Shutdown]
        assert received[0].id == 7 and received[0].stream is True
        np.testing.assert_array_equal(
            _wire.decode_payload(received[0].payload), np.arange(100_000, dtype=np.float64)
        )
        assert received[2].timeout == 1.5
        left.close()
        assert _wire.recv_frame(right) is None  # clean end of stream


def test_truncated_frame_is_a_connection_error():
    left, right = socket.socketpair()
    with right:
        frame = _wire.encode_message(_wire.Cancel(1))
        left.sendall(frame[:-1])
        left.close()
        with pytest.raises(ConnectionError):
            _wire.recv_frame(right)


def test_wrong_direction_message_is_rejected():
    frame = _wire.encode_message(_wire.Ready(123))
    with pytest.raises(msgspec.ValidationError):
        _wire.decode_to_worker(frame[8:])
    assert _wire.decode_from_worker(frame[8:]) == _wire.Ready(123)


def test_heartbeat_is_a_small_message_from_the_worker():
    frame = _wire.encode_message(_wire.Heartbeat())
    assert len(frame) < 24
    assert _wire.decode_from_worker(frame[8:]) == _wire.Heartbeat()
    with pytest.raises(msgspec.ValidationError):
        _wire.decode_to_worker(frame[8:])
