"""Credentials: the cluster secret (peers), the client token, and TLS contexts for the client port.

The secret and the token are separate files on purpose: a trainer host needs the token, never the
secret (the secret lets its holder act as a node: propose entries, send payloads).
"""
from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import ssl

MIN_SECRET_BYTES = 16
HELLO = "hello"


def make_secret_file(path: str) -> str:
    """Create ``path`` with 32 random bytes (hex) readable by its owner only, unless it exists."""
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path


def read_secret_file(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def client_token(token: str | None = None) -> str | None:
    """The token a client presents: ``token``, else $RAFTPS_TOKEN, else the file $RAFTPS_TOKEN_FILE."""
    if token is not None:
        return token
    if os.environ.get("RAFTPS_TOKEN"):
        return os.environ["RAFTPS_TOKEN"]
    if os.environ.get("RAFTPS_TOKEN_FILE"):
        return read_secret_file(os.environ["RAFTPS_TOKEN_FILE"])
    return None


def token_matches(expected: str, presented: object) -> bool:
    """Constant-time comparison, so the reply's timing says nothing about how much matched."""
    return isinstance(presented, str) and hmac.compare_digest(expected.encode(), presented.encode())


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


def client_tls_context(tls: str | bool | ssl.SSLContext | None) -> ssl.SSLContext | None:
    """``tls``: a CA file path (a private cluster CA), True (the system's CAs), a ready context,
    or None/False for a plain connection; None also reads $RAFTPS_TLS_CA."""
    if tls is None:
        tls = os.environ.get("RAFTPS_TLS_CA") or None
    if tls is None or tls is False:
        return None
    if isinstance(tls, ssl.SSLContext):
        return tls
    ctx = ssl.create_default_context(cafile=None if tls is True else tls)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
