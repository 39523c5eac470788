"""One frame format for every byte raftps moves: client port, data plane, payload files, snapshots.

    frame  = prefix header blob
    prefix = b"RPS1" | header length (u32, big-endian) | blob length (u64, big-endian)
    header = msgpack; each numpy array in it is an ExtType(ARRAY_EXT, [dtype, shape])
    blob   = the arrays' raw little-endian bytes, in the order they appear in the header

Arrays travel as raw bytes next to a small header, so encoding is a list of buffers handed to
the socket (no copy) and decoding is ``np.frombuffer`` on the received blob (no copy). Sizes are
checked against limits before anything is allocated, and every array's dtype, shape and byte
range are checked against the blob before it is built. Nothing here ever unpickles.
"""
from __future__ import annotations

import math
import socket
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import msgpack
import numpy as np

from .errors import ProtocolError

MAGIC = b"RPS1"
PREFIX = struct.Struct("!4sIQ")
ARRAY_EXT = 1
# Little-endian only, so the bytes of a tensor are the same on every replica and on disk.
DTYPES = {"float16": "<f2", "float32": "<f4", "float64": "<f8", "int32": "<i4", "int64": "<i8"}
_DTYPE_NAMES = {np.dtype(v).str: k for k, v in DTYPES.items()}
MAX_NDIM = 8


@dataclass(frozen=True)
class Limits:
    """Upper bounds on what one frame may declare; checked before allocation."""
    max_header_bytes: int = 1 << 20
    max_blob_bytes: int = 1 << 30          # 1 GiB of tensor bytes in one frame
    max_arrays: int = 4096


DEFAULT_LIMITS = Limits()


def dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(np.dtype(dtype).newbyteorder("<").str)
    if name is None:
        raise ProtocolError(f"dtype {np.dtype(dtype)} is not supported (use one of {sorted(DTYPES)})")
    return name


def encode(message: Any) -> list[memoryview | bytes]:
    """The buffers of one frame, ready for ``sendall`` one after another (arrays are not copied)."""
    buffers: list[memoryview] = []
    total = 0

    def default(obj: Any) -> Any:
        nonlocal total
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj, dtype=np.dtype(DTYPES[dtype_name(obj.dtype)]))
            buffers.append(memoryview(arr).cast("B"))
            total += arr.nbytes
            return msgpack.ExtType(ARRAY_EXT, msgpack.packb([dtype_name(arr.dtype), list(arr.shape)]))
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"cannot encode {type(obj).__name__}")

    header = msgpack.packb(message, default=default, use_bin_type=True)
    return [PREFIX.pack(MAGIC, len(header), total), header, *buffers]


def encode_bytes(message: Any) -> bytes:
    return b"".join(encode(message))


def _parse_prefix(prefix: bytes, limits: Limits) -> tuple[int, int]:
    magic, header_len, blob_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r} (expected {MAGIC!r}): not a raftps peer")
    if header_len > limits.max_header_bytes:
        raise ProtocolError(f"frame header of {header_len} bytes exceeds max_header_bytes={limits.max_header_bytes}")
    if blob_len > limits.max_blob_bytes:
        raise ProtocolError(f"frame of {blob_len} tensor bytes exceeds max_blob_bytes={limits.max_blob_bytes}")
    return header_len, blob_len


def _decode(header: bytes, blob: memoryview, limits: Limits) -> Any:
    offset = 0
    count = 0

    def ext_hook(code: int, data: bytes) -> Any:
        nonlocal offset, count
        if code != ARRAY_EXT:
            raise ProtocolError(f"unknown msgpack extension type {code}")
        count += 1
        if count > limits.max_arrays:
            raise ProtocolError(f"frame holds more than max_arrays={limits.max_arrays} arrays")
        meta = msgpack.unpackb(data, raw=False)
        if not (isinstance(meta, list) and len(meta) == 2 and isinstance(meta[1], list)):
            raise ProtocolError("malformed array descriptor")
        name, shape = meta
        if name not in DTYPES:
            raise ProtocolError(f"array dtype {name!r} is not supported (use one of {sorted(DTYPES)})")
        if len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
            raise ProtocolError(f"bad array shape {shape!r}")
        dtype = np.dtype(DTYPES[name])
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > len(blob):
            raise ProtocolError(f"array of shape {tuple(shape)} {name} needs {nbytes} bytes, "
                                f"but only {len(blob) - offset} remain in the frame")
        arr = np.frombuffer(blob, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
        offset += nbytes
        return arr

    try:
        message = msgpack.unpackb(header, ext_hook=ext_hook, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"undecodable frame header: {exc}") from None
    if offset != len(blob):
        raise ProtocolError(f"frame declares {len(blob)} tensor bytes but its arrays use {offset}")
    return message


def decode(frame: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode one complete frame held in memory (a file's contents, say)."""
    view = memoryview(frame)
    if len(view) < PREFIX.size:
        raise ProtocolError(f"truncated frame: {len(view)} bytes, the prefix alone is {PREFIX.size}")
    header_len, blob_len = _parse_prefix(bytes(view[:PREFIX.size]), limits)
    if len(view) != PREFIX.size + header_len + blob_len:
        raise ProtocolError(f"truncated frame: {len(view)} bytes, expected {PREFIX.size + header_len + blob_len}")
    start = PREFIX.size + header_len
    return _decode(bytes(view[PREFIX.size:start]), view[start:], limits)


def recv_exactly(sock: socket.socket, view: memoryview, started: bool = True) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection" + (" mid-frame" if got or started else ""))
        got += n


def recv_frame(sock: socket.socket, limits: Limits = DEFAULT_LIMITS, *, first_byte_timeout: float | None = None) -> Any:
    """Read and decode one frame. Raises ConnectionError on EOF, ProtocolError on bad bytes.

    ``first_byte_timeout`` lets an idle connection wait longer for the next request than a
    half-sent frame may take to finish (the socket's own timeout), so a stalled sender cannot
    hold a server thread forever.
    """
    prefix = bytearray(PREFIX.size)
    view = memoryview(prefix)
    if first_byte_timeout is not None:
        frame_timeout = sock.gettimeout()
        sock.settimeout(first_byte_timeout)
        try:
            recv_exactly(sock, view[:1], started=False)
        finally:
            sock.settimeout(frame_timeout)
        recv_exactly(sock, view[1:])
    else:
        recv_exactly(sock, view, started=False)
    header_len, blob_len = _parse_prefix(bytes(prefix), limits)
    header = bytearray(header_len)
    recv_exactly(sock, memoryview(header))
    blob = bytearray(blob_len)
    recv_exactly(sock, memoryview(blob))
    return _decode(bytes(header), memoryview(blob), limits)


def send_frame(sock: socket.socket, message: Any) -> int:
    buffers = encode(message)
    for buf in buffers:
        sock.sendall(buf)
    return sum(len(b) for b in buffers)


def write_frame(f: BinaryIO, message: Any) -> int:
    buffers = encode(message)
    for buf in buffers:
        f.write(buf)
    return sum(len(b) for b in buffers)


def read_frame_file(path: str, limits: Limits = DEFAULT_LIMITS) -> Any:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    return decode(data, limits)
