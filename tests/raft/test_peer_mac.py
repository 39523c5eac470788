"""The Raft port's message signature (peer_mac.py): what pysyncobj checks before it unpickles."""
from __future__ import annotations

import pytest

from raftps.raft.peer_mac import InvalidMessage, PeerMac

SECRET = b"s" * 32


def test_a_signed_message_reads_back_with_its_timestamp() -> None:
    signer, reader = PeerMac(SECRET), PeerMac(SECRET)
    message = signer.encrypt_at_time(b"\x78\x01 an append", 1234)
    assert reader.extract_timestamp(message) == 1234
    assert reader.decrypt(message) == b"\x78\x01 an append"
    assert reader.decrypt(signer.encrypt_at_time(b"", 0)) == b""


def test_any_altered_byte_a_wrong_secret_or_a_cut_message_is_refused() -> None:
    signer, reader = PeerMac(SECRET), PeerMac(SECRET)
    message = signer.encrypt_at_time(b"payload bytes", 7)
    for i in range(len(message)):
        altered = bytearray(message)
        altered[i] ^= 0x01
        with pytest.raises(InvalidMessage):
            reader.decrypt(bytes(altered))
    with pytest.raises(InvalidMessage, match="wrong tag"):
        PeerMac(b"t" * 32).decrypt(message)
    for cut in (0, 1, 10, len(message) - 1):
        with pytest.raises(InvalidMessage):
            reader.decrypt(message[:cut])
    with pytest.raises(InvalidMessage, match="not a raftps peer message"):
        reader.extract_timestamp(b"gAAAAA" + bytes(60))          # a Fernet token
