"""The raftps client: finds the leader, retries across failures, keeps every write exactly-once.

Each Client is a new session (a random client id, never reused) and numbers its writes 1, 2, ...
A write is retried with the same (client id, seq) until it gets a definite answer or the
client's timeout passes, so a retry after a lost reply or a leader change is applied once.

A cluster of several Raft groups (``serve --groups G``, groups.py) is one store to the caller:
the client learns the layout once, sends each tensor's part of a request to its group's leader
and numbers its writes per group (a session per group). A write is atomic and exactly-once
within each group; versions are then ``{group: version}`` maps (an int with one group). A tensor
moved to another group (``move``) is found through the cached placement, or re-routed by the
``Moved`` answer of the group it left.
"""
from __future__ import annotations

import math
import os
import random
import socket
import ssl
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

import numpy as np

from . import auth, codec, groups
from .compress import INDICES_SUFFIX
from .errors import (AuthenticationFailed, InvalidRequest, LimitExceeded, Moved, Moving, ProtocolError, RaftpsError,
                     StepTimeout, Unavailable, UnknownTensor, raise_for)
from .schema import NAME_PATTERN

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


def newest(a: Any, b: Any) -> Any:
    """The later of two store versions: ints, or {group: version} maps (then group by group)."""
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {}
        return {g: max(a.get(g, 0), b.get(g, 0)) for g in sorted(set(a) | set(b))}
    return max(a, b)


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
                 token: str | None = None, tls: str | bool | ssl.SSLContext | None = None,
                 max_in_flight: int = 16):
        self.addresses = parse_addresses(addresses)
        self.token = auth.client_token(token)
        self.tls = auth.client_tls_context(tls)
        self.timeout = timeout
        self.attempt_timeout = attempt_timeout
        self.limits = limits
        self.client_id = uuid.uuid4().hex
        self._seqs: dict[int, int] = {}           # Raft group -> the last seq this session used in it
        self._unanswered: dict[int, set[int]] = {}  # Raft group -> seqs sent and not answered yet
        self._seq_lock = threading.Lock()
        self.max_in_flight = max_in_flight        # push_async: pushes on their way at once
        self._pipeline: ThreadPoolExecutor | None = None
        self._lanes = threading.local()
        self._lane_clients: list[Client] = []
        self._lock = threading.RLock()
        self._conns: dict[str, socket.socket] = {}
        self._leaders: dict[int, str] = {}        # Raft group -> its leader's client address, as last seen
        self._groups: int | None = None           # Raft groups in the cluster, once the layout is known
        self._routes: dict[int, list[str]] = {}   # Raft group -> its members' client addresses
        self._placement: dict[str, int] = {}      # tensors moved off their hash group -> their group, as last seen
        self.refusals = {"Moving": 0, "Moved": 0}  # parts sent again because of a move (waited / re-routed)
        self._synced: dict[str, set[int]] = {}    # sync group -> Raft groups this client contributed to
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

    def _next_address(self, addresses: list[str]) -> str:
        self._rotation = (self._rotation + 1) % len(addresses)
        return addresses[self._rotation]

    def _request(self, message: dict, to_leader: bool = True, attempt_timeout: float | None = None,
                 raft_group: int = 0, timeout: float | None = None) -> dict:
        """Send to Raft group ``raft_group``'s members until a definite reply; raise its error, or
        Unavailable at the deadline (``timeout``, by default the client's)."""
        group = raft_group
        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout
        attempt_timeout = attempt_timeout or self.attempt_timeout
        addresses = self._routes.get(group, self.addresses)
        if group:
            message = {**message, "raft_group": group}
        known = self._leaders.get(group)
        target = known if to_leader and known else self._next_address(addresses)
        last_problem = "no attempt made"
        pause = 0.02
        uncertain = False       # an attempt may have reached a log (no answer, or "unknown")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"{message['op']}: no definite answer from {','.join(addresses)} "
                                  f"within {timeout:.1f} s (last: {last_problem})")
            try:
                reply = self._call(target, message, min(left, attempt_timeout))
            except AuthenticationFailed as exc:     # at the hello: this attempt sent nothing
                exc.refused = not uncertain
                raise
            except (OSError, ConnectionError) as exc:
                uncertain = True
                last_problem = f"{target}: {exc or type(exc).__name__}"
                if self._leaders.get(group) == target:
                    del self._leaders[group]
                target = self._next_address(addresses)
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, MAX_RETRY_PAUSE)
                continue
            if not reply.get("retry"):
                if to_leader:
                    self._leaders[group] = target
                if uncertain:         # an earlier attempt may have reached a log: not "refused"
                    reply.pop("refused", None)
                return raise_for(reply)
            last_problem = f"{target}: {reply.get('message', 'retry')}"
            if reply.get("not_leader") or reply.get("behind"):
                leader = reply.get("leader")
                if leader and leader not in addresses:
                    addresses.append(leader)          # a node we were not told of: follow it
                if leader and leader != target and to_leader:
                    target = self._leaders[group] = leader
                    continue
                target = self._next_address(addresses)
            elif reply.get("unknown"):
                uncertain = True
                # That node could not commit in its request timeout: likely cut off from the others.
                if self._leaders.get(group) == target:
                    del self._leaders[group]
                target = self._next_address(addresses)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, MAX_RETRY_PAUSE)

    def _next_seq(self, group: int) -> tuple[int, int]:
        """(seq, ack) of a new write in ``group``: ack is the lowest seq not answered yet (pushes
        sent by push_async may be in flight), so the store keeps their results for a retry."""
        with self._seq_lock:
            seq = self._seqs[group] = self._seqs.get(group, 0) + 1
            unanswered = self._unanswered.setdefault(group, set())
            unanswered.add(seq)
            return seq, min(unanswered)

    def _answered(self, group: int, seq: int, refused: bool) -> None:
        with self._seq_lock:
            self._unanswered[group].discard(seq)
            # Refused by the node before it reached any log (schema, role, limit): the seq was
            # never used, so the next write takes it (if none took a later one). Otherwise the
            # store would see this client's first write with ack > 1 and no session, and answer
            # SessionExpired.
            if refused and self._seqs[group] == seq:
                self._seqs[group] -= 1

    def _write(self, op: str, raft_group: int = 0, waits: float = 0.0, **fields: Any) -> dict:
        """One write; ``waits``: seconds the node may hold it before answering (push_step)."""
        with self._lock:
            return self._send_write(self, op, raft_group, fields, waits)

    def _send_write(self, via: "Client", op: str, group: int, fields: dict, waits: float = 0.0) -> dict:
        """One write with a new seq, sent (and retried with that seq) over ``via``'s connections."""
        seq, ack = self._next_seq(group)
        refused = False
        try:
            return via._request({"op": op, "client": self.client_id, "seq": seq, "ack": ack, **fields},
                                raft_group=group, attempt_timeout=waits and waits + self.attempt_timeout + 5.0,
                                timeout=waits and 2 * waits + self.timeout)
        except RaftpsError as exc:
            refused = bool(getattr(exc, "refused", False))
            raise
        finally:
            self._answered(group, seq, refused)

    def push_async(self, grads: dict[str, np.ndarray], base_version: Any = None,
                   encoding: dict | None = None) -> "Future[dict]":
        """Send a push without waiting for the ones before it: up to ``max_in_flight`` (the
        constructor's) are on their way at once, each on a connection of its own, each still
        exactly-once with its own seq; the leader's group commit puts those that arrive together
        in one log entry. The future gives push_result's reply. Pushes in flight together may be
        applied in any order. One Raft group only (with several, use push)."""
        if self.groups() > 1:
            raise ValueError("push_async works on a cluster of one Raft group; use push")
        fields: dict[str, Any] = {"tensors": {k: np.asarray(v) for k, v in grads.items()}}
        if base_version is not None:
            fields["base_version"] = int(base_version)
        if encoding is not None:
            fields["encoding"] = encoding
        with self._seq_lock:
            if self._pipeline is None:
                self._pipeline = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="raftps-push")
        return self._pipeline.submit(lambda: self._send_write(self._lane(), "push", 0, fields))

    def _lane(self) -> "Client":
        """This pipeline thread's own connections (a Client sharing our id and seqs)."""
        lane = getattr(self._lanes, "client", None)
        if lane is None:
            lane = self._lanes.client = Client(self.addresses, self.timeout, self.attempt_timeout, self.limits,
                                               self.token, self.tls)
            with self._seq_lock:
                self._lane_clients.append(lane)
        return lane

    # ---- Raft groups -----------------------------------------------------------------------

    def groups(self) -> int:
        """How many Raft groups the cluster shards tensors over (asked once, then cached)."""
        with self._lock:
            if self._groups is None:
                reply = self._request({"op": "layout"}, to_leader=False)
                if reply["groups"] > 1:
                    nodes = reply["nodes"]
                    self._routes = {g: [nodes[m - 1] for m in members] for g, members in enumerate(reply["members"])}
                self._groups = reply["groups"]
                if self._groups > 1:
                    self._learn_placement()
            return self._groups

    def refresh_placement(self) -> dict[str, int]:
        """Learn again where moved tensors live (group 0's placement table, a linearizable read).
        Routing uses this cache; a group that no longer holds a tensor answers Moved, which
        refreshes it, so a stale cache costs a round trip, never a misplaced write."""
        with self._lock:
            if self.groups() > 1:
                self._placement = dict(self._request({"op": "placement"}, raft_group=0)["placement"])
            return dict(self._placement)

    def _learn_placement(self) -> None:
        """refresh_placement, but a group 0 that does not answer soon leaves the cache as it is:
        routing stays correct without it (every group a tensor left answers Moved with where it
        went), so clients of the other groups need not wait for group 0."""
        try:
            self._placement = dict(self._request({"op": "placement"}, raft_group=0,
                                                 timeout=min(self.timeout, 5.0))["placement"])
        except Unavailable:
            pass

    def group_of(self, name: str) -> int:
        """The Raft group that holds tensor ``name`` (an index tensor goes with its tensor): its
        placement if it was moved (``move``), else the hash of its name."""
        if name.endswith(INDICES_SUFFIX):
            name = name[:-len(INDICES_SUFFIX)]
        count = self.groups()
        return self._placement.get(name, groups.group_of(name, count))

    def _split(self, named: dict[str, Any]) -> dict[int, dict[str, Any]]:
        parts: dict[int, dict[str, Any]] = {}
        for name, value in named.items():
            parts.setdefault(self.group_of(name), {})[name] = value
        return dict(sorted(parts.items()))

    def _each_group(self, write: Any, parts: dict[int, Any]) -> dict:
        """``write(group, part)`` for every group's part, in group order; one reply, merged.

        A part that names a tensor moved to another group (Moved) is split again with the new
        placement and sent there; one that names a tensor being moved (Moving) is sent again after
        a pause, until the client's timeout. Either refusal means nothing of that part was applied,
        so sending it again (with a new seq) applies it once."""
        replies: dict[int, dict] = {}
        queue = list(parts.items())
        deadline = time.monotonic() + self.timeout
        pause = 0.02
        for _ in range(10_000):             # bounded: each turn sends one part (or waits, bounded by time)
            if not queue:
                return _merge(replies)
            g, part = queue.pop(0)
            try:
                reply = write(g, part)
            except Moved as exc:
                self.refusals["Moved"] += 1
                queue = _requeue(queue, self._reroute(exc, g, part))
                continue
            except Moving:
                self.refusals["Moving"] += 1
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.25)
                queue.insert(0, (g, part))
                continue
            replies[g] = _merge_same_group(replies[g], reply) if g in replies else reply
        raise Unavailable("a request kept being re-routed between groups: the placement keeps changing")

    def _reroute(self, moved: Moved, group: int, part: Any) -> list[tuple[int, Any]]:
        """A part refused with Moved, split again by the new placement."""
        if part is None or moved.group is None or not isinstance(moved.tensor, str):
            raise moved
        with self._lock:
            self._learn_placement()
            self._placement[moved.tensor] = moved.group     # the refusal is at least this fresh
        names = dict(part) if isinstance(part, dict) else {n: None for n in part}
        parts = self._split(names)
        if group in parts and moved.tensor in {n[:-len(INDICES_SUFFIX)] if n.endswith(INDICES_SUFFIX) else n
                                               for n in parts[group]}:
            raise moved                      # cannot happen: the tensor would go where it was refused
        return [(g, sub if isinstance(part, dict) else list(sub)) for g, sub in parts.items()]

    def _min_version(self, min_version: Any, group: int) -> int:
        if isinstance(min_version, dict):
            return int(min_version.get(group, 0))
        if min_version and self.groups() > 1:
            raise ValueError("with several Raft groups, min_version is a {group: version} map "
                             "(as push and pull return)")
        return int(min_version or 0)

    # ---- the API --------------------------------------------------------------------------

    def create(self, name: str, array: np.ndarray, optimizer: dict) -> Any:
        """Create a tensor with its optimizer; the same call again is a no-op."""
        return self.create_many({name: array}, {name: optimizer})

    def create_many(self, tensors: dict[str, np.ndarray], optimizers: dict[str, dict]) -> Any:
        """Create several tensors in one write (each with its optimizer spec); existing ones
        with the same shape, dtype and optimizer are left as they are."""
        return self.create_result(tensors, optimizers)["version"]

    def create_result(self, tensors: dict[str, np.ndarray], optimizers: dict[str, dict]) -> dict:
        """As create_many, but the whole result: version and ``created`` (the names that did not exist)."""
        tensors = {k: np.asarray(v) for k, v in tensors.items()}
        if self.groups() == 1:
            return self._write("create", tensors=tensors, optimizer=dict(optimizers))
        return self._each_group(lambda g, part: self._write(
            "create", g, tensors=part, optimizer={k: v for k, v in optimizers.items() if k in part}),
            self._split(tensors))

    def push(self, grads: dict[str, np.ndarray], base_version: Any = None,
             encoding: dict | None = None, ssp: dict | None = None, hyper: dict | None = None) -> Any:
        """Apply one gradient per tensor, atomically, exactly once; returns the store version.
        ``encoding``: compressed tensors (raftps.compress); ``ssp``: {group, worker} (SSP gate);
        ``hyper``: {tensor: {"lr": ..., ...}}, this step's hyperparameters over the tensor's stored
        optimizer spec (raftps.optim.STEP_HYPERPARAMETERS; a torch param group's current values)."""
        return self.push_result(grads, base_version, encoding, ssp, hyper)["version"]

    def push_result(self, grads: dict[str, np.ndarray], base_version: Any = None,
                    encoding: dict | None = None, ssp: dict | None = None, hyper: dict | None = None) -> dict:
        """As push, but the whole result: version, staleness (with a base), clock (with ssp)."""
        def write(group: int, part: dict) -> dict:
            fields: dict[str, Any] = {"tensors": part}
            if hyper:
                fields["hyper"] = {k: v for k, v in hyper.items() if k in part} if self.groups() > 1 else hyper
            base = base_version.get(group) if isinstance(base_version, dict) else base_version
            if base is not None:
                fields["base_version"] = int(base)
            if encoding is not None:
                chosen = {k: v for k, v in encoding.items() if k in part}
                if chosen or self.groups() == 1:
                    fields["encoding"] = chosen if self.groups() > 1 else encoding
            if ssp is not None:
                fields["ssp"] = ssp
            return self._write("push", group, **fields)
        grads = {k: np.asarray(v) for k, v in grads.items()}
        if self.groups() == 1:
            return write(0, grads)
        return self._each_group(write, self._split(grads))

    def assign(self, values: dict[str, np.ndarray]) -> Any:
        values = {k: np.asarray(v) for k, v in values.items()}
        if self.groups() == 1:
            return self._write("assign", tensors=values)["version"]
        return self._each_group(lambda g, part: self._write("assign", g, tensors=part), self._split(values))["version"]

    def assign_state(self, values: dict[str, np.ndarray], states: dict[str, dict[str, Any]]) -> Any:
        """Set tensors' values and their optimizers' state at once (atomically in each Raft
        group): ``states[name]`` has exactly the keys the tensor's optimizer keeps (arrays of its
        shape and dtype, and scalars: Adam's ``beta1_t``/``beta2_t``, ``step``), as
        ``export(prefix, state=True)`` returns them. Returns the store version."""
        missing = sorted(set(values) ^ set(states))
        if missing:
            raise ValueError(f"assign_state: values and states must name the same tensors ({missing[:5]} differ)")

        def write(group: int, part: dict) -> dict:
            records, parts = [], {}
            for i, name in enumerate(sorted(part)):
                scalars = {k: v for k, v in states[name].items() if not isinstance(v, np.ndarray)}
                records.append({"name": name, "scalars": scalars})
                parts[str(i)] = np.asarray(values[name])
                parts.update({f"{i}.{k}": v for k, v in states[name].items() if isinstance(v, np.ndarray)})
            return self._write("assign_state", group, records=records, tensors=parts)
        if self.groups() == 1:
            return write(0, values)["version"]
        return self._each_group(write, self._split(dict(values)))["version"]

    def delete(self, names: list[str]) -> Any:
        if self.groups() == 1:
            return self._write("delete", names=list(names))["version"]
        parts = self._split({n: None for n in names})
        return self._each_group(lambda g, part: self._write("delete", g, names=list(part)), parts)["version"]

    def push_sync(self, grads: dict[str, np.ndarray], step: int, workers: int, group: str | None = None,
                  rank: int | None = None) -> Any:
        """One worker's contribution to synchronous step ``step`` of sync group ``group`` (a job's
        name; None: the store-wide default group); the mean of ``workers`` contributions is applied
        once, when the last one arrives. With ``rank`` (0 <= rank < workers) the step counts
        distinct ranks: a rank's second contribution (a restarted worker) is ignored. With several
        Raft groups each group applies its part of the step when its ``workers`` parts are in."""
        return self.push_sync_result(grads, step, workers, group, rank)["version"]

    def push_sync_result(self, grads: dict[str, np.ndarray], step: int, workers: int, group: str | None = None,
                         rank: int | None = None) -> dict:
        """As push_sync, but the whole result: version, step, applied, count, and late (the step
        was applied before) or duplicate_rank (this rank had contributed; nothing changed)."""
        return self._contribute("push_sync", grads, step, workers, group, rank)

    def _contribute(self, op: str, grads: dict[str, np.ndarray], step: int, workers: int, group: str | None,
                    rank: int | None, waits: float = 0.0, **extra: Any) -> dict:
        """One worker's part of a sync step (``op`` push_sync or push_step), split by Raft group."""
        hyper = extra.pop("hyper", None)
        fields: dict[str, Any] = {"step": int(step), "workers": int(workers), **extra}
        if group is not None:
            fields["group"] = group
        if rank is not None:
            fields["rank"] = int(rank)
        grads = {k: np.asarray(v) for k, v in grads.items()}
        if self.groups() == 1:
            return self._write(op, tensors=grads, waits=waits, **fields, **({"hyper": hyper} if hyper else {}))

        def write(g: int, part: dict) -> dict:
            mine = {k: v for k, v in (hyper or {}).items() if k in part}
            return self._write(op, g, waits=waits, tensors=part, **fields, **({"hyper": mine} if mine else {}))
        return self._each_sync_group(group, self._split(grads), write)

    def _each_sync_group(self, group: str | None, parts: dict[int, Any], write: Any) -> dict:
        """_each_group for a step's parts, remembering which Raft groups the step lives in."""
        synced = self._synced.setdefault(group or "", set())
        synced.update(parts)
        result = self._each_group(write, parts)
        synced.difference_update(set(parts) - set(result["version"]))   # parts re-routed by a move
        synced.update(result["version"])
        return result

    def push_step(self, grads: dict[str, np.ndarray], step: int, workers: int, group: str | None = None,
                  rank: int | None = None, timeout: float = 10.0, pull: bool = False, hyper: dict | None = None,
                  clip_norm: float | None = None) -> dict:
        """One worker's contribution to synchronous step ``step`` of sync group ``group``, summed on
        the leader with the step's other contributions and replicated once as the step (aggregation
        before replication); returns when the step is applied: version, step, applied, count (the
        contributions in it: fewer than ``workers`` if ``timeout`` seconds after the step's first
        contribution some had not arrived), and late (the step was applied without this one) or
        duplicate_rank. With ``pull``, also ``tensors`` (and ``tensor_versions``): the step's tensors
        as its entry left them, read on the leader right after the apply, so no pull is needed (a
        reply without them, e.g. to a contribution sent again, means: pull). Exactly-once: a
        contribution in flight when the leader died is sent again to the new leader with the same
        seq. With several Raft groups, each group's part in turn.

        ``hyper``: as push's, and every contribution to a step must carry the same (else refused).
        ``clip_norm``: the leader scales the step's mean gradient to at most this L2 norm, as
        ``torch.nn.utils.clip_grad_norm_`` on one process's full batch (each Raft group clips its
        own part); the answer's ``grad_norm`` is the mean's norm before clipping."""
        if not (math.isfinite(timeout) and timeout >= 0):
            raise ValueError(f"push_step timeout must be a finite number of seconds >= 0, not {timeout!r}")
        extra: dict[str, Any] = {"pull": True} if pull else {}
        if hyper:
            extra["hyper"] = hyper
        if clip_norm is not None:
            extra["clip_norm"] = float(clip_norm)
        return self._contribute("push_step", grads, step, workers, group, rank, waits=float(timeout),
                                timeout=float(timeout), **extra)

    def _sync_groups(self, group: str | None) -> list[int]:
        """The Raft groups a sync group's steps live in: those this client contributed to, else all."""
        return sorted(self._synced.get(group or "") or range(self.groups()))

    def close_step(self, step: int, group: str | None = None) -> Any:
        """Apply sync step ``step`` of ``group`` now with the contributions that arrived (no-op if applied)."""
        fields: dict[str, Any] = {"step": int(step)}
        if group is not None:
            fields["group"] = group
        if self.groups() == 1:
            return self._write("close_step", **fields)["version"]
        parts = {g: None for g in self._sync_groups(group)}
        return self._each_group(lambda g, _: self._write("close_step", g, **fields), parts)["version"]

    def wait_step(self, step: int, timeout: float, group: str | None = None) -> Any:
        """Block until sync step ``step`` of ``group`` is applied; returns the store version then."""
        deadline = time.monotonic() + timeout
        versions = {}
        for g in ([0] if self.groups() == 1 else self._sync_groups(group)):
            while True:
                left = deadline - time.monotonic()
                request: dict[str, Any] = {"op": "wait_step", "step": int(step), "timeout": max(0.0, min(left, 5.0))}
                if group is not None:
                    request["group"] = group
                try:
                    with self._lock:
                        versions[g] = self._request(request, attempt_timeout=min(left, 5.0) + 5.0, raft_group=g)["version"]
                    break
                except StepTimeout:
                    if deadline - time.monotonic() <= 0:
                        raise
        return versions[0] if self.groups() == 1 else versions

    def sync_applied(self, group: str | None = None) -> int:
        """The last applied sync step of ``group`` (-1 if none), a linearizable read at the leader.
        With several Raft groups: the lowest over the groups that have applied a step of it."""
        request: dict[str, Any] = {"op": "sync_applied"}
        if group is not None:
            request["group"] = group
        with self._lock:
            if self.groups() == 1:
                return self._request(request)["applied"]
            applied = [self._request(request, raft_group=g)["applied"] for g in self._sync_groups(group)]
        started = [a for a in applied if a >= 0]
        return min(started) if started else -1

    # ---- SSP groups (bounded staleness); with several Raft groups, one clock per Raft group ----

    def _ssp_write(self, op: str, key: str, **fields: Any) -> Any:
        if self.groups() == 1:
            return self._write(op, **fields)[key]
        replies = [self._write(op, g, **fields)[key] for g in range(self.groups())]
        return max(replies) if key == "clock" else all(replies)

    def ssp_join(self, group: str, worker: str, staleness: int | None) -> int:
        """Join SSP group ``group`` (created with bound ``staleness``; None: unbounded); returns the clock."""
        return self._ssp_write("ssp_join", "clock", group=group, worker=worker, staleness=staleness)

    def ssp_leave(self, group: str, worker: str) -> bool:
        return self._ssp_write("ssp_leave", "left", group=group, worker=worker)

    def ssp_drop(self, group: str, worker: str, clock: int) -> bool:
        """Drop ``worker`` from the group if its clock is still ``clock`` (it made no progress)."""
        return self._ssp_write("ssp_drop", "dropped", group=group, worker=worker, clock=int(clock))

    def ssp_wait(self, group: str, worker: str, timeout: float) -> dict:
        """Wait (at the leader, at most ``timeout`` s) until ``worker`` may take its next step:
        {version, ready, member, clock, min_clock, slowest: [[worker, clock], ...]}."""
        request = {"op": "ssp_wait", "group": group, "worker": worker, "timeout": float(timeout)}
        with self._lock:
            if self.groups() == 1:
                return self._request(request, attempt_timeout=float(timeout) + 5.0)
            replies = {g: self._request(request, attempt_timeout=float(timeout) + 5.0, raft_group=g)
                       for g in range(self.groups())}
        slowest = min(replies.values(), key=lambda r: r["min_clock"])
        return {"version": {g: r["version"] for g, r in replies.items()},
                "ready": all(r["ready"] for r in replies.values()),
                "member": all(r["member"] for r in replies.values()),
                "clock": max((r["clock"] for r in replies.values() if r["clock"] is not None), default=None),
                "min_clock": slowest["min_clock"], "slowest": slowest["slowest"]}

    def pull(self, names: list[str] | None = None, min_version: Any = None,
             linearizable: bool = True) -> tuple[dict[str, np.ndarray], Any]:
        """Tensors and the store version they are at. Linearizable reads are served by the leader
        (ReadIndex, or a barrier entry: serve --read-mode); others by any node that has applied
        at least ``min_version``. With several Raft groups each group's part is read on its own
        (linearizable per group; not one cut across groups) and the version is {group: version}."""
        reply = self.pull_result(names, min_version, linearizable)
        return reply["tensors"], reply["version"]

    def pull_result(self, names: list[str] | None = None, min_version: Any = None,
                    linearizable: bool = True) -> dict:
        """As pull, but the whole reply: tensors, version and tensor_versions (each tensor's own
        update count, read from the same state as the tensors)."""
        def read(group: int, part: list[str] | None) -> dict:
            request = {"op": "pull", "names": part, "linearizable": linearizable,
                       "min_version": self._min_version(min_version, group)}
            with self._lock:
                return self._request(request, to_leader=linearizable, raft_group=group)
        if self.groups() == 1:
            return read(0, list(names) if names is not None else None)
        parts = {g: None for g in range(self.groups())} if names is None else \
            {g: list(part) for g, part in self._split({n: None for n in names}).items()}
        return self._each_group(read, parts)

    def pull_rows(self, name: str, rows: Any, min_version: Any = None,
                  linearizable: bool = True) -> tuple[np.ndarray, Any]:
        """Rows ``rows`` (integers in [0, rows of the tensor), any order) of tensor ``name`` and
        the store version they are at; the reply's size grows with len(rows), not the table."""
        rows = np.asarray(rows)
        if rows.size == 0 or rows.dtype.kind in "iu" and rows.dtype not in (np.int32, np.int64):
            rows = rows.astype(np.int64)      # the store takes int32 or int64; others are refused there
        def read(group: int, _: Any) -> dict:
            request = {"op": "pull_rows", "name": name, "rows": rows, "linearizable": linearizable,
                       "min_version": self._min_version(min_version, group)}
            with self._lock:
                return self._request(request, to_leader=linearizable, raft_group=group)
        if self.groups() == 1:
            reply = read(0, None)
            return reply["rows"], reply["version"]
        reply = self._each_group(read, {self.group_of(name): [name]})
        return reply["rows"], reply["version"]

    def tensors(self, prefix: str | None = None) -> list[dict]:
        """Name, dtype, shape, version and optimizer of every tensor (from the leader) whose name
        starts with ``prefix`` and that this client's token may read; with several Raft groups,
        each row also names its ``group``."""
        request: dict[str, Any] = {"op": "tensors"}
        if prefix:
            request["prefix"] = prefix
        with self._lock:
            if self.groups() == 1:
                return self._request(request)["tensors"]
            rows = [{**row, "group": g} for g in range(self.groups())
                    for row in self._request(request, raft_group=g)["tensors"]]
        return sorted(rows, key=lambda row: row["name"])

    def export(self, prefix: str, state: bool = False) -> dict:
        """Every tensor whose name starts with ``prefix`` (a plain string prefix), in one
        linearizable read at the leader: tensors, tensor_versions, optimizers, version, and the
        store's digest at that version (with several Raft groups: per group, as maps); with
        ``state``, also ``states``: each tensor's optimizer state (assign_state's form)."""
        request = {"op": "export", "prefix": prefix, **({"state": True} if state else {})}
        with self._lock:
            if self.groups() == 1:
                return self._request(request)
            return _merge({g: self._request(dict(request), raft_group=g) for g in range(self.groups())})

    def snapshot(self) -> dict:
        """The whole store at one version: {version, digest, snapshot} (``TensorStore.snapshot()``
        form); with several Raft groups, {"groups": [that, per group]}. A store beyond this client's ``limits`` (1 GiB, 4096 arrays by default) needs a
        Client with larger ones (``raftps snapshot save`` makes one)."""
        with self._lock:
            if self.groups() > 1:             # each group at a version of its own
                return {"groups": [self._request({"op": "snapshot"}, raft_group=g) for g in range(self.groups())]}
            return self._request({"op": "snapshot"})

    # ---- moving a tensor to another Raft group (moves.py has the state machine's side) ----------

    def move(self, name: str, group: int) -> dict:
        """Move tensor ``name`` (with its index tensor ``name:indices``, if stored) to Raft group
        ``group``, online: freeze it in its group (writes to it wait), read its whole state there,
        install that state in ``group``, record the placement in group 0, then leave a tombstone
        that sends every later request to ``group``. Every step is idempotent: a move interrupted
        at any point (this process killed, a leader killed) completes when run again.
        Returns {tensor, from, to, names}."""
        count = self.groups()
        self._check_move_request(name, group, count)
        with self._lock:
            for _ in range(3):          # at most: finish an interrupted move elsewhere, then this one
                states = {g: self._request({"op": "move_state", "name": name}, raft_group=g) for g in range(count)}
                pending = [g for g, st in states.items() if st["moving"]]
                if pending:             # a move that was interrupted: finish it first
                    source, frozen = pending[0], states[pending[0]]["moving"]
                    names = self._finish_move(name, source, frozen["to"], frozen["move"])
                    if frozen["to"] == group:
                        return {"tensor": name, "from": source, "to": group, "names": names}
                    continue
                holders = [g for g, st in states.items() if st["present"]]
                if not holders:
                    raise UnknownTensor(f"move: unknown tensor {name!r} (no Raft group holds it)")
                source = holders[0]
                if source == group:
                    raise InvalidRequest(f"move: tensor {name!r} is already in Raft group {group}")
                self._check_move_fits(name, states[source]["bytes"], states[group].get("max_frame_bytes"))
                frozen = self._write("move_freeze", source, name=name, to=group)
                names = self._finish_move(name, source, group, frozen["move"])
                return {"tensor": name, "from": source, "to": group, "names": names}
        raise InvalidRequest(f"move: tensor {name!r} kept being moved by someone else meanwhile; run it again")

    @staticmethod
    def _check_move_request(name: Any, group: Any, count: int) -> None:
        """Bad input, refused before anything is sent."""
        if count == 1:
            raise InvalidRequest("move: this cluster has one Raft group: there is no other group to move a tensor to")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise InvalidRequest(f"move: bad tensor name {name!r}: 1-200 characters from [A-Za-z0-9_.:/-]")
        if name.endswith(INDICES_SUFFIX):
            raise InvalidRequest(f"move: {name!r} is an index tensor: it moves with {name[:-len(INDICES_SUFFIX)]!r}")
        if type(group) is not int or not 0 <= group < count:
            raise InvalidRequest(f"move: Raft group {group!r} is out of range: this cluster has groups 0..{count - 1}")

    def _check_move_fits(self, name: str, size: int, node_limit: int | None) -> None:
        """The state a move carries must fit one reply to us and one write to the destination:
        refused before the freeze (a frozen tensor can only be finished, not given back)."""
        limit = min(self.limits.max_blob_bytes, node_limit or self.limits.max_blob_bytes)
        if size > limit:
            raise LimitExceeded(f"move: tensor {name!r} carries {size} bytes (data and optimizer state), more than "
                                f"one frame may hold ({limit} bytes: the nodes' --max-frame-mb and this client's "
                                "limits); nothing was changed")

    def _finish_move(self, name: str, source: int, target: int, move: str) -> list[str]:
        """Steps 2-4 of a move whose freeze (move id ``move`` in ``source``) is applied."""
        state = self._request({"op": "move_state", "name": name, "full": True}, raft_group=source)
        records, arrays = [], {}
        for i, record in enumerate(state["records"]):
            arrays[str(i)] = record["data"]
            arrays.update({f"{i}.{key}": arr for key, arr in record["arrays"].items()})
            records.append({k: record[k] for k in ("name", "version", "optimizer", "scalars")})
        # the move's id names its source and its freeze's version there: unique in the cluster
        self._write("move_install", target, name=name, move=f"g{source}.{move}", records=records,
                    tensors=arrays, **{"from": source})
        self._write("place", 0, name=name, group=target)
        self._write("move_done", source, name=name, to=target, move=move)
        self._placement[name] = target
        return [r["name"] for r in records]

    def members(self, action: str = "list", node: str | None = None, old: str | None = None) -> dict:
        """Cluster membership (Raft addresses): ``list``, or ``add`` / ``remove`` ``node``, or
        ``replace`` ``old`` with ``node``. Returns members and, for changes, ``changed``."""
        with self._lock:
            return self._request({"op": "member", "action": action, "node": node, "old": old},
                                 attempt_timeout=max(self.attempt_timeout, 25.0))

    def stats(self) -> dict:
        with self._lock:
            if self.groups() == 1:
                return self._request({"op": "stats"})
            return _merge({g: self._request({"op": "stats"}, raft_group=g) for g in range(self.groups())})

    def status(self, timeout: float = 2.0, digest: bool = True) -> list[dict]:
        """One dict per node (node, address, role, term, applied, digest, ...) and, with several
        Raft groups, per group the node hosts (``group``); 'down' if unreachable.
        ``digest=False``: no digest (each node hashes its whole store for it)."""
        out = []
        with self._lock:
            for number, address in enumerate(self.addresses, 1):
                try:
                    reply = self._call(address, {"op": "status", "digest": digest}, timeout)
                except (OSError, ConnectionError, ProtocolError) as exc:
                    out.append({"node": number, "address": address, "role": "down", "term": None,
                                "applied": None, "digest": None, "error": str(exc) or type(exc).__name__})
                    continue
                # a row per Raft group the node hosts (one group: the node's row, as always)
                rows = reply.pop("groups", None) or [reply]
                out.extend({**row, "connections": reply.get("connections")} for row in rows)
        return out

    def close(self) -> None:
        if self._pipeline is not None:
            self._pipeline.shutdown(wait=True)
        for lane in self._lane_clients:
            lane.close()
        with self._lock:
            for address in list(self._conns):
                self._drop(address)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# How the replies of one request's parts in several Raft groups combine into one.
_COMBINE: dict[str, Any] = {
    "tensors": lambda vs: {k: v for d in vs for k, v in d.items()},
    "tensor_versions": lambda vs: {k: v for d in vs for k, v in d.items()},
    "optimizers": lambda vs: {k: v for d in vs for k, v in d.items()},
    "states": lambda vs: {k: v for d in vs for k, v in d.items()},
    "assigned": lambda vs: sorted(n for v in vs for n in v),
    # each Raft group clips its own part of a step: the parts' norms (one per group)
    "grad_norm": lambda vs: vs[0] if len(vs) == 1 else vs,
    "created": lambda vs: sorted(n for v in vs for n in v),
    "staleness": lambda vs: _highest(vs),
    "clock": lambda vs: _highest(vs),
    "applied": all, "late": any, "duplicate_rank": any, "count": min, "step": min,
    "pushes": sum, "rejected": sum, "duplicates": sum, "sessions": sum,
    "rows": lambda vs: vs[0] if len(vs) == 1 else np.concatenate(vs),
    "tensor_version": max,
}


def _requeue(queue: list[tuple[int, Any]], rerouted: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Parts re-routed by a move, joined to the part still to be sent to the same group (so a
    push stays one write per group, and a sync step's contribution keeps one set of names), or
    sent first."""
    queue = list(queue)
    first = []
    for group, part in rerouted:
        waiting = next((i for i, (g, p) in enumerate(queue) if g == group and p is not None), None)
        if waiting is None:
            first.append((group, part))
        elif isinstance(part, dict):
            queue[waiting] = (group, {**queue[waiting][1], **part})
        else:
            queue[waiting] = (group, list(queue[waiting][1]) + list(part))
    return first + queue


def _merge_same_group(first: dict, second: dict) -> dict:
    """Two replies of one group (a part re-routed there by a move joined another): one reply."""
    out = dict(first)
    for key, value in second.items():
        if key not in first:
            out[key] = value
        elif key in _COMBINE:
            out[key] = _COMBINE[key]([first[key], value])
        elif key == "version":
            out[key] = max(first[key], value)
        else:
            out[key] = value
    return out


def _highest(values: list) -> Any:
    """The highest number, or the values as they are when they are not all numbers (histograms)."""
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(numbers) == len([v for v in values if v is not None]):
        return max(numbers, default=None)
    return values


def _merge(replies: dict[int, dict]) -> dict:
    """One reply from each group's: version and digest become {group: value}; the rest combine."""
    out: dict[str, Any] = {}
    keys = sorted({k for r in replies.values() for k in r})
    for key in keys:
        values = [r[key] for r in replies.values() if key in r]
        if key in _COMBINE:
            out[key] = _COMBINE[key](values)
        else:
            out[key] = {g: r[key] for g, r in replies.items() if key in r}
    return out
