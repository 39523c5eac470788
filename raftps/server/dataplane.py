"""The data plane: tensor payloads between nodes, beside (not inside) the Raft log.

Each node serves a data-plane port. A peer connection starts with a mutual challenge-response
(HMAC-SHA256 over fresh nonces with a key derived from the cluster secret); until it succeeds the
server accepts only tiny frames, so an unauthenticated sender can make it allocate nothing.
After that, frames are codec frames each followed by an HMAC tag (codec.FrameMac, keys derived
from both nonces, one per direction, frames counted): a frame injected into or replayed on an
authenticated connection is refused before it is decoded. ``put`` stores a payload and
acknowledges once it is on disk; ``get`` returns a payload or ``found: False``.

A put's blob is hashed as it arrives (BLAKE3, codec.blob_hasher), for the frame's MAC, and that
one digest also checks the payload id (payloads.verify_digest). The leader hashes a payload once
(its id, and the digest every peer's frame tag signs) before sending it to every peer at once.

Both ends of the handshake say which version of this protocol they speak (``VERSION``; version 1,
before raftps hashed blobs with BLAKE3, said nothing), so a node talking to a node of another
raftps version is told so by name, rather than failing every frame's MAC.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import threading
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor, wait
from typing import Any, Callable

import numpy as np

from raftps import codec

from raftps.server import snapshot_file
from raftps.errors import ProtocolError
from raftps.sockets import drain
from raftps.server.payloads import PAYLOAD_ID, PayloadStore, verify, verify_digest
from raftps.raft import SnapshotMeta

log = logging.getLogger("raftps.server.dataplane")
HANDSHAKE_LIMITS = codec.Limits(max_header_bytes=512, max_blob_bytes=0, max_arrays=0)
PUT_TRIES = 3            # sends of one payload to one peer within a replicate, at most
SEND_CHUNK = 256 << 10   # bytes per sendall: a socket timeout bounds each (10 s: >= 210 kbit/s)
VERSION = 2            # 1: blobs hashed with SHA-256 (and no version in the hello); 2: BLAKE3


def _version_problem(peer: object) -> str | None:
    if peer == VERSION:
        return None
    return (f"data-plane protocol version {peer if isinstance(peer, int) else 1} on the peer, "
            f"{VERSION} on this node: run one raftps version on every node")


def data_key(secret: bytes) -> bytes:
    return hmac.new(secret, b"raftps data plane v1", hashlib.sha256).digest()


def _proof(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def _session_macs(key: bytes, client_nonce: bytes, server_nonce: bytes) -> tuple[codec.FrameMac, codec.FrameMac]:
    """(the client's FrameMac, the server's): fresh keys per connection and per direction."""
    c2s = hmac.new(key, b"c2s" + client_nonce + server_nonce, hashlib.sha256).digest()
    s2c = hmac.new(key, b"s2c" + client_nonce + server_nonce, hashlib.sha256).digest()
    return codec.FrameMac(send_key=c2s, recv_key=s2c), codec.FrameMac(send_key=s2c, recv_key=c2s)


class DataPlaneServer:
    def __init__(self, host: str, port: int, secret: bytes, store: PayloadStore,
                 limits: codec.Limits = codec.DEFAULT_LIMITS, frame_timeout: float = 30.0,
                 max_connections: int = 64, snapshot_file: str | None = None):
        self.key = data_key(secret)
        self.store = store
        self.snapshot_file = snapshot_file
        self.limits = limits
        self.frame_timeout = frame_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self.sock = socket.create_server((host, port), reuse_port=False, backlog=64)
        self._stopped = False
        threading.Thread(target=self._accept, name="dataplane-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()          # at max_connections: refuse rather than queue without bound
                continue
            threading.Thread(target=self._serve, args=(conn,), name="dataplane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.frame_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mac = self._handshake(conn)
            if mac is None:
                return
            while True:
                msg, digest = codec.recv_frame_into(conn, self.limits, first_byte_timeout=3600.0,
                                                    frame_timeout=self.frame_timeout, mac=mac)
                codec.send_frame(conn, self._handle_safely(msg, digest), mac=mac)
        except (ConnectionError, OSError, ProtocolError) as exc:
            log.debug("data-plane connection closed: %s", exc)
        finally:
            conn.close()
            self._slots.release()

    def _handshake(self, conn: socket.socket) -> codec.FrameMac | None:
        """The connection's FrameMac once the peer proved it holds the secret, else None."""
        hello = codec.recv_frame(conn, HANDSHAKE_LIMITS, frame_timeout=self.frame_timeout)
        if not (isinstance(hello, dict) and isinstance(hello.get("nonce"), bytes) and len(hello["nonce"]) == 16):
            codec.send_frame(conn, {"ok": False, "error": "ProtocolError", "message": "expected a data-plane hello"})
            return None
        problem = _version_problem(hello.get("version"))
        if problem is not None:
            log.warning("data-plane connection refused: %s", problem)
            codec.send_frame(conn, {"ok": False, "error": "ProtocolError", "message": problem, "version": VERSION})
            return None
        nonce = os.urandom(16)
        codec.send_frame(conn, {"nonce": nonce, "proof": _proof(self.key, b"server", hello["nonce"]),
                                "version": VERSION})
        answer = codec.recv_frame(conn, HANDSHAKE_LIMITS, frame_timeout=self.frame_timeout)
        if not (isinstance(answer, dict) and isinstance(answer.get("proof"), bytes)
                and hmac.compare_digest(answer["proof"], _proof(self.key, b"client", nonce))):
            codec.send_frame(conn, {"ok": False, "error": "AuthenticationFailed",
                                    "message": "data-plane authentication failed: wrong cluster secret"})
            return None
        codec.send_frame(conn, {"ok": True})
        return _session_macs(self.key, hello["nonce"], nonce)[1]

    def _handle_safely(self, msg: object, digest: bytes | None = None) -> dict:
        try:
            return self._handle(msg, digest)
        except Exception as exc:     # a bug must cost one request, not the connection
            log.exception("data-plane request failed")
            return {"ok": False, "message": f"internal error: {exc!r}"}

    def _handle(self, msg: object, digest: bytes | None = None) -> dict:
        """``digest``: the digest of the frame's blob (its MAC's), which checks a put's id."""
        if not isinstance(msg, dict):
            return {"ok": False, "message": "expected a map"}
        op, pid = msg.get("op"), msg.get("pid")
        if op == "snapshot":
            try:
                return {"ok": True, "found": True, "snapshot": snapshot_file.read_frame(self.snapshot_file, self.limits)}
            except (OSError, TypeError, ProtocolError):
                return {"ok": True, "found": False}
        if op == "get_range":
            first, last, budget = msg.get("first"), msg.get("last"), 64 << 20
            if type(first) is not int or type(last) is not int:
                return {"ok": False, "message": "get_range needs first and last (ints)"}
            found: dict[str, dict] = {}
            for other in self.store.applied_between(first, last):
                tensors = self.store.get(other)
                if tensors is not None:
                    found[other] = tensors
                    budget -= sum(a.nbytes for a in tensors.values())
                    if budget <= 0:
                        break
            return {"ok": True, "payloads": found}
        if not isinstance(pid, str) or not PAYLOAD_ID.fullmatch(pid):
            return {"ok": False, "message": f"bad or missing payload id {pid!r}"}
        try:
            if op == "put":
                tensors = msg.get("tensors")
                if not isinstance(tensors, dict) or not tensors \
                        or not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in tensors.items()) \
                        or not (verify(pid, tensors) if digest is None else verify_digest(pid, tensors, digest)):
                    return {"ok": False, "message": f"payload {pid}: content does not match its checksum"}
                self.store.put(pid, tensors)
                return {"ok": True}
            if op == "get":
                tensors = self.store.get(pid)
                return {"ok": True, "found": tensors is not None, "tensors": tensors or {}}
        except ValueError as exc:
            return {"ok": False, "message": str(exc)}
        return {"ok": False, "message": f"unknown data-plane op {op!r}"}

    def close(self) -> None:
        self._stopped = True
        codec.close_listener(self.sock)


class PeerLink:
    """One authenticated connection to a peer's data-plane port, used by one thread at a time."""

    def __init__(self, address: str, secret: bytes, timeout: float = 10.0):
        host, port = address.rsplit(":", 1)
        self.key = data_key(secret)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        try:
            self.mac = self._handshake(address)
        except BaseException:
            self.sock.close()
            raise

    def _handshake(self, address: str) -> codec.FrameMac:
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.urandom(16)
        codec.send_frame(self.sock, {"nonce": nonce, "version": VERSION})
        reply = codec.recv_frame(self.sock, HANDSHAKE_LIMITS)
        problem = _version_problem(reply.get("version") if isinstance(reply, dict) else None)
        if problem is not None:
            raise ConnectionError(f"data plane {address}: {problem}")
        if not (isinstance(reply, dict) and isinstance(reply.get("proof"), bytes)
                and isinstance(reply.get("nonce"), bytes)
                and hmac.compare_digest(reply["proof"], _proof(self.key, b"server", nonce))):
            raise ConnectionError(f"data plane {address}: peer failed authentication")
        codec.send_frame(self.sock, {"proof": _proof(self.key, b"client", reply["nonce"])})
        answer = codec.recv_frame(self.sock, HANDSHAKE_LIMITS)
        if not isinstance(answer, dict) or answer.get("ok") is not True:
            raise ConnectionError(f"data plane {address}: peer refused our cluster secret")
        return _session_macs(self.key, nonce, reply["nonce"])[0]

    def call(self, msg: Any) -> dict:
        return self.call_encoded(codec.encode(msg))

    def call_encoded(self, frame: list, digest: Callable[[], bytes] | None = None,
                     progress: Callable[[int], None] | None = None) -> dict:
        """Send ``codec.encode``'s buffers of a message (``digest``: returns their blob_digest) in
        chunks, so the socket's timeout bounds each chunk, not the whole payload (a slow link);
        ``progress`` is told each chunk's size once it is sent."""
        for buf in frame:
            view = memoryview(buf).cast("B")
            for start in range(0, len(view), SEND_CHUNK):
                self.sock.sendall(view[start:start + SEND_CHUNK])
                if progress is not None:
                    progress(min(SEND_CHUNK, len(view) - start))
        self.sock.sendall(self.mac.sign(frame, digest() if digest else None))
        # The answer comes within the socket's timeout of the peer's having every byte (a
        # small frame's ACK may wait for that answer: delayed ACK, so only large frames wait).
        if sum(len(b) for b in frame) >= SEND_CHUNK:
            drain(self.sock, self.sock.gettimeout() or 10.0, progress)
        return codec.recv_frame(self.sock, mac=self.mac)

    def close(self) -> None:
        self.sock.close()


class Peers:
    """Connection pools to every peer's data plane, and the two things a node asks of them."""

    def __init__(self, addresses: list[str], secret: bytes, timeout: float = 10.0):
        self.addresses = addresses
        self.secret = secret
        self.timeout = timeout
        self._idle: dict[str, queue.SimpleQueue[PeerLink]] = {a: queue.SimpleQueue() for a in addresses}
        self._pool = ThreadPoolExecutor(max_workers=8 * max(1, len(addresses)), thread_name_prefix="dataplane-send")
        self._hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dataplane-hash")

    def set_addresses(self, addresses: list[str]) -> None:
        """The cluster's membership changed: send to these peers from now on. Idle links to
        peers no longer listed are closed; a call under way to one finishes and closes its link."""
        for address in addresses:
            self._idle.setdefault(address, queue.SimpleQueue())
        gone = [a for a in self.addresses if a not in addresses]
        self.addresses = list(addresses)          # a new list: iterations under way keep the old one
        for address in gone:
            idle = self._idle.pop(address, None)
            while idle is not None and not idle.empty():
                idle.get_nowait().close()

    def _call(self, address: str, msg: dict, frame: list | None = None,
              digest: Callable[[], bytes] | None = None, progress: Callable[[int], None] | None = None) -> dict:
        """``msg``, or its ready ``frame`` and digest, over an idle link to ``address``."""
        idle = self._idle.get(address)
        try:
            link = idle.get_nowait() if idle is not None else PeerLink(address, self.secret, self.timeout)
        except queue.Empty:
            link = PeerLink(address, self.secret, self.timeout)
        try:
            reply = link.call(msg) if frame is None else link.call_encoded(frame, digest, progress)
        except BaseException:
            link.close()
            raise
        if idle is not None and address in self.addresses:
            idle.put(link)
        else:
            link.close()
        return reply

    def _put(self, address: str, pid: str, frame: list, digest: Callable[[], bytes],
             progress: Callable[[int], None] | None = None) -> bool:
        try:
            return self._call(address, {}, frame, digest, progress).get("ok") is True
        except (OSError, ConnectionError, ProtocolError, CancelledError) as exc:   # (cancelled: closing)
            log.debug("put %s to %s failed: %s", pid, address, exc)
            return False

    def replicate(self, pid: str, tensors: dict, needed: int, timeout: float, digest: bytes | None = None,
                  meanwhile: Callable[[], Any] | None = None) -> int:
        """Send a payload to every peer; return once ``needed`` peers hold it (or all answered,
        or no byte of it has left for ``timeout`` seconds: a payload on a slow link takes as long
        as its bytes need, while they move). Sends still under way go on in the background. ``digest``: the digest
        (codec.blob_hasher) of the tensors' bytes in their order (payloads.digest_of), if known;
        ``meanwhile`` runs in this thread while the sends are under way (the leader's own copy
        of the payload)."""
        # Encoded and hashed once for every peer (each connection only signs the digest); without
        # a digest, hashed while the sends are under way: the tag goes after the blob.
        frame = codec.encode({"op": "put", "pid": pid, "tensors": tensors})
        if digest is not None:
            known = digest
            hashed_result: Callable[[], bytes] = lambda: known
        else:
            hashed_result = self._hasher.submit(codec.blob_digest, frame).result
        sent = [0]       # bytes out to all peers so far (approximate across threads: only whether it moves matters)

        def progress(n: int) -> None:
            sent[0] += n

        def put(address: str) -> Future:
            return self._pool.submit(self._put, address, pid, frame, hashed_result, progress)
        futures = {put(a): a for a in self.addresses}
        tries = dict.fromkeys(self.addresses, 1)
        if meanwhile is not None:
            meanwhile()
        acks = 0
        pending = set(futures)
        seen = -1
        while pending and acks < needed:
            done, pending = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            if not done:
                if sent[0] == seen:    # stalled for a whole timeout: give up
                    break
                seen = sent[0]
                continue
            for f in done:
                if f.result():
                    acks += 1
                elif tries[futures[f]] < PUT_TRIES:
                    # A put that failed on a congested link (a connection starved past its
                    # timeout) goes again from here: this node still holds the bytes, whereas
                    # failing the write would make its client send them all again.
                    tries[futures[f]] += 1
                    retried = put(futures[f])
                    futures[retried] = futures[f]
                    pending.add(retried)
        return acks

    def fetch(self, pid: str) -> dict | None:
        """A payload from the first peer that has it intact, or None."""
        for address in self.addresses:
            try:
                reply = self._call(address, {"op": "get", "pid": pid})
            except (OSError, ConnectionError, ProtocolError):
                continue
            tensors = reply.get("tensors")
            if reply.get("found") and isinstance(tensors, dict) and verify(pid, tensors):
                return tensors
        return None

    def fetch_range(self, first: int, last: int) -> dict[str, dict]:
        """Payloads a peer applied at log indices first..last (up to 64 MiB), checked; {} if none."""
        for address in self.addresses:
            try:
                reply = self._call(address, {"op": "get_range", "first": first, "last": last})
            except (OSError, ConnectionError, ProtocolError):
                continue
            payloads = reply.get("payloads")
            if isinstance(payloads, dict) and payloads:
                return {pid: t for pid, t in payloads.items()
                        if isinstance(pid, str) and PAYLOAD_ID.fullmatch(pid) and isinstance(t, dict) and verify(pid, t)}
        return {}

    def fetch_snapshot(self, min_index: int) -> tuple[SnapshotMeta, dict] | None:
        """The newest snapshot a peer has, if it covers ``min_index``: (what it covers, the machine)."""
        best = None
        for address in self.addresses:
            try:
                reply = self._call(address, {"op": "snapshot"})
            except (OSError, ConnectionError, ProtocolError):
                continue
            if not reply.get("found"):
                continue
            try:
                meta, machine = snapshot_file.from_frame(reply.get("snapshot"))
            except ValueError:
                continue
            if meta.index >= min_index and (best is None or meta.index > best[0].index):
                best = meta, machine
        return best

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._hasher.shutdown(wait=False, cancel_futures=True)
        for q in self._idle.values():
            while True:
                try:
                    q.get_nowait().close()
                except queue.Empty:
                    break
