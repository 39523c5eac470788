"""pysyncobj's peer messages as zlib streams of stored (uncompressed) blocks, made without zlib.

pysyncobj 0.3.17 sends every peer message as ``zlib.compress(pickle.dumps(message), 3)``
(tcp_connection.py L144). Our messages are small (tensor bytes travel on the data plane) or
already incompressible (inline float payloads), yet each call sets up a fresh deflate state:
with 1 KiB pushes on 3 nodes that line was 38% of the leader's tick thread (``python -m
bench.profile --size 1024``). A stored-block stream is
still a valid zlib stream (RFC 1950/1951), so any pysyncobj peer, patched or not, reads it
with ``zlib.decompress``; building one costs a header, five bytes per 64 KiB and an Adler-32.

``install()`` points pysyncobj's ``tcp_connection.zlib`` at this module; decompression is zlib's own.
"""
from __future__ import annotations

import struct
import zlib as _zlib

decompress = _zlib.decompress
error = _zlib.error

_HEADER = b"\x78\x01"          # deflate, 32 KiB window, no preset dictionary, header check ok
_BLOCK = 0xFFFF                 # a stored block holds at most 65535 bytes


def compress(data: bytes, level: int = -1) -> bytes:
    """A zlib stream of ``data`` in stored blocks (``level`` is accepted and ignored)."""
    view = memoryview(data)
    parts = [_HEADER]
    start = 0
    while True:
        chunk = view[start:start + _BLOCK]
        start += len(chunk)
        final = start >= len(view)
        parts.append(struct.pack("<BHH", 1 if final else 0, len(chunk), len(chunk) ^ 0xFFFF))
        parts.append(chunk)
        if final:
            break
    parts.append(struct.pack(">I", _zlib.adler32(data)))
    return b"".join(parts)


def install() -> None:
    """Make pysyncobj's peer connections frame with ``compress`` (idempotent)."""
    import sys
    from pysyncobj import tcp_connection
    tcp_connection.zlib = sys.modules[__name__]
