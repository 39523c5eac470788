"""The client port of a node: length-prefixed codec frames, one request and one reply at a time
per connection, a thread per connection (bounded in total and per client IP). Writes and
linearizable reads are served by the leader; a follower answers them with the leader's address.
Bad bytes close the connection with an error frame and touch nothing else.

Every connection starts (after TLS, if the node serves it) with a hello frame carrying a client
token: the cluster's, or a named identity's (rbac.py). Until the hello passes, the node reads only
tiny frames and serves nothing, so a client without a token can make it allocate nothing and
learns nothing but the refusal. Then every request is checked against its op's schema
(schema.py) and against the identity's roles (rbac.py) before anything else runs; a request
refused there never reaches Raft, and its reply says so (``refused``).
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable

from . import auth, codec, ops, rbac, schema
from .aggregate import StepAggregator
from .errors import (AuthenticationFailed, InvalidRequest, LimitExceeded, ProtocolError, RaftpsError,
                     TLSRequired, error_result, exception_result)
from .machine import snapshot_digest
from .tensor import check_finite, check_group, check_tensors
from .groups import Layout
from .metrics import ServerInstruments
from .node import RaftNode, offset_address
from .raft import NotApplied
from .rbac import Identity

log = logging.getLogger("raftps.server")
# the writes through Raft that _write serves as they are (the others: _push_step, _move_write, _parts_write)
WRITES = tuple(name for name, op in ops.OPS.items() if op.serve == "_write")
HELLO_LIMITS = codec.Limits(max_header_bytes=4096, max_blob_bytes=0, max_arrays=0)
TLS_RECORD_HANDSHAKE = 0x16          # the first byte of every TLS ClientHello


def _retry(message: str, **extra: Any) -> dict:
    return {"error": "Retry", "retry": True, "message": message, **extra}


def _submit(node: RaftNode, command: dict, tensors: dict | None) -> dict:
    """Replicate a checked write: the state machine's answer, or Retry if it did not commit."""
    try:
        return node.submit(command, tensors)
    except NotApplied as outcome:
        return _retry(str(outcome), unknown=outcome.applied is None)
    except RaftpsError as exc:
        exc.submitted = True          # proposed: the client must not reuse its seq
        raise


class ClientServer:
    def __init__(self, replicas: RaftNode | dict[int, RaftNode], host: str, port: int,
                 authorizer: rbac.Authorizer | None = None, layout: Layout | None = None, client_offset: int = 100):
        """``replicas``: this node's replica of each Raft group it hosts (one RaftNode: group 0
        of a one-group cluster). Requests name their group (``raft_group``, default 0)."""
        self.replicas = replicas if isinstance(replicas, dict) else {0: replicas}
        self.node = node = self.replicas[min(self.replicas)]   # the node's first replica: its config
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
        self._node_handlers: dict[str, Callable[[dict, Identity], dict]] = {
            op: getattr(self, method) for op, method in ops.served_by_node().items()}
        self._handlers: dict[str, Callable[[RaftNode, dict, Identity], dict]] = {
            op: getattr(self, method) for op, method in ops.served_by_replica().items()}
        # each replica's open sync steps while it leads (aggregate.py)
        self._aggregators = {g: StepAggregator(node) for g, node in self.replicas.items()}
        threading.Thread(target=self._accept, name="client-accept", daemon=True).start()

    def _admit(self, ip: str) -> dict | None:
        """Count a new connection from ``ip``, or the refusal to send it."""
        with self._open_lock:
            if sum(self._open.values()) >= self.max_connections:
                return _retry(f"node is at max_connections={self.max_connections}; try another node")
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
            schema.check_request(request)         # every field's type, range and length, before anything runs
            op = request["op"]
            if op not in self._handlers and op not in self._node_handlers:
                raise InvalidRequest(f"op {op!r} is not served here "
                                     f"(known: {sorted(set(self._handlers) | set(self._node_handlers))})")
            rbac.authorize(identity, request)     # every name the request carries, before it runs
            if op in self._node_handlers:
                return self._node_handlers[op](request, identity)
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
        group = request.get("raft_group", 0)
        node = self.replicas.get(group)
        if node is None:
            hosted = sorted(self.replicas)
            raise InvalidRequest(f"this node hosts Raft groups {hosted}, not {group}: ask a member of group "
                                 f"{group} (the client finds them with the layout op)")
        return node

    def _status(self, req: dict, identity: Identity) -> dict:
        """This node's row for its first group; with several groups, ``groups`` has a row per
        hosted group (each with its ``group``)."""
        digest = req.get("digest", True) is not False
        rows = [{**node.status(digest=digest), "group": g, "open_steps": self._aggregators[g].open_steps()}
                for g, node in sorted(self.replicas.items())]
        return {**rows[0], "connections": self.open_connections(), **({"groups": rows} if len(rows) > 1 else {})}

    def _layout(self, req: dict, identity: Identity) -> dict:
        """How many Raft groups, which nodes are members of each, and every node's client address."""
        offset = self.client_offset
        if self.layout is None:
            return {"groups": 1, "nodes": [], "members": [[]]}
        return {"groups": self.layout.groups,
                "nodes": [offset_address(a, offset) for a in self.layout.nodes],
                "members": [self.layout.members(g) for g in range(self.layout.groups)]}

    def _not_leader(self, node: RaftNode) -> dict | None:
        if node.is_leader():
            return None
        leader = node.leader_client_address()
        return _retry(f"not the leader; leader is {leader or 'unknown'}", not_leader=True, leader=leader)

    def _write(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        # The schema checked client, seq, ack and every other field (schema.py).
        command = {k: v for k, v in req.items() if k != "tensors"}
        tensors = req.get("tensors")
        if tensors is not None:
            for name, arr in check_tensors(tensors).items():
                # Refused here so a NaN gradient costs no replication; the state machine checks again.
                check_finite(name, arr, "initial value" if req["op"] == "create" else
                             "value" if req["op"] == "assign" else "gradient")
        return _submit(node, command, tensors)

    def _push_step(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """A sync step contribution, summed on the leader with the step's others and answered
        when the step's one entry is applied (aggregate.py)."""
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        grads = check_tensors(req["tensors"])     # each checked against its tensor by the aggregator
        try:
            return self._aggregators[req.get("raft_group", 0)].contribute(req, grads)
        except NotApplied as outcome:
            return _retry(str(outcome), unknown=outcome.applied is None)

    def _check_move(self, req: dict) -> None:
        """What the state machine cannot know: the cluster's groups, and which one this is."""
        groups = self.layout.groups if self.layout is not None else 1
        if groups == 1:
            raise InvalidRequest(f"{req['op']}: this cluster has one Raft group: there is no other group to move "
                                 "tensors to (serve --groups G, G > 1)")
        here = req.get("raft_group", 0)
        if req["op"] == "place" and here != 0:
            raise InvalidRequest(f"place: the placement table lives in Raft group 0, not {here}")
        target = req.get("to", req.get("group", 0))
        if target >= groups:
            raise InvalidRequest(f"{req['op']}: Raft group {target} is out of range: this cluster has groups "
                                 f"0..{groups - 1}")
        if req["op"] in ("move_freeze", "move_done") and target == here:
            raise InvalidRequest(f"{req['op']}: tensor {req['name']!r} cannot move to the group it is in ({here})")

    def _move_write(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """A step of a move: like _write, but move_install's arrays are a tensor's data and
        optimizer state, named by part ("0", "0.m", ...), not tensors (the state machine checks them)."""
        self._check_move(req)
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        return _submit(node, {k: v for k, v in req.items() if k != "tensors"}, req.get("tensors"))

    def _parts_write(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """assign_state: like _write, but its arrays are named by part ("0", "0.m", ...), not
        tensors (the state machine checks each against its tensor)."""
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        return _submit(node, {k: v for k, v in req.items() if k != "tensors"}, req.get("tensors"))

    def _move_state(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """Where a tensor stands in this group (linearizable); ``full``: its frozen state to install."""
        self._check_move(req)
        reply = self._linearizable(node, lambda m: m.move_state(req["name"], req.get("full", False)))
        return {**reply, "max_frame_bytes": self.limits.max_blob_bytes}    # what this node accepts in a frame

    def _placement(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """Group 0's table of tensors placed elsewhere than their hash: the names the identity may read."""
        if req.get("raft_group", 0) != 0:
            raise InvalidRequest("placement: the placement table lives in Raft group 0")
        readable = None if identity.unrestricted else (lambda n: identity.allows("read", n))
        return self._linearizable(node, lambda m: {"version": m.version, "placement": {
            n: g for n, g in m.placement_table().items() if readable is None or readable(n)}})

    def _pull(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        names = req.get("names")
        readable = None if identity.unrestricted else (lambda n: identity.allows("read", n))
        if req.get("linearizable", True):
            read = self._linearizable(node, lambda m: m.read(names if names is not None or readable is None
                                                         else [n for n in sorted(m.tensors) if readable(n)]))
            if isinstance(read, dict):
                return read
            tensors, version = read
        else:
            behind = self._behind(node, req)
            if behind:
                return behind
            tensors, version = node.read(names)
            if names is None and readable is not None:        # all the identity may read
                tensors = {n: t for n, t in tensors.items() if readable(n)}
        return {"version": version,
                "tensors": {name: t.data for name, t in tensors.items()},
                "tensor_versions": {name: t.version for name, t in tensors.items()}}

    def _pull_rows(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """Some rows of one tensor, copied under the apply lock (or in the tick thread): O(rows)."""
        name, rows = req.get("name"), req.get("rows")

        def read(m: Any) -> dict:
            values, tensor_version, version = m.read_rows(name, rows)
            return {"version": version, "rows": values, "tensor_version": tensor_version}
        if req.get("linearizable", True):
            return self._linearizable(node, read)
        behind = self._behind(node, req)
        if behind:
            return behind
        return node.read_locked(read)

    def _behind(self, node: RaftNode, req: dict) -> dict | None:
        """A read from any node: None once this node has applied the request's min_version
        (waiting up to its ``wait``, at most 10 s), else the reply that sends the client on."""
        min_version = req.get("min_version") or 0
        if type(min_version) is not int:
            raise InvalidRequest("min_version must be an int")
        if node.wait_version(min_version, timeout=min(_seconds(req.get("wait", 2.0), "wait"), 10.0)):
            return None
        return _retry(f"this node has applied only up to {node.version} < {min_version}", behind=True)

    def _linearizable(self, node: RaftNode, fn: Callable[[Any], Any]) -> Any:
        """``fn(machine)``'s reply, run through the leader's log (see RaftNode.linearizable), or
        the reply that sends the client on."""
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        try:
            return node.linearizable(fn)
        except NotApplied as outcome:
            return _retry(str(outcome))

    def _tensors(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        # Metadata only, taken in the tick thread: no array leaves the state machine. Only the
        # tensors under ``prefix`` that the identity may read.
        prefix = req.get("prefix") or ""
        return self._linearizable(node, lambda m: {"version": m.version, "tensors": [
            {"name": n, "dtype": str(t.data.dtype), "shape": list(t.data.shape), "version": t.version,
             "optimizer": t.optimizer} for n, t in sorted(m.tensors.items())
            if n.startswith(prefix) and (identity.unrestricted or identity.allows("read", n))]})

    def _export(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """Every tensor whose name starts with ``prefix``, with the store's version and digest,
        all from one state read through the leader's log (``raftps export``)."""
        prefix = req.get("prefix")
        if not isinstance(prefix, str) or not prefix:
            raise InvalidRequest("export needs a non-empty 'prefix' string")

        def take(m: Any) -> dict:        # tick thread: no copy, no hashing
            return {"version": m.version, "snap": m.snapshot(),
                    "chosen": [(n, t) for n, t in sorted(m.tensors.items()) if n.startswith(prefix)]}
        out = self._linearizable(node, take)
        if "snap" not in out:
            return out                   # a redirect or a retry
        chosen = out["chosen"]
        return {"version": out["version"], "digest": snapshot_digest(out["snap"]),
                "tensors": {n: t.data for n, t in chosen}, "tensor_versions": {n: t.version for n, t in chosen},
                "optimizers": {n: t.optimizer for n, t in chosen},
                **({"states": {n: t.state for n, t in chosen}} if req.get("state") else {})}

    def _snapshot(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """The whole state machine at one version with its digest (``raftps snapshot save``):
        taken between two applies in the tick thread, hashed and encoded outside it."""
        out = self._linearizable(node, lambda m: {"version": m.version, "snap": m.snapshot()})
        if "snap" not in out:
            return out
        return {"version": out["version"], "digest": snapshot_digest(out["snap"]), "snapshot": out["snap"]}

    def _member(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """raftps member list|add|remove|replace: one Raft single-server change at a time, on
        the leader. Each step is idempotent, so a retried replace goes on where it stopped."""
        action = req.get("action")
        if action not in ("list", "add", "remove", "replace"):
            raise InvalidRequest("member needs action: list, add, remove or replace")
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        if action == "list":
            return {"members": node.members, "leader": node.config.raft_address}
        if self.layout is not None and self.layout.groups > 1:
            raise InvalidRequest("membership changes of a cluster of several Raft groups are not supported yet "
                                 "(the layout places groups by node number)")
        new = _raft_address(req.get("node"))
        old = _raft_address(req.get("old")) if action == "replace" else None
        if old == new:
            raise InvalidRequest(f"replace {old} with itself")
        try:
            if action != "replace":
                return node.change_members(action, new)
            # A live old member stays until the new one is in (a 3-node cluster keeps its majority
            # with one node down either way); a dead one goes first, so that the new member's
            # entry commits with the live ones before the new node is even up.
            steps = [("add", new), ("remove", old)] if node.is_connected(old) or \
                old == node.config.raft_address else [("remove", old), ("add", new)]
            changed = False
            for step, address in steps:
                changed = node.change_members(step, address)["changed"] or changed
            return {"changed": changed, "members": node.members}
        except NotApplied as outcome:
            return _retry(str(outcome), not_leader=not node.is_leader(), leader=None,
                          unknown=outcome.applied is None)

    def _stats(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        return self._not_leader(node) or node.stats()

    def _wait_step(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        step = req.get("step")
        if type(step) is not int:
            raise InvalidRequest("wait_step needs step (int) and timeout (seconds)")
        group = check_group(req.get("group"))
        return {"version": node.wait_step(step, min(_seconds(req.get("timeout", 10.0), "timeout"), 300.0), group)}

    def _sync_applied(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        group = check_group(req.get("group"))
        return self._linearizable(node, lambda m: {"version": m.version, "applied": m.sync_step_applied(group)})

    def _ssp_wait(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        group, worker = req.get("group"), req.get("worker")
        if not isinstance(group, str) or not isinstance(worker, str):
            raise InvalidRequest("ssp_wait needs group (str), worker (str) and timeout (seconds)")
        return node.wait_ssp(group, worker, min(_seconds(req.get("timeout", 10.0), "timeout"), 300.0))

    def close(self) -> None:
        codec.close_listener(self.sock)


def _raft_address(value: Any) -> str:
    """A member's Raft address, host:port (the --peers form)."""
    if isinstance(value, str) and ":" in value and 0 < len(value) <= 255:
        host, port = value.rsplit(":", 1)
        if host and port.isdigit() and 0 < int(port) < 65536 - 300:
            return value
    raise InvalidRequest(f"a member is its Raft address HOST:PORT (as in --peers), not {value!r}")


def _seconds(value: Any, field: str) -> float:
    """A duration from a request: a finite number >= 0 (NaN would make a wait never end)."""
    if type(value) not in (int, float) or not 0 <= value < float("inf"):
        raise InvalidRequest(f"{field!r} must be a finite number of seconds >= 0, not {value!r}")
    return float(value)


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
