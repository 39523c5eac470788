"""The raftps client: finds the leader, retries across failures, keeps every write exactly-once.

Each Client is a new session (a random client id, never reused) and numbers its writes 1, 2, ...
A write is retried with the same (client id, seq) until it gets a definite answer or the
client's timeout passes, so a retry after a lost reply or a leader change is applied once.
"""
from __future__ import annotations

import os
import random
import socket
import ssl
import threading
import time
import uuid
from typing import Any, Iterable

import numpy as np

from . import auth, codec
from .errors import AuthenticationFailed, ProtocolError, RaftpsError, StepTimeout, Unavailable, raise_for

# Retries back off from 20 ms to this. During an election every follower answers "no leader"
# at once, so a long pause only adds to failover time (a 0.5 s cap added up to 0.5 s to it).
MAX_RETRY_PAUSE = 0.1


def parse_addresses(addresses: str | Iterable[str] | None) -> list[str]:
    if addresses is None:
        addresses = os.environ.get("RAFTPS_CLUSTER", "")
    if isinstance(addresses, str):
        addresses = addresses.split(",")
    out = [a.strip() for a in addresses if a and a.strip()]
    if not out:
        raise ValueError("no cluster addresses: pass 'host:port,...' or set RAFTPS_CLUSTER")
    for a in out:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad address {a!r}: expected host:port")
    return out


def _refusal(sock: socket.socket, limits: codec.Limits) -> dict | None:
    """The error a node sent before it stopped reading our request (a frame over one of its
    limits, say), if it is there to read."""
    try:
        sock.settimeout(1.0)
        reply = codec.recv_frame(sock, limits)
    except (OSError, ConnectionError, ProtocolError):
        return None
    return reply if isinstance(reply, dict) and (reply.get("error") or reply.get("retry")) else None


class Client:
    """``token``: the cluster's client token (default $RAFTPS_TOKEN, else the file named by
    $RAFTPS_TOKEN_FILE). ``tls``: a CA file to verify the nodes' certificates against (or True
    for the system CAs; default $RAFTPS_TLS_CA), for nodes serving TLS."""

    def __init__(self, addresses: str | Iterable[str] | None = None, timeout: float = 30.0,
                 attempt_timeout: float = 4.0, limits: codec.Limits = codec.DEFAULT_LIMITS,
                 token: str | None = None, tls: str | bool | ssl.SSLContext | None = None):
        self.addresses = parse_addresses(addresses)
        self.token = auth.client_token(token)
        self.tls = auth.client_tls_context(tls)
        self.timeout = timeout
        self.attempt_timeout = attempt_timeout
        self.limits = limits
        self.client_id = uuid.uuid4().hex
        self._seq = 0
        self._lock = threading.RLock()
        self._conns: dict[str, socket.socket] = {}
        self._leader: str | None = None
        self._rotation = random.randrange(len(self.addresses))

    # ---- transport ------------------------------------------------------------------------

    def _conn(self, address: str) -> socket.socket:
        sock = self._conns.get(address)
        if sock is None:
            host, port = address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=min(2.0, self.attempt_timeout))
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

    def _drop(self, address: str) -> None:
        sock = self._conns.pop(address, None)
        if sock is not None:
            sock.close()

    def _call(self, address: str, message: dict, timeout: float) -> dict:
        sock = self._conn(address)
        try:
            sock.settimeout(timeout)
            try:
                codec.send_frame(sock, message)
            except OSError:
                reply = _refusal(sock, self.limits)
                if reply is None:
                    raise
                self._drop(address)
                return reply
            reply = codec.recv_frame(sock, self.limits)
        except BaseException:
            self._drop(address)      # a half-read reply leaves the stream unusable
            raise
        if not isinstance(reply, dict):
            self._drop(address)
            raise ProtocolError(f"node {address} sent a reply that is not a map")
        return reply

    def _next_address(self) -> str:
        self._rotation = (self._rotation + 1) % len(self.addresses)
        return self.addresses[self._rotation]

    def _request(self, message: dict, to_leader: bool = True, attempt_timeout: float | None = None) -> dict:
        """Send until a definite reply; raise its error, or Unavailable at the deadline."""
        deadline = time.monotonic() + self.timeout
        attempt_timeout = attempt_timeout or self.attempt_timeout
        target = self._leader if to_leader and self._leader else self._next_address()
        last_problem = "no attempt made"
        pause = 0.02
        uncertain = False       # an attempt may have reached a log (no answer, or "unknown")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"{message['op']}: no definite answer from {','.join(self.addresses)} "
                                  f"within {self.timeout:.1f} s (last: {last_problem})")
            try:
                reply = self._call(target, message, min(left, attempt_timeout))
            except AuthenticationFailed as exc:     # at the hello: this attempt sent nothing
                exc.refused = not uncertain
                raise
            except (OSError, ConnectionError) as exc:
                uncertain = True
                last_problem = f"{target}: {exc or type(exc).__name__}"
                if target == self._leader:
                    self._leader = None
                target = self._next_address()
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, MAX_RETRY_PAUSE)
                continue
            if not reply.get("retry"):
                if to_leader:
                    self._leader = target
                if uncertain:         # an earlier attempt may have reached a log: not "refused"
                    reply.pop("refused", None)
                return raise_for(reply)
            last_problem = f"{target}: {reply.get('message', 'retry')}"
            if reply.get("not_leader") or reply.get("behind"):
                leader = reply.get("leader")
                if leader and leader not in self.addresses:
                    self.addresses.append(leader)     # a node we were not told of: follow it
                if leader and leader != target and to_leader:
                    target = self._leader = leader
                    continue
                target = self._next_address()
            elif reply.get("unknown"):
                uncertain = True
                # That node could not commit in its request timeout: likely cut off from the others.
                if target == self._leader:
                    self._leader = None
                target = self._next_address()
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, MAX_RETRY_PAUSE)

    def _write(self, op: str, **fields: Any) -> dict:
        with self._lock:
            self._seq += 1
            # One request at a time per client, so every earlier seq has been answered: ack = seq.
            try:
                return self._request({"op": op, "client": self.client_id, "seq": self._seq, "ack": self._seq,
                                      **fields})
            except RaftpsError as exc:
                # Refused by the node before it reached any log (schema, role, limit): the seq was
                # never used, so the next write takes it. Otherwise the store would see this
                # client's first write with ack > 1 and no session, and answer SessionExpired.
                if getattr(exc, "refused", False):
                    self._seq -= 1
                raise

    # ---- the API --------------------------------------------------------------------------

    def create(self, name: str, array: np.ndarray, optimizer: dict) -> int:
        """Create a tensor with its optimizer; the same call again is a no-op."""
        return self.create_many({name: array}, {name: optimizer})

    def create_many(self, tensors: dict[str, np.ndarray], optimizers: dict[str, dict]) -> int:
        """Create several tensors in one write (each with its optimizer spec); existing ones
        with the same shape, dtype and optimizer are left as they are."""
        return self._write("create", tensors={k: np.asarray(v) for k, v in tensors.items()},
                           optimizer=dict(optimizers))["version"]

    def create_result(self, tensors: dict[str, np.ndarray], optimizers: dict[str, dict]) -> dict:
        """As create_many, but the whole result: version and ``created`` (the names that did not exist)."""
        return self._write("create", tensors={k: np.asarray(v) for k, v in tensors.items()},
                           optimizer=dict(optimizers))

    def push(self, grads: dict[str, np.ndarray], base_version: int | None = None,
             encoding: dict | None = None, ssp: dict | None = None) -> int:
        """Apply one gradient per tensor, atomically, exactly once; returns the store version.
        ``encoding``: compressed tensors (raftps.compress); ``ssp``: {group, worker} (SSP gate)."""
        return self.push_result(grads, base_version, encoding, ssp)["version"]

    def push_result(self, grads: dict[str, np.ndarray], base_version: int | None = None,
                    encoding: dict | None = None, ssp: dict | None = None) -> dict:
        """As push, but the whole result: version, staleness (with a base), clock (with ssp)."""
        fields: dict[str, Any] = {"tensors": {k: np.asarray(v) for k, v in grads.items()}}
        if base_version is not None:
            fields["base_version"] = int(base_version)
        if encoding is not None:
            fields["encoding"] = encoding
        if ssp is not None:
            fields["ssp"] = ssp
        return self._write("push", **fields)

    def assign(self, values: dict[str, np.ndarray]) -> int:
        return self._write("assign", tensors={k: np.asarray(v) for k, v in values.items()})["version"]

    def delete(self, names: list[str]) -> int:
        return self._write("delete", names=list(names))["version"]

    def push_sync(self, grads: dict[str, np.ndarray], step: int, workers: int, group: str | None = None,
                  rank: int | None = None) -> int:
        """One worker's contribution to synchronous step ``step`` of sync group ``group`` (a job's
        name; None: the store-wide default group); the mean of ``workers`` contributions is applied
        once, when the last one arrives. With ``rank`` (0 <= rank < workers) the step counts
        distinct ranks: a rank's second contribution (a restarted worker) is ignored."""
        return self.push_sync_result(grads, step, workers, group, rank)["version"]

    def push_sync_result(self, grads: dict[str, np.ndarray], step: int, workers: int, group: str | None = None,
                         rank: int | None = None) -> dict:
        """As push_sync, but the whole result: version, step, applied, count, and late (the step
        was applied before) or duplicate_rank (this rank had contributed; nothing changed)."""
        fields: dict[str, Any] = {"tensors": {k: np.asarray(v) for k, v in grads.items()},
                                  "step": int(step), "workers": int(workers)}
        if group is not None:
            fields["group"] = group
        if rank is not None:
            fields["rank"] = int(rank)
        return self._write("push_sync", **fields)

    def close_step(self, step: int, group: str | None = None) -> int:
        """Apply sync step ``step`` of ``group`` now with the contributions that arrived (no-op if applied)."""
        fields: dict[str, Any] = {"step": int(step)}
        if group is not None:
            fields["group"] = group
        return self._write("close_step", **fields)["version"]

    def wait_step(self, step: int, timeout: float, group: str | None = None) -> int:
        """Block until sync step ``step`` of ``group`` is applied; returns the store version then."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            request: dict[str, Any] = {"op": "wait_step", "step": int(step), "timeout": max(0.0, min(left, 5.0))}
            if group is not None:
                request["group"] = group
            try:
                with self._lock:
                    return self._request(request, attempt_timeout=min(left, 5.0) + 5.0)["version"]
            except StepTimeout:
                if deadline - time.monotonic() <= 0:
                    raise

    def sync_applied(self, group: str | None = None) -> int:
        """The last applied sync step of ``group`` (-1 if none), a linearizable read at the leader."""
        request: dict[str, Any] = {"op": "sync_applied"}
        if group is not None:
            request["group"] = group
        with self._lock:
            return self._request(request)["applied"]

    # ---- SSP groups (bounded staleness) -------------------------------------------------------

    def ssp_join(self, group: str, worker: str, staleness: int | None) -> int:
        """Join SSP group ``group`` (created with bound ``staleness``; None: unbounded); returns the clock."""
        return self._write("ssp_join", group=group, worker=worker, staleness=staleness)["clock"]

    def ssp_leave(self, group: str, worker: str) -> bool:
        return self._write("ssp_leave", group=group, worker=worker)["left"]

    def ssp_drop(self, group: str, worker: str, clock: int) -> bool:
        """Drop ``worker`` from the group if its clock is still ``clock`` (it made no progress)."""
        return self._write("ssp_drop", group=group, worker=worker, clock=int(clock))["dropped"]

    def ssp_wait(self, group: str, worker: str, timeout: float) -> dict:
        """Wait (at the leader, at most ``timeout`` s) until ``worker`` may take its next step:
        {version, ready, member, clock, min_clock, slowest: [[worker, clock], ...]}."""
        with self._lock:
            return self._request({"op": "ssp_wait", "group": group, "worker": worker, "timeout": float(timeout)},
                                 attempt_timeout=float(timeout) + 5.0)

    def pull(self, names: list[str] | None = None, min_version: int | None = None,
             linearizable: bool = True) -> tuple[dict[str, np.ndarray], int]:
        """Tensors and the store version they are at. Linearizable reads are served by the leader
        (ReadIndex, or a barrier entry: serve --read-mode); others by any node that has applied
        at least ``min_version``."""
        reply = self.pull_result(names, min_version, linearizable)
        return reply["tensors"], reply["version"]

    def pull_result(self, names: list[str] | None = None, min_version: int | None = None,
                    linearizable: bool = True) -> dict:
        """As pull, but the whole reply: tensors, version and tensor_versions (each tensor's own
        update count, read from the same state as the tensors)."""
        request = {"op": "pull", "names": list(names) if names is not None else None,
                   "linearizable": linearizable, "min_version": min_version or 0}
        with self._lock:
            return self._request(request, to_leader=linearizable)

    def pull_rows(self, name: str, rows: Any, min_version: int | None = None,
                  linearizable: bool = True) -> tuple[np.ndarray, int]:
        """Rows ``rows`` (integers in [0, rows of the tensor), any order) of tensor ``name`` and
        the store version they are at; the reply's size grows with len(rows), not the table."""
        rows = np.asarray(rows)
        if rows.size == 0 or rows.dtype.kind in "iu" and rows.dtype not in (np.int32, np.int64):
            rows = rows.astype(np.int64)      # the store takes int32 or int64; others are refused there
        request = {"op": "pull_rows", "name": name, "rows": rows, "linearizable": linearizable,
                   "min_version": min_version or 0}
        with self._lock:
            reply = self._request(request, to_leader=linearizable)
        return reply["rows"], reply["version"]

    def tensors(self, prefix: str | None = None) -> list[dict]:
        """Name, dtype, shape, version and optimizer of every tensor (from the leader) whose name
        starts with ``prefix`` and that this client's token may read."""
        request: dict[str, Any] = {"op": "tensors"}
        if prefix:
            request["prefix"] = prefix
        with self._lock:
            return self._request(request)["tensors"]

    def export(self, prefix: str) -> dict:
        """Every tensor whose name starts with ``prefix`` (a plain string prefix), in one
        linearizable read at the leader: tensors, tensor_versions, optimizers, version, and the
        store's digest at that version."""
        with self._lock:
            return self._request({"op": "export", "prefix": prefix})

    def snapshot(self) -> dict:
        """The whole store at one version: {version, digest, snapshot} (``TensorStore.snapshot()``
        form). A store beyond this client's ``limits`` (1 GiB, 4096 arrays by default) needs a
        Client with larger ones (``raftps snapshot save`` makes one)."""
        with self._lock:
            return self._request({"op": "snapshot"})

    def members(self, action: str = "list", node: str | None = None, old: str | None = None) -> dict:
        """Cluster membership (Raft addresses): ``list``, or ``add`` / ``remove`` ``node``, or
        ``replace`` ``old`` with ``node``. Returns members and, for changes, ``changed``."""
        with self._lock:
            return self._request({"op": "member", "action": action, "node": node, "old": old},
                                 attempt_timeout=max(self.attempt_timeout, 25.0))

    def stats(self) -> dict:
        with self._lock:
            return self._request({"op": "stats"})

    def status(self, timeout: float = 2.0, digest: bool = True) -> list[dict]:
        """One dict per node (node, address, role, term, applied, digest, ...); 'down' if unreachable.
        ``digest=False``: no digest (each node hashes its whole store for it)."""
        out = []
        with self._lock:
            for number, address in enumerate(self.addresses, 1):
                try:
                    out.append(self._call(address, {"op": "status", "digest": digest}, timeout))
                except (OSError, ConnectionError, ProtocolError) as exc:
                    out.append({"node": number, "address": address, "role": "down", "term": None,
                                "applied": None, "digest": None, "error": str(exc) or type(exc).__name__})
        return out

    def close(self) -> None:
        with self._lock:
            for address in list(self._conns):
                self._drop(address)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
