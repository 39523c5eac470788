"""Peer messages framed as stored-block zlib streams: what any zlib reader accepts, byte for byte."""
import os
import zlib

import pytest

from raftps.raft import stored_zlib


@pytest.mark.parametrize("size", [0, 1, 200, 65534, 65535, 65536, 65537, 3 * 65535, 1 << 20])
def test_zlib_reads_back_every_size_across_block_boundaries(size):
    data = os.urandom(size)
    framed = stored_zlib.compress(data, 3)
    assert zlib.decompress(framed) == data
    assert len(framed) == 2 + 5 * max(1, -(-size // 65535)) + size + 4


def test_a_corrupted_stream_is_refused_by_zlib():
    framed = bytearray(stored_zlib.compress(b"parameter bytes" * 100))
    framed[40] ^= 0xFF                      # a payload byte: the Adler-32 no longer matches
    with pytest.raises(zlib.error):
        zlib.decompress(bytes(framed))


def test_install_points_pysyncobj_at_it():
    from pysyncobj import tcp_connection
    stored_zlib.install()
    assert tcp_connection.zlib.compress is stored_zlib.compress
    assert tcp_connection.zlib.decompress is zlib.decompress
