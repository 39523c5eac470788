"""The connection between two partner ranks of a synchronous job (pair_steps.py): one TCP
connection per pair, frames in the project's codec (codec.py: msgpack headers and raw arrays,
never pickle), each authenticated as the data plane authenticates a node's frames.

Who listens and where: the lower rank of a pair listens on its host's address (the one its
traffic to the store leaves from) at a port the kernel picks, and publishes ``host:port`` in the
store as a small tensor of the job (``address_tensor``); the higher rank reads it there and
connects. Nothing else needs configuring: a rank under torchrun or a fleet's worker finds its
partner through the store both already reach.

Authentication: a challenge-response over fresh nonces with a key derived from the client token
both ranks present to the store and the pair's identity (job, lower rank), then a FrameMac per
direction (HMAC-SHA256 over a frame counter, the frame and its blob's digest): a process that
does not hold the token cannot join a pair, and a frame altered, replayed or injected on the
connection is refused before it is decoded. Without a token (a cluster with no client
authentication) the key is derived from the pair's identity alone: as open as that cluster's
client port.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from raftps import codec
from raftps.errors import ProtocolError, RaftpsError

log = logging.getLogger("raftps.client.peers")

HANDSHAKE_LIMITS = codec.Limits(max_header_bytes=512, max_blob_bytes=0, max_arrays=0)
ADDRESS_SLOTS = 64                  # float64 slots of the published address: its length, then its characters
SEND_TIMEOUT = 60                   # seconds one send to the partner may block (the kernel's SO_SNDTIMEO)


def pair_of(rank: int, world: int) -> tuple[int, int] | None:
    """(lower, higher) rank of ``rank``'s pair: ranks 2i and 2i + 1; None for an odd world's last rank."""
    lower = rank - rank % 2
    return None if lower + 1 >= world else (lower, lower + 1)


def address_tensor(job: str | None, lower: int) -> str:
    """The tensor where the pair of ``lower`` publishes its listening address."""
    return f"{job or ''}:pair{lower}"


def pair_key(token: str | None, job: str | None, lower: int) -> bytes:
    return hmac.new((token or "").encode(), f"raftps pair v1|{job or ''}|{lower}".encode(), hashlib.sha256).digest()


def encode_address(address: str) -> np.ndarray:
    codes = address.encode()
    if len(codes) >= ADDRESS_SLOTS:
        raise ValueError(f"pair address {address!r} is longer than {ADDRESS_SLOTS - 1} characters")
    out = np.zeros(ADDRESS_SLOTS, np.float64)
    out[0] = len(codes)
    out[1:1 + len(codes)] = list(codes)
    return out


def decode_address(values: np.ndarray) -> str | None:
    n = int(values[0]) if len(values) == ADDRESS_SLOTS else 0
    return bytes(int(v) for v in values[1:1 + n]).decode() if 0 < n < ADDRESS_SLOTS else None


def local_address(store_address: str) -> str:
    """This host's address on the route to ``store_address`` (host:port): where a partner on
    another host can reach it. A UDP socket's connect sends nothing."""
    host = store_address.rsplit(":", 1)[0].strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def _proof(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def _macs(key: bytes, lower_nonce: bytes, higher_nonce: bytes, lower: bool) -> codec.FrameMac:
    down = hmac.new(key, b"l2h" + lower_nonce + higher_nonce, hashlib.sha256).digest()
    up = hmac.new(key, b"h2l" + lower_nonce + higher_nonce, hashlib.sha256).digest()
    return codec.FrameMac(send_key=down, recv_key=up) if lower else codec.FrameMac(send_key=up, recv_key=down)


class PeerLink:
    """One authenticated connection to the partner. ``send`` a message (any thread); what arrives
    is kept by (kind, step, item) until ``take`` asks for it. Once the connection breaks (the
    partner died, closed it, or sent a frame that fails its check), ``broken`` is set and every
    ``take`` returns None at once."""

    def __init__(self, sock: socket.socket, mac: codec.FrameMac, partner: int):
        self.sock, self.mac, self.partner = sock, mac, partner
        # Two threads use the socket at once (a sender, the reader), so its mode never changes:
        # blocking, no Python timeout (a timeout set by one thread made the other's send fail with
        # EAGAIN); the kernel bounds a send to a partner that stopped reading, and a take's own
        # timeout (then close) bounds a wait on one that stopped sending.
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT, 0))
        self._send_lock = threading.Lock()
        self._arrived: dict[tuple, dict] = {}
        self._changed = threading.Condition()
        self.broken = False
        self._reader = threading.Thread(target=self._receive, name=f"pair-{partner}", daemon=True)
        self._reader.start()

    def send(self, message: dict) -> bool:
        """Send ``message``; False (and the link broken) if it could not be."""
        if self.broken:
            return False
        try:
            with self._send_lock:
                codec.send_frame(self.sock, message, mac=self.mac)
            return True
        except Exception as exc:         # a broken link, or a message the codec refuses: either ends the pair
            log.warning("pair link to rank %d: send failed (%s: %s); closing it", self.partner, type(exc).__name__, exc)
            self.close()
            return False

    def take(self, kind: str, step: int, item: int, timeout: float) -> dict | None:
        """The message (kind, step, item) from the partner, once it arrives; None if it has not
        within ``timeout`` s or the link broke."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while (kind, step, item) not in self._arrived and not self.broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(min(left, 1.0))
            return self._arrived.pop((kind, step, item), None)

    def forget_before(self, step: int) -> None:
        """Drop what arrived for steps before ``step`` (a half this rank stopped waiting for)."""
        with self._changed:
            for key in [k for k in self._arrived if k[1] < step]:
                del self._arrived[key]

    def _receive(self) -> None:
        try:
            while True:
                msg = codec.recv_frame(self.sock, mac=self.mac)
                if not (isinstance(msg, dict) and isinstance(msg.get("kind"), str)
                        and type(msg.get("step")) is int and type(msg.get("item")) is int):
                    raise ProtocolError("a pair message needs kind, step and item")
                with self._changed:
                    self._arrived[(msg["kind"], msg["step"], msg["item"])] = msg
                    self._changed.notify_all()
        except Exception as exc:         # any: the partner waiting on this link must learn it broke
            if not self.broken:
                log.info("pair link to rank %d: closed (%s: %s)", self.partner, type(exc).__name__, exc)
            self.close()

    def close(self) -> None:
        with self._changed:
            self.broken = True
            self._changed.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def listen(client: Any, job: str | None, lower: int, key: bytes, timeout: float) -> PeerLink | None:
    """(the lower rank) Listen, publish the address, accept the partner within ``timeout`` s."""
    host = local_address(client.addresses[0])
    server = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        port = server.getsockname()[1]
        name = address_tensor(job, lower)
        published = encode_address(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        client.create_many({name: np.zeros(ADDRESS_SLOTS, np.float64)}, {name: {"name": "sgd", "lr": 1.0}})
        client.assign({name: published})
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            server.settimeout(left)
            try:
                sock, _ = server.accept()
            except socket.timeout:
                return None
            link = _accepted(sock, key, lower)
            if link is not None:
                return link
        return None
    finally:
        codec.close_listener(server)


def _accepted(sock: socket.socket, key: bytes, lower: int) -> PeerLink | None:
    try:
        sock.settimeout(10.0)
        hello = codec.recv_frame(sock, HANDSHAKE_LIMITS, frame_timeout=10.0)
        if not (isinstance(hello, dict) and isinstance(hello.get("nonce"), bytes) and len(hello["nonce"]) == 16):
            raise ProtocolError("expected a pair hello")
        nonce = os.urandom(16)
        codec.send_frame(sock, {"nonce": nonce, "proof": _proof(key, b"lower", hello["nonce"])})
        answer = codec.recv_frame(sock, HANDSHAKE_LIMITS, frame_timeout=10.0)
        if not (isinstance(answer, dict) and isinstance(answer.get("proof"), bytes)
                and hmac.compare_digest(answer["proof"], _proof(key, b"higher", nonce))):
            raise ProtocolError("the partner failed authentication")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return PeerLink(sock, _macs(key, nonce, hello["nonce"], lower=True), lower + 1)
    except (OSError, ConnectionError, RaftpsError):
        sock.close()
        return None


def connect(client: Any, job: str | None, lower: int, key: bytes, timeout: float) -> PeerLink | None:
    """(the higher rank) Read the partner's address from the store and connect, retrying (an
    address left by an earlier run refuses, or fails the handshake) for up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    name = address_tensor(job, lower)
    pause = 0.1
    while time.monotonic() + pause < deadline:
        try:
            values, _ = client.pull([name])
            address = decode_address(np.asarray(values[name]))
        except RaftpsError:            # not published yet
            address = None
        link = _connected(address, key, lower) if address else None
        if link is not None:
            return link
        time.sleep(pause)
        pause = min(1.0, pause * 1.5)
    return None


def _connected(address: str, key: bytes, lower: int) -> PeerLink | None:
    host, port = address.rsplit(":", 1)
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)
    except OSError:
        return None
    try:
        nonce = os.urandom(16)
        codec.send_frame(sock, {"nonce": nonce})
        reply = codec.recv_frame(sock, HANDSHAKE_LIMITS, frame_timeout=10.0)
        if not (isinstance(reply, dict) and isinstance(reply.get("proof"), bytes) and isinstance(reply.get("nonce"), bytes)
                and hmac.compare_digest(reply["proof"], _proof(key, b"lower", nonce))):
            raise ProtocolError("the partner failed authentication")
        codec.send_frame(sock, {"proof": _proof(key, b"higher", reply["nonce"])})
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return PeerLink(sock, _macs(key, reply["nonce"], nonce, lower=False), lower)
    except (OSError, ConnectionError, RaftpsError):
        sock.close()
        return None
