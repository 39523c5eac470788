import socket
import struct
import threading

import numpy as np
import pytest

from raftps import codec
from raftps.errors import ProtocolError


def test_roundtrip_keeps_dtype_shape_and_bits():
    msg = {"op": "push", "tensors": {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
                                     "b": np.array([np.pi, -0.0, 1e-300])}, "n": 3}
    out = codec.decode(codec.encode_bytes(msg))
    assert out["n"] == 3
    for k, v in msg["tensors"].items():
        assert out["tensors"][k].dtype == v.dtype and out["tensors"][k].shape == v.shape
        assert out["tensors"][k].tobytes() == v.tobytes()


def test_big_endian_and_non_contiguous_arrays_are_normalised():
    arr = np.arange(20, dtype=">f8").reshape(4, 5)[:, ::2]
    out = codec.decode(codec.encode_bytes({"x": arr}))["x"]
    assert out.dtype == np.float64 and np.array_equal(out, arr)


@pytest.mark.parametrize("frame, message", [
    (b"", "truncated"),
    (b"GARBAGEGARBAGEGA", "magic"),
    (struct.pack("!4sIQ", b"RPS1", 1 << 30, 0), "max_header_bytes"),
    (struct.pack("!4sIQ", b"RPS1", 1, 1 << 40), "max_blob_bytes"),
    (struct.pack("!4sIQ", b"RPS1", 1, 0) + b"\xc1", "undecodable"),
])
def test_bad_frames_are_refused_with_a_named_reason(frame, message):
    with pytest.raises(ProtocolError, match=message):
        codec.decode(frame)


def test_truncated_frame_is_refused():
    frame = codec.encode_bytes({"x": np.ones(10)})
    for cut in (1, 15, 17, len(frame) - 1):
        with pytest.raises(ProtocolError, match="truncated"):
            codec.decode(frame[:cut])


def test_array_descriptor_must_match_the_blob():
    import msgpack
    ext = msgpack.ExtType(codec.ARRAY_EXT, msgpack.packb(["float32", [1 << 40]]))
    header = msgpack.packb({"x": ext})
    with pytest.raises(ProtocolError, match="needs"):
        codec.decode(struct.pack("!4sIQ", b"RPS1", len(header), 8) + header + b"\0" * 8)
    ext = msgpack.ExtType(codec.ARRAY_EXT, msgpack.packb(["object", [1]]))
    header = msgpack.packb({"x": ext})
    with pytest.raises(ProtocolError, match="not supported"):
        codec.decode(struct.pack("!4sIQ", b"RPS1", len(header), 8) + header + b"\0" * 8)
    header = msgpack.packb({"x": 1})
    with pytest.raises(ProtocolError, match="declares"):
        codec.decode(struct.pack("!4sIQ", b"RPS1", len(header), 8) + header + b"\0" * 8)


def test_oversized_declaration_is_refused_before_reading_the_body():
    a, b = socket.socketpair()
    try:
        a.sendall(struct.pack("!4sIQ", b"RPS1", 10, 1 << 50))   # declares a petabyte, sends nothing
        with pytest.raises(ProtocolError, match="max_blob_bytes"):
            codec.recv_frame(b)
    finally:
        a.close(), b.close()


def test_recv_frame_over_a_socket_and_eof_mid_frame():
    a, b = socket.socketpair()
    try:
        msg = {"t": np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)}
        threading.Thread(target=codec.send_frame, args=(a, msg)).start()
        assert np.array_equal(codec.recv_frame(b)["t"], msg["t"])
        a.sendall(codec.encode_bytes(msg)[:1000])
        a.close()
        with pytest.raises(ConnectionError, match="mid-frame"):
            codec.recv_frame(b)
    finally:
        b.close()


def test_empty_multidimensional_array_roundtrips():
    # memoryview cannot cast a (0, n) array to bytes; a pull_rows of no rows sends one
    out = codec.decode(codec.encode_bytes({"a": np.zeros((0, 16), np.float32)}))
    assert out["a"].shape == (0, 16) and out["a"].dtype == np.float32
