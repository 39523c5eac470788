"""The client port of a node: length-prefixed codec frames, one request and one reply at a time
per connection, a thread per connection (bounded in total and per client IP). Writes and
linearizable reads are served by the leader; a follower answers them with the leader's address.
Bad bytes close the connection with an error frame and touch nothing else.

Every connection starts (after TLS, if the node serves it) with a hello frame carrying a client
token: the cluster's, or a named identity's (rbac.py). Until the hello passes, the node reads only
tiny frames and serves nothing, so a client without a token can make it allocate nothing and
learns nothing but the refusal. Then every request is checked against its op's schema
(schema.py) and against the identity's roles (rbac.py) before anything else runs; a request
refused there never reaches Raft, and its reply says so (``refused``); a field under its old name
(ops.py, ``Op.renamed``) is renamed first. Then the op's handler
(its record in ops.py names it; handlers.py has them) answers.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable

from raftps import auth, codec, ops, rbac
from raftps.errors import (AuthenticationFailed, InvalidRequest, LimitExceeded, ProtocolError, RaftpsError,
                           TLSRequired, error_result, exception_result)
from raftps.groups import Layout
from raftps.server.handlers import Handlers, retry
from raftps.instruments import ServerInstruments
from raftps.server.node import RaftNode, offset_address
from raftps.rbac import Identity

log = logging.getLogger("raftps.server.server")
# the writes through Raft that Handlers._write serves as they are (the others: _push_step,
# _move_write, _parts_write)
WRITES = tuple(name for name, op in ops.OPS.items() if op.serve == "_write")
HELLO_LIMITS = codec.Limits(max_header_bytes=4096, max_blob_bytes=0, max_arrays=0)
TLS_RECORD_HANDSHAKE = 0x16          # the first byte of every TLS ClientHello


class ClientServer:
    def __init__(self, replicas: RaftNode | dict[int, RaftNode], host: str, port: int,
                 authorizer: rbac.Authorizer | None = None, layout: Layout | None = None, client_offset: int = 100,
                 first: RaftNode | None = None):
        """``replicas``: this node's replica of each Raft group it hosts (one RaftNode: group 0
        of a one-group cluster). Requests name their group (``raft_group``, default 0). ``first``:
        whose config the server takes (default: the first replica's; a joining node whose first
        Raft group is still a learner's, hosting.py, has none yet)."""
        self.replicas = replicas if isinstance(replicas, dict) else {0: replicas}
        self.node = node = first or self.replicas[min(self.replicas)]
        self.layout, self.client_offset = layout, client_offset   # every node's client port: Raft port + offset
        config = node.config
        self.limits = config.limits
        # Who may connect and what each identity may do (rbac.py); reloaded as its files change.
        self.authz = authorizer or rbac.Authorizer(config.token_file, config.auth_file,
                                                   None if config.token_file else config.client_token)
        self.frame_timeout = config.frame_timeout
        self.idle_timeout = config.idle_timeout
        self.max_connections = config.max_connections
        self.max_connections_per_ip = config.max_connections_per_ip
        self.max_tensors_per_push = config.max_tensors_per_push
        self.tls = auth.server_tls_context(config.tls_cert, config.tls_key) if config.tls_cert else None
        self._open: dict[str, int] = {}           # client IP -> open connections
        self._open_lock = threading.Lock()
        self.sock = socket.create_server((host, port), backlog=128)
        self.instruments = ServerInstruments()
        self._bytes_in = self.instruments.client_bytes.labels("in")
        self._bytes_out = self.instruments.client_bytes.labels("out")
        # op -> handler(request, identity), for the node as a whole; op -> handler(replica, request,
        # identity), served by the request's Raft group's replica: both from the ops' records (ops.py)
        answers = Handlers(self.replicas, layout, client_offset, self.limits, self.open_connections)
        self._node_handlers: dict[str, Callable[[dict, Identity], dict]] = {
            op: getattr(answers, method) for op, method in ops.served_by_node().items()}
        self._handlers: dict[str, Callable[[RaftNode, dict, Identity], dict]] = {
            op: getattr(answers, method) for op, method in ops.served_by_replica().items()}
        threading.Thread(target=self._accept, name="client-accept", daemon=True).start()

    def _admit(self, ip: str) -> dict | None:
        """Count a new connection from ``ip``, or the refusal to send it."""
        with self._open_lock:
            if sum(self._open.values()) >= self.max_connections:
                return retry(f"node is at max_connections={self.max_connections}; try another node")
            if self._open.get(ip, 0) >= self.max_connections_per_ip:
                return error_result(LimitExceeded, f"{ip} already has max_connections_per_ip="
                                                   f"{self.max_connections_per_ip} connections open to this node")
            self._open[ip] = self._open.get(ip, 0) + 1
        return None

    def open_connections(self) -> int:
        with self._open_lock:
            return sum(self._open.values())

    def _release(self, ip: str) -> None:
        with self._open_lock:
            self._open[ip] -= 1
            if not self._open[ip]:
                del self._open[ip]

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            refusal = self._admit(peer[0])
            if refusal is not None:
                _refuse(conn, refusal)
                continue
            threading.Thread(target=self._serve, args=(conn, peer[0]), name="client-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, ip: str) -> None:
        try:
            conn.settimeout(self.frame_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn = self._start_tls(conn)
                if conn is None:
                    return
            identity = self._hello(conn)
            if identity is None:
                self.instruments.errors.labels(AuthenticationFailed.code).inc()
                return
            while True:
                try:
                    request = codec.recv_frame(conn, self.limits, first_byte_timeout=self.idle_timeout,
                                               frame_timeout=self.frame_timeout, on_size=self._bytes_in.inc)
                except ProtocolError as exc:
                    self.instruments.errors.labels(type(exc).code).inc()
                    codec.send_frame(conn, error_result(type(exc), str(exc)))
                    _linger(conn)
                    return                        # the stream cannot be resynchronised
                except ConnectionError as exc:
                    if "mid-frame" in str(exc):   # a sender that half-closed may still read
                        codec.send_frame(conn, error_result(ProtocolError, f"truncated frame: {exc}"))
                    return
                identity = self.authz.current(identity)
                if identity is None:              # its token was revoked or rotated meanwhile
                    codec.send_frame(conn, {**error_result(AuthenticationFailed, "this connection's token was "
                                                           "revoked or rotated: connect again with a current token"),
                                            "refused": True})
                    _linger(conn)
                    return
                self._bytes_out.inc(codec.send_frame(conn, self.handle(request, identity)))
        except (ConnectionError, OSError) as exc:
            log.debug("client connection closed: %s", exc)
        finally:
            conn.close()
            self._release(ip)

    def _start_tls(self, conn: socket.socket) -> ssl.SSLSocket | None:
        """The TLS handshake, or a plain-text refusal to a client that did not start one."""
        first = conn.recv(1, socket.MSG_PEEK)
        if not first:
            return None
        if first[0] != TLS_RECORD_HANDSHAKE:
            codec.send_frame(conn, error_result(TLSRequired, "this node serves its client port over TLS only: "
                                                "connect with Client(..., tls=CA_FILE) or set RAFTPS_TLS_CA"))
            return None
        try:
            return self.tls.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.info("TLS handshake failed: %s", exc)
            return None

    def _hello(self, conn: socket.socket) -> Identity | None:
        """Read the hello (tiny frames only) and return the identity its token names; refuse with
        a reason (and return None) otherwise."""
        try:
            hello = codec.recv_frame(conn, HELLO_LIMITS, frame_timeout=self.frame_timeout)
        except ProtocolError as exc:
            codec.send_frame(conn, error_result(AuthenticationFailed, f"expected a hello frame first: {exc}"))
            return None
        except ConnectionError as exc:
            if "mid-frame" in str(exc):       # a sender that half-closed may still read
                codec.send_frame(conn, error_result(AuthenticationFailed, f"expected a hello frame first: "
                                                    f"truncated frame: {exc}"))
            return None
        if not (isinstance(hello, dict) and hello.get("op") == auth.HELLO):
            codec.send_frame(conn, error_result(AuthenticationFailed, "the first frame on a connection must be "
                                                "{'op': 'hello', 'token': ...}"))
            return None
        identity = self.authz.identify(hello.get("token"))
        if identity is None:
            why = "no client token given" if hello.get("token") is None else "wrong client token"
            codec.send_frame(conn, error_result(AuthenticationFailed, f"{why}: pass Client(..., token=...) or set "
                                                "RAFTPS_TOKEN / RAFTPS_TOKEN_FILE to the cluster's token"))
            return None
        codec.send_frame(conn, {"ok": True})
        return identity

    def handle(self, request: Any, identity: Identity) -> dict:
        op = request.get("op") if isinstance(request, dict) else None
        reply = self._handle(request, identity)
        # Labels only from known values: a client must not grow the metrics with op names of its own.
        outcome = "retry" if reply.get("retry") else reply.get("error") or "ok"
        known = isinstance(op, str) and (op in self._handlers or op in self._node_handlers)   # (a list is unhashable)
        self.instruments.requests.labels(op if known else "unknown", outcome).inc()
        if outcome not in ("ok", "retry"):
            self.instruments.errors.labels(outcome).inc()
        return reply

    def _handle(self, request: Any, identity: Identity) -> dict:
        try:
            if isinstance(request, dict) and isinstance(request.get("tensors"), dict) \
                    and len(request["tensors"]) > self.max_tensors_per_push:
                raise LimitExceeded(f"{len(request['tensors'])} tensors in one {request.get('op')!r} exceeds "
                                    f"max_tensors_per_push={self.max_tensors_per_push}")
            request = ops.current_names(request)  # a field sent under its old name, renamed (ops.py)
            ops.check_request(request)            # every field's type, range and length, before anything runs
            op = request["op"]
            if op not in self._handlers and op not in self._node_handlers:
                raise InvalidRequest(f"op {op!r} is not served here "
                                     f"(known: {sorted(set(self._handlers) | set(self._node_handlers))})")
            rbac.authorize(identity, request)     # every name the request carries, before it runs
            if op in self._node_handlers:
                return self._node_handlers[op](request, identity)
            replica = self.replicas.get(request.get("raft_group", 0))
            if replica is None and self.layout is not None and request.get("raft_group", 0) < self.layout.groups:
                return self._elsewhere(request.get("raft_group", 0))
            return self._handlers[op](self._replica(request), request, identity)
        except RaftpsError as exc:
            reply = exception_result(exc)
            if not getattr(exc, "submitted", False):
                reply["refused"] = True           # never proposed: the client may reuse its seq
            return reply
        except Exception as exc:     # a bug must cost one request, not the node
            log.exception("request failed")
            return {"error": "Internal", "message": f"internal error: {exc!r}"}

    def _replica(self, request: dict) -> RaftNode:
        raft_group = request.get("raft_group", 0)
        node = self.replicas.get(raft_group)
        if node is None:
            hosted = sorted(self.replicas)
            raise InvalidRequest(f"this node hosts Raft groups {hosted}, not {raft_group}: ask a member of Raft "
                                 f"group {raft_group} (the client finds them with the layout op)")
        return node

    def _elsewhere(self, raft_group: int) -> dict:
        """A request for a Raft group this node does not host (a client routed by an old layout,
        the group's replica moved away: hosting.py): sent on to a member the layout names."""
        members = [offset_address(self.layout.nodes[m - 1], self.client_offset) for m in self.layout.members(raft_group)]
        return retry(f"this node does not host Raft group {raft_group}; its members are {', '.join(members)}",
                     not_leader=True, leader=members[0] if members else None)

    def close(self) -> None:
        codec.close_listener(self.sock)


def _linger(conn: socket.socket, max_bytes: int = 8 << 20, seconds: float = 1.0) -> None:
    """After an error reply: read and drop what the client is still sending (bounded), so that
    closing does not reset the connection before the client has read why."""
    try:
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + seconds
        while max_bytes > 0 and (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            chunk = conn.recv(min(max_bytes, 1 << 20))
            if not chunk:
                return
            max_bytes -= len(chunk)
    except OSError:
        pass


def _refuse(conn: socket.socket, reply: dict) -> None:
    """Tell a connection we will not serve why, without letting it stall the accept thread."""
    try:
        conn.settimeout(1.0)
        codec.send_frame(conn, reply)
        conn.shutdown(socket.SHUT_WR)
        conn.setblocking(False)
        conn.recv(1 << 16)          # its hello, if here: closing with unread bytes would send RST
    except OSError:                 # and the client could lose the refusal
        pass
    finally:
        conn.close()
