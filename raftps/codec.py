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

import hashlib
import hmac
import math
import mmap
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import blake3
import msgpack
import numpy as np

from raftps.errors import LimitExceeded, ProtocolError

MAGIC = b"RPS1"
PREFIX = struct.Struct("!4sIQ")
ARRAY_EXT = 1
# Little-endian only, so the bytes of a tensor are the same on every replica and on disk.
DTYPES = {"float16": "<f2", "float32": "<f4", "float64": "<f8", "int32": "<i4", "int64": "<i8",
          "int8": "|i1"}   # int8: compressed pseudo-gradients' codes (raftps.compress), never a stored tensor
_DTYPE_NAMES = {np.dtype(v).str: k for k, v in DTYPES.items()}
MAX_NDIM = 8
# A larger blob is received into anonymous mmap memory, whose pages cost RAM only once bytes
# arrive: bytearray(n) zero-fills all n at once, so a sender declaring 1 GiB and sending 16 bytes
# would cost 1 GiB until the frame deadline. Below this, the heap is faster (see tuning.py).
# There the buffer is np.empty: recv fills every byte before anything reads it, so zero-filling
# it first (bytearray(n): a memset of every byte of every push, seen in `python -m bench.profile
# --perf`) is wasted work.
EAGER_BLOB_BYTES = 16 << 20
HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Upper bounds on what one frame may declare; checked before allocation."""
    max_header_bytes: int = 1 << 20
    max_blob_bytes: int = 1 << 30          # 1 GiB of tensor bytes in one frame
    max_arrays: int = 4096
    max_tensor_bytes: int = 1 << 30        # one array's bytes


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
            # np.asarray, not ascontiguousarray: that makes a 0-d array (a scalar parameter) 1-D
            arr = np.asarray(obj, dtype=np.dtype(DTYPES[dtype_name(obj.dtype)]), order="C")
            buffers.append(memoryview(arr.reshape(-1)).cast("B"))    # 1-D: a (0, n) array casts too
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
        raise LimitExceeded(f"frame header of {header_len} bytes exceeds max_header_bytes={limits.max_header_bytes}")
    if blob_len > limits.max_blob_bytes:
        raise LimitExceeded(f"frame of {blob_len} tensor bytes exceeds max_blob_bytes={limits.max_blob_bytes}")
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
            raise LimitExceeded(f"frame holds more than max_arrays={limits.max_arrays} arrays")
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
        if nbytes > limits.max_tensor_bytes:
            raise LimitExceeded(f"array of shape {tuple(shape)} {name} ({nbytes} bytes) exceeds "
                                f"max_tensor_bytes={limits.max_tensor_bytes}")
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


def close_listener(sock: socket.socket) -> None:
    """Close a listening socket so its port is free at once: a thread blocked in accept() keeps
    the kernel's socket (and the port) alive after close() alone; shutdown() wakes it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def recv_exactly(sock: socket.socket, view: memoryview, started: bool = True, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the peer closes first. With ``deadline``
    (time.monotonic()), each recv waits only for what is left of it."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("frame deadline passed")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection" + (" mid-frame" if got or started else ""))
        got += n


class FrameMac:
    """Authenticates every frame of one connection: HMAC-SHA256 over a per-direction counter, the
    frame's prefix and header, and the blob's digest (``blob_hasher``), with a key per direction.
    A frame that was altered, dropped, replayed or reordered fails the check before its header is
    parsed. (The blob enters through its digest so that one payload sent to several peers is
    hashed once; the HMAC is then over a few hundred bytes, whatever the blob's size.)"""
    TAG = 32

    def __init__(self, send_key: bytes, recv_key: bytes):
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = self._received = 0

    @staticmethod
    def _tag(key: bytes, counter: int, prefix: Any, header: Any, digest: bytes) -> bytes:
        mac = hmac.new(key, counter.to_bytes(8, "big"), hashlib.sha256)
        mac.update(prefix)
        mac.update(header)
        mac.update(digest)
        return mac.digest()

    def sign(self, buffers: list, digest: bytes | None = None) -> bytes:
        """The tag of one frame (``encode``'s buffers); ``digest``: blob_digest(buffers), if known."""
        self._sent += 1
        return self._tag(self._send_key, self._sent, buffers[0], buffers[1], digest or blob_digest(buffers))

    def verify(self, prefix: Any, header: Any, digest: bytes, tag: bytes) -> None:
        """Check the tag of a received frame, given its blob's digest."""
        self._received += 1
        if not hmac.compare_digest(tag, self._tag(self._recv_key, self._received, prefix, header, digest)):
            raise ProtocolError("frame failed authentication (bad HMAC): altered, replayed or not from a peer")


def blob_hasher() -> Any:
    """The hash every blob byte goes through, once per node: BLAKE3 (256-bit digest, collision
    resistant, so an HMAC over it authenticates the blob), faster per byte on one core than
    SHA-256 even with SHA-NI (``python -m timeit -s "import blake3, os; b = os.urandom(4 << 20)"
    "blake3.blake3(b).digest()"``, and the same with hashlib.sha256); the data plane and payload
    ids use nothing else."""
    return blake3.blake3()


def blob_digest(buffers: list) -> bytes:
    """The digest (``blob_hasher``) of the blob of ``encode``'s buffers (after prefix and header)."""
    h = blob_hasher()
    for buf in buffers[2:]:
        h.update(buf)
    return h.digest()


# The slowest rate a frame is given time for, on top of frame_timeout (bytes/s: 512 kbit/s).
# Frames share a link: at 5 Mbit/s, eight payloads on their way at once get 625 kbit/s each.
FRAME_MIN_RATE = 64 << 10


def recv_frame(sock: socket.socket, limits: Limits = DEFAULT_LIMITS, *, first_byte_timeout: float | None = None,
               frame_timeout: float | None = None, mac: FrameMac | None = None,
               on_size: Callable[[int], None] | None = None) -> Any:
    """Read and decode one frame. Raises ConnectionError on EOF, ProtocolError on bad bytes.

    ``first_byte_timeout`` lets an idle connection wait longer for the next request than a
    half-sent frame may take to finish. ``frame_timeout`` is that bound: the whole frame must
    arrive within it of its first byte, plus its size at FRAME_MIN_RATE (LimitExceeded
    otherwise), however slowly the bytes trickle, so a stalled sender cannot hold a server thread
    for long while a large frame on a slow link still gets the time its bytes need. Without it, the socket's
    own timeout applies to each recv. ``mac`` checks the frame's tag before it is decoded.
    ``on_size`` is told the frame's size once its prefix is read (metrics).
    """
    return recv_frame_into(sock, limits, first_byte_timeout=first_byte_timeout, frame_timeout=frame_timeout,
                           mac=mac, on_size=on_size)[0]


def recv_frame_into(sock: socket.socket, limits: Limits = DEFAULT_LIMITS, *, first_byte_timeout: float | None = None,
                    frame_timeout: float | None = None, mac: FrameMac | None = None,
                    on_size: Callable[[int], None] | None = None) -> tuple[Any, bytes | None]:
    """``recv_frame``, returning (message, the blob's digest when ``mac`` is given, else None):
    the digest the MAC checked, for the receiver to reuse (a payload id's check)."""
    prefix = bytearray(PREFIX.size)
    view = memoryview(prefix)
    own_timeout = sock.gettimeout()          # restored for the reply's send
    digest = None
    try:
        if first_byte_timeout is not None:
            sock.settimeout(first_byte_timeout)
        recv_exactly(sock, view[:1], started=False)
        sock.settimeout(own_timeout)
        deadline = None if frame_timeout is None else time.monotonic() + frame_timeout
        try:
            recv_exactly(sock, view[1:], deadline=deadline)
            header_len, blob_len = _parse_prefix(bytes(prefix), limits)
            if deadline is not None:      # a large frame on a slow link: its bytes' time on top
                deadline += (header_len + blob_len) / FRAME_MIN_RATE
            if on_size is not None:
                on_size(PREFIX.size + header_len + blob_len)
            header = bytearray(header_len)
            recv_exactly(sock, memoryview(header), deadline=deadline)
            blob = np.empty(blob_len, np.uint8) if blob_len <= EAGER_BLOB_BYTES else mmap.mmap(-1, blob_len)
            if mac is None:
                recv_exactly(sock, memoryview(blob), deadline=deadline)
            else:
                # Hash each chunk as it lands, while the kernel receives the next one.
                h = blob_hasher()
                with memoryview(blob) as view_of_blob:
                    for start in range(0, blob_len, HASH_CHUNK):
                        part = view_of_blob[start:start + HASH_CHUNK]
                        recv_exactly(sock, part, deadline=deadline)
                        h.update(part)
                        part.release()
                tag = bytearray(FrameMac.TAG)
                recv_exactly(sock, memoryview(tag), deadline=deadline)
                digest = h.digest()
                mac.verify(prefix, header, digest, bytes(tag))
        except socket.timeout:
            if frame_timeout is None:
                raise
            raise LimitExceeded(f"frame not complete within frame_timeout={frame_timeout:g} s "
                                "of its first byte") from None
    finally:
        sock.settimeout(own_timeout)
    return _decode(bytes(header), memoryview(blob), limits), digest


def send_frame(sock: socket.socket, message: Any, mac: FrameMac | None = None) -> int:
    return send_buffers(sock, encode(message), mac)


def send_buffers(sock: socket.socket, buffers: list, mac: FrameMac | None = None,
                 digest: Callable[[], bytes] | None = None) -> int:
    """Send one encoded frame (``encode``'s buffers, not changed: they may go to several peers).
    The tag goes last, so ``digest`` (the blob's, from blob_digest) may still be being computed
    in another thread while the blob is sent; it is called once the blob is out."""
    for buf in buffers:
        sock.sendall(buf)
    size = sum(len(b) for b in buffers)
    if mac is not None:
        sock.sendall(mac.sign(buffers, digest() if digest else None))
        size += FrameMac.TAG
    return size


def write_frame(f: BinaryIO, message: Any) -> int:
    buffers = encode(message)
    for buf in buffers:
        f.write(buf)
    return sum(len(b) for b in buffers)


def read_frame_file(path: str, limits: Limits | None = None) -> Any:
    """One frame from a file. Default limits: the file's own size, which bounds every allocation
    (the network limits, 4096 arrays and 1 GiB, would refuse a large store's own snapshot)."""
    with open(path, "rb") as f:         # read straight into the buffer the arrays will view
        data = bytearray(os.fstat(f.fileno()).st_size)
        del data[f.readinto(data) or 0:]
        data += f.read()                  # (a file that grew meanwhile: decode says what is wrong)
    if limits is None:
        n = len(data)
        limits = Limits(max_header_bytes=n, max_blob_bytes=n, max_arrays=n, max_tensor_bytes=n)
    return decode(data, limits)
