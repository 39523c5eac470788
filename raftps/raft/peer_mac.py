"""pysyncobj's peer messages authenticated with HMAC-SHA256 instead of Fernet-encrypted.

With a ``password`` pysyncobj 0.3.17 wraps every peer message in a Fernet token (AES-128-CBC,
HMAC-SHA256 and base64) in its single tick thread, and a replicated entry costs two of them to
make and two to check per follower: an encryption and a base64 pass on top of the HMAC.
Encryption bought no confidentiality: tensors above 8 KiB cross between nodes on the data plane,
which authenticates every frame and encrypts none (docs/security.md). So the Raft port gets the data plane's
guarantee at the data plane's cost: a message is

    b"R1" | timestamp (8 bytes, big-endian) | message | HMAC-SHA256(key, everything before)

with the key derived from the cluster secret. Everything else is pysyncobj's protocol, unchanged:
each connection starts by exchanging random keys that every later message must carry (so a
message recorded on one connection is refused on any other), and timestamps never go backwards
on a connection. A message that fails its check makes pysyncobj drop the connection before it
unpickles anything.

``PeerMac`` has the three methods of the Fernet object pysyncobj calls (``encrypt_at_time``,
``extract_timestamp``, ``decrypt``); pysyncobj_log.py hands it to the SyncObj in place of one.
"""
from __future__ import annotations

import hashlib
import hmac
import struct

MAGIC = b"R1"
_HEAD = len(MAGIC) + 8
_TAG = hashlib.sha256().digest_size
KDF_ROUNDS = 100_000            # a weak secret costs a guesser this much per try (secrets are 32 random bytes)


class InvalidMessage(Exception):
    """A peer message without a valid tag (pysyncobj closes the connection on any exception)."""


class PeerMac:
    def __init__(self, secret: bytes):
        self._key = hashlib.pbkdf2_hmac("sha256", secret, b"raftps raft peer messages v1", KDF_ROUNDS)

    def _tag(self, signed: bytes | memoryview) -> bytes:
        return hmac.new(self._key, signed, hashlib.sha256).digest()

    def encrypt_at_time(self, data: bytes, current_time: int) -> bytes:
        """(pysyncobj's name) ``data`` signed, in the clear."""
        signed = MAGIC + struct.pack(">Q", current_time) + data
        return signed + self._tag(signed)

    def extract_timestamp(self, message: bytes) -> int:
        if len(message) < _HEAD + _TAG or message[:len(MAGIC)] != MAGIC:
            raise InvalidMessage("not a raftps peer message")
        return struct.unpack_from(">Q", message, len(MAGIC))[0]

    def decrypt(self, message: bytes) -> bytes:
        """(pysyncobj's name) The message's data if its tag is right; InvalidMessage otherwise."""
        self.extract_timestamp(message)
        view = memoryview(message)
        if not hmac.compare_digest(self._tag(view[:-_TAG]), view[-_TAG:]):
            raise InvalidMessage("wrong tag: not signed with this cluster's secret, or altered")
        return bytes(view[_HEAD:-_TAG])
