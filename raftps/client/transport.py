"""How a Client's requests reach a node: ``call(address, message, timeout) -> reply``.

``TcpTransport`` keeps one connection per node (TLS if asked for, then the hello every connection
starts with). ``InProcessTransport`` hands each request to a ``ClientServer`` in this process by
its address, through the same frame encoding and the same checks, with no socket: for tests.

A transport raises OSError/ConnectionError when a node cannot be reached (the caller tries
another), AuthenticationFailed when its token is refused, and returns every other answer.
"""
from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

from raftps import auth, codec
from raftps.errors import AuthenticationFailed, ProtocolError, raise_for
from raftps.sockets import SEND_CHUNK, drain, send_chunked

if TYPE_CHECKING:
    from raftps.server.server import ClientServer


class Transport(Protocol):
    def call(self, address: str, message: dict, timeout: float) -> dict: ...

    def close(self) -> None: ...


# After its last byte, a write's answer may take this many times the request's send duration
# more: the leader forwards the payload to its peers (a majority must hold it before it commits),
# over a link about as fast as the one it arrived on, shared by its two peers' copies.
FORWARD_ALLOWANCE = 3.0
# A request of at least this many bytes whose answer is late is waited for on its connection
# (AnswerLate) rather than sent again; a smaller one is sent again, as its bytes cost little.
LATE_WAIT_BYTES = 1 << 20


_sent = threading.local()


@contextlib.contextmanager
def when_sent(callback: Callable[[], None]) -> Iterator[None]:
    """Within the block, this thread's TcpTransport calls ``callback()`` each time a request that
    carries tensors has its last byte at the node (before its answer): a chunked step (job_steps.py) starts
    its next chunk then, so that chunks cross a link one after another, each answered while the
    next arrives, instead of sharing it and all ending together."""
    _sent.callback = callback
    try:
        yield
    finally:
        _sent.callback = None


class AnswerLate(socket.timeout):
    """A node took a whole request and has not answered yet; the connection stays open, and the
    same request to it next waits for this answer rather than sending its bytes again."""


def _identity(message: dict) -> tuple | None:
    """What makes two sends the same write (its client and seq), or None for a read."""
    if "client" in message and "seq" in message:
        return message.get("op"), message.get("client"), message.get("seq"), message.get("raft_group")
    return None


def _readable(sock: socket.socket, seconds: float) -> bool:
    """Whether ``sock`` has bytes to read within ``seconds`` (nothing is consumed)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    return bool(select.select([sock], [], [], max(0.0, seconds))[0])


def _refusal(sock: socket.socket, limits: codec.Limits) -> dict | None:
    """The error a node sent before it stopped reading our request (a frame over one of its
    limits, say), if it is there to read."""
    try:
        sock.settimeout(1.0)
        reply = codec.recv_frame(sock, limits)
    except (OSError, ConnectionError, ProtocolError):
        return None
    return reply if isinstance(reply, dict) and (reply.get("error") or reply.get("retry")) else None


class TcpTransport:
    """One connection per node address, opened on first use and dropped on any failure."""

    def __init__(self, token: str | None, tls: ssl.SSLContext | None, limits: codec.Limits,
                 connect_timeout: float):
        self.token, self.tls, self.limits = token, tls, limits
        self.connect_timeout = connect_timeout
        self._conns: dict[str, socket.socket] = {}
        self._awaiting: dict[str, tuple] = {}     # address -> (write, send seconds) whose answer is late

    def _conn(self, address: str) -> socket.socket:
        sock = self._conns.get(address)
        if sock is None:
            host, port = address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=self.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                sock = self._hello(sock, address, host)
            except BaseException:
                sock.close()
                raise
            self._conns[address] = sock
        return sock

    def _hello(self, sock: socket.socket, address: str, host: str) -> socket.socket:
        """TLS (if asked for) and the hello every connection starts with. A refusal raises
        AuthenticationFailed (definite: retrying with the same token cannot help)."""
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_hostname=host)
            except ssl.SSLCertVerificationError as exc:
                raise AuthenticationFailed(f"node {address}: its TLS certificate does not verify "
                                           f"against the CA given as tls=: {exc.verify_message}") from None
            except ssl.SSLError as exc:
                raise AuthenticationFailed(f"node {address}: TLS handshake failed ({exc.reason}); does the "
                                           "node serve TLS on its client port (serve --tls-cert)?") from None
        try:
            codec.send_frame(sock, {"op": auth.HELLO, "token": self.token})
        except OSError:
            reply = _refusal(sock, self.limits)     # refused at accept (connection limits)
            if reply is None:
                raise
        else:
            reply = codec.recv_frame(sock, self.limits)
        if not isinstance(reply, dict):
            raise ProtocolError(f"node {address} answered the hello with something that is not a map")
        if reply.get("retry"):
            raise ConnectionError(f"node {address}: {reply.get('message', 'retry')}")
        raise_for(reply)
        return sock

    def drop(self, address: str) -> None:
        self._awaiting.pop(address, None)
        sock = self._conns.pop(address, None)
        if sock is not None:
            sock.close()

    def call(self, address: str, message: dict, timeout: float) -> dict:
        """One request and its reply. ``timeout`` bounds each stall, not the whole: sending may
        take as long as the bytes need while they keep moving (each chunk of SEND_CHUNK within
        ``timeout``, then the peer acknowledges the rest: ``drain``), and the reply may take ``timeout`` after the last byte went out plus
        FORWARD_ALLOWANCE times the send's duration (the leader forwards a payload to its peers
        at about the rate it arrived). A reply still missing then raises AnswerLate and leaves the
        connection open: the same request to the same node next waits for that reply instead of
        sending its bytes again."""
        key = _identity(message)
        if self._awaiting.get(address) is not None and self._awaiting[address][0] != key:
            self.drop(address)      # a late reply to another request would come first
        sock = self._conn(address)
        try:
            if address in self._awaiting:
                sent_for = self._awaiting[address][1]
            else:
                buffers = codec.encode(message)
                sock.settimeout(timeout)
                started = time.monotonic()
                size = sum(len(b) for b in buffers)
                if size < LATE_WAIT_BYTES:
                    key = None
                try:
                    send_chunked(sock, buffers)
                    if size >= SEND_CHUNK:   # a small request's ACK may wait for its answer (delayed ACK)
                        drain(sock, timeout)
                except OSError:
                    reply = _refusal(sock, self.limits)
                    if reply is None:
                        raise
                    self.drop(address)
                    return reply
                sent_for = time.monotonic() - started
                callback = getattr(_sent, "callback", None)
                if callback is not None and "tensors" in message:   # not a status asked on the way
                    callback()
            wait = timeout + FORWARD_ALLOWANCE * sent_for
            if not _readable(sock, wait):
                if key is None:
                    raise socket.timeout(f"node {address}: no answer within {wait:.1f} s")
                self._awaiting[address] = (key, sent_for)
                raise AnswerLate(f"node {address} took the whole request but has not answered within {wait:.1f} s")
            self._awaiting.pop(address, None)
            sock.settimeout(timeout)                # the reply's bytes: each recv within timeout
            reply = codec.recv_frame(sock, self.limits)
        except AnswerLate:
            raise
        except BaseException:
            self.drop(address)      # a half-read reply leaves the stream unusable
            raise
        if not isinstance(reply, dict):
            self.drop(address)
            raise ProtocolError(f"node {address} sent a reply that is not a map")
        return reply

    def close(self) -> None:
        for address in list(self._conns):
            self.drop(address)


class InProcessTransport:
    """Requests to ClientServers of this process, by their client address: the request and its
    reply go through the frame encoding (so arrays are copies, as over a socket) and the
    server's own checks (token, schema, role), but no socket."""

    def __init__(self, servers: dict[str, "ClientServer"], token: str | None, limits: codec.Limits):
        self.servers, self.token, self.limits = servers, token, limits

    def call(self, address: str, message: dict, timeout: float) -> dict:
        server = self.servers.get(address)
        if server is None:
            raise ConnectionRefusedError(f"no in-process node at {address}")
        identity = server.authz.identify(self.token)
        if identity is None:
            raise AuthenticationFailed(f"node {address}: wrong client token")
        # bytearrays, as a socket's frames arrive in: the arrays decoded over them are writable
        request = codec.decode(bytearray(codec.encode_bytes(message)), server.limits)
        reply = codec.decode(bytearray(codec.encode_bytes(server.handle(request, identity))), self.limits)
        if not isinstance(reply, dict):
            raise ProtocolError(f"node {address} sent a reply that is not a map")
        return reply

    def close(self) -> None:
        pass
