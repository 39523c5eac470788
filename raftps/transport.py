"""How a Client's requests reach a node: ``call(address, message, timeout) -> reply``.

``TcpTransport`` keeps one connection per node (TLS if asked for, then the hello every connection
starts with). ``InProcessTransport`` hands each request to a ``ClientServer`` in this process by
its address, through the same frame encoding and the same checks, with no socket: for tests.

A transport raises OSError/ConnectionError when a node cannot be reached (the caller tries
another), AuthenticationFailed when its token is refused, and returns every other answer.
"""
from __future__ import annotations

import socket
import ssl
from typing import TYPE_CHECKING, Protocol

from . import auth, codec
from .errors import AuthenticationFailed, ProtocolError, raise_for

if TYPE_CHECKING:
    from .server import ClientServer


class Transport(Protocol):
    def call(self, address: str, message: dict, timeout: float) -> dict: ...

    def close(self) -> None: ...


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
        sock = self._conns.pop(address, None)
        if sock is not None:
            sock.close()

    def call(self, address: str, message: dict, timeout: float) -> dict:
        sock = self._conn(address)
        try:
            sock.settimeout(timeout)
            try:
                codec.send_frame(sock, message)
            except OSError:
                reply = _refusal(sock, self.limits)
                if reply is None:
                    raise
                self.drop(address)
                return reply
            reply = codec.recv_frame(sock, self.limits)
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
