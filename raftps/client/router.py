"""Where a Client's requests go: the cluster's layout (Raft groups and their members), the
placement of moved tensors, each group's leader as last seen, and the retries that find it.

The router is given the client's transport (one attempt at one node) and session (a write's
client id and seq) and calls them, never back into the Client: ``request`` sends one message
until a definite reply, ``write`` numbers a write in the session and sends it so.

A cluster of several Raft groups (``serve --groups G``, groups.py) is one store to the caller:
the router learns the layout once, sends each tensor's part of a request to its group's leader,
and merges the parts' replies into one (versions become ``{group: version}`` maps). A tensor
moved to another group (``move``) is found through the cached placement, or re-routed by the
``Moved`` answer of the group it left.
"""
from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import Future, wait
from typing import Any, Callable, Iterable

import numpy as np

from raftps import groups as layout
from raftps.compress import INDICES_SUFFIX
from raftps.errors import AuthenticationFailed, Moved, Moving, RaftpsError, Unavailable, raise_for
from raftps.client.session import Session
from raftps.client.transport import LATE_WAIT_BYTES, AnswerLate, Transport
from raftps.schema import HELD_OPS
from raftps.server.payloads import digest_of

# Retries back off from 20 ms to this. During an election every follower answers "no leader"
# at once, so a long pause only adds to failover time (a 0.5 s cap added up to 0.5 s to it).
MAX_RETRY_PAUSE = 0.1
# Waits in a row for the late answer to a large request a node took whole (transport.AnswerLate)
# before trying another node.
MAX_LATE_WAITS = 3

Call = Callable[[str, dict, float], dict]


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


class Router:
    def __init__(self, addresses: list[str], transport: Transport, session: Session, timeout: float,
                 attempt_timeout: float, lock: threading.RLock):
        self.addresses = addresses
        self.transport = transport                # one attempt at one node, over the client's connections
        self.session = session                    # the client id and per-group seqs of its writes
        self.timeout = timeout
        self.attempt_timeout = attempt_timeout
        self._lock = lock                         # the client's: one request at a time on its connections
        self._leaders: dict[int, str] = {}        # Raft group -> its leader's client address, as last seen
        self._groups: int | None = None           # Raft groups in the cluster, once the layout is known
        self._routes: dict[int, list[str]] = {}   # Raft group -> its members' client addresses
        self.placement: dict[str, int] = {}       # tensors moved off their hash group -> their group, as last seen
        self.refusals = {"Moving": 0, "Moved": 0}  # parts sent again because of a move (waited / re-routed)
        self._rotation = random.randrange(len(addresses))

    def _next_address(self, addresses: list[str]) -> str:
        self._rotation = (self._rotation + 1) % len(addresses)
        return addresses[self._rotation]

    def call(self, address: str, message: dict, timeout: float) -> dict:
        """One attempt at one node, over the client's transport."""
        return self.transport.call(address, message, timeout)

    def write(self, op: str, raft_group: int = 0, waits: float = 0.0, call: Call | None = None,
              **fields: Any) -> dict:
        """One write with a new seq of the session, sent (and retried with that seq) to Raft group
        ``raft_group``'s leader. ``waits``: seconds the node may hold it before answering
        (push_step); ``call``: a push_async lane's transport (connections of its own: the
        client's lock is not needed, and not taken)."""
        if call is None:
            with self._lock:
                return self._send_write(op, raft_group, fields, waits, self.call)
        return self._send_write(op, raft_group, fields, waits, call)

    def _send_write(self, op: str, raft_group: int, fields: dict, waits: float, call: Call) -> dict:
        seq, ack = self.session.next_seq(raft_group)
        refused = False
        try:
            return self.request({"op": op, "client": self.session.client_id, "seq": seq, "ack": ack, **fields},
                                raft_group=raft_group, attempt_timeout=waits and waits + self.attempt_timeout + 5.0,
                                timeout=waits and 2 * waits + self.timeout, call=call)
        except RaftpsError as exc:
            refused = bool(getattr(exc, "refused", False))
            raise
        finally:
            self.session.answered(raft_group, seq, refused)

    def _forget_leader(self, group: int, target: str) -> None:
        if self._leaders.get(group) == target:
            self._leaders.pop(group, None)

    def request(self, message: dict, to_leader: bool = True, attempt_timeout: float | None = None,
                raft_group: int = 0, timeout: float | None = None, call: Call | None = None,
                first: int | None = None) -> dict:
        """Send to Raft group ``raft_group``'s members until a definite reply; raise its error, or
        Unavailable at the deadline (``timeout``, by default the client's). ``call``: another
        transport's (a push_async lane's connections). ``first``: a read goes first to member
        ``first`` mod the members (spreads reads over the members' links), then as any read."""
        group = raft_group
        call = call or self.call
        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout
        attempt_timeout = attempt_timeout or self.attempt_timeout
        addresses = self._routes.get(group, self.addresses)
        if group:
            message = {**message, "raft_group": group}
        large = to_leader and _payload_bytes(message) >= LATE_WAIT_BYTES

        def next_target() -> str:
            # A large write sent to a follower would cross the link whole only to be told who
            # leads: ask a node first.
            return (large and self._leader_hint(group, addresses, call)) or self._next_address(addresses)
        held: dict | None = None      # the write again without its arrays (held_probe), once worth it
        lacking: str | None = None    # the node that said it does not hold them
        known = self._leaders.get(group)
        target = known if to_leader and known else \
            addresses[first % len(addresses)] if first is not None and not to_leader else next_target()
        last_problem = "no attempt made"
        pause = 0.02
        uncertain = False       # an attempt may have reached a log (no answer, or "unknown")
        late_waits = 0          # AnswerLate in a row from the target
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"{message['op']}: no definite answer from {','.join(addresses)} "
                                  f"within {timeout:.1f} s (last: {last_problem})")
            if uncertain and large and held is None:
                held = held_probe(message) or {}
            try:
                sending = held if held and target != lacking else message
                reply = call(target, sending, min(left, attempt_timeout))
            except AuthenticationFailed as exc:     # at the hello: this attempt sent nothing
                exc.refused = not uncertain
                raise
            except (OSError, ConnectionError) as exc:
                uncertain = True
                if isinstance(exc, AnswerLate) and late_waits < MAX_LATE_WAITS:
                    # The node holds the whole (large) request and is still at it, forwarding its
                    # payload on a slow link, say: ask it again, which waits for that answer
                    # rather than sending the bytes again. A node that stays silent (paused,
                    # cut off) is left after MAX_LATE_WAITS waits, as any silent node is.
                    late_waits += 1
                    last_problem = f"{target}: {exc}"
                    continue
                late_waits = 0
                last_problem = f"{target}: {exc or type(exc).__name__}"
                self._forget_leader(group, target)
                target = next_target()
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
            if reply.get("need_payload"):     # it does not hold them: the arrays go again, now
                lacking = target
                continue
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
                self._forget_leader(group, target)
                target = next_target()
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, MAX_RETRY_PAUSE)

    def _leader_hint(self, group: int, addresses: list[str], call: Call) -> str | None:
        """Group ``group``'s leader as the first node that answers a status request (no digest)
        knows it, or None."""
        for _ in range(len(addresses)):
            address = self._next_address(addresses)
            try:
                reply = call(address, {"op": "status", "digest": False}, min(self.attempt_timeout, 2.0))
            except (OSError, ConnectionError):
                continue
            row = next((r for r in reply.get("groups") or [reply] if r.get("group", 0) == group), {})
            if row.get("role") == "leader":
                return address
            if isinstance(row.get("leader"), str):
                return row["leader"]
        return None

    def groups(self) -> int:
        """How many Raft groups the cluster shards tensors over (asked once, then cached)."""
        with self._lock:
            if self._groups is None:
                reply = self.request({"op": "layout"}, to_leader=False)
                if reply["groups"] > 1:
                    nodes = reply["nodes"]
                    self._routes = {g: [nodes[m - 1] for m in members] for g, members in enumerate(reply["members"])}
                self._groups = reply["groups"]
                if self._groups > 1:
                    self.learn_placement()
            return self._groups

    def refresh_placement(self) -> dict[str, int]:
        """Learn again where moved tensors live (group 0's placement table, a linearizable read).
        Routing uses this cache; a group that no longer holds a tensor answers Moved, which
        refreshes it, so a stale cache costs a round trip, never a misplaced write."""
        with self._lock:
            if self.groups() > 1:
                self.placement = dict(self.request({"op": "placement"}, raft_group=0)["placement"])
            return dict(self.placement)

    def learn_placement(self) -> None:
        """refresh_placement, but a group 0 that does not answer soon leaves the cache as it is:
        routing stays correct without it (every group a tensor left answers Moved with where it
        went), so clients of the other groups need not wait for group 0."""
        try:
            self.placement = dict(self.request({"op": "placement"}, raft_group=0,
                                                 timeout=min(self.timeout, 5.0))["placement"])
        except Unavailable:
            pass

    def group_of(self, name: str) -> int:
        """The Raft group that holds tensor ``name`` (an index tensor goes with its tensor): its
        placement if it was moved (``move``), else the hash of its name."""
        if name.endswith(INDICES_SUFFIX):
            name = name[:-len(INDICES_SUFFIX)]
        count = self.groups()
        return self.placement.get(name, layout.group_of(name, count))

    def split(self, named: dict[str, Any]) -> dict[int, dict[str, Any]]:
        parts: dict[int, dict[str, Any]] = {}
        for name, value in named.items():
            parts.setdefault(self.group_of(name), {})[name] = value
        return dict(sorted(parts.items()))

    def each_group(self, write: Any, parts: dict[int, Any]) -> dict:
        """``write(group, part)`` for every group's part, in group order; one reply, merged.

        A part that names a tensor moved to another group (Moved) is split again with the new
        placement and sent there; one that names a tensor being moved (Moving) is sent again after
        a pause, until the client's timeout. Either refusal means nothing of that part was applied,
        so sending it again (with a new seq) applies it once."""
        return merge(self._replies(write, parts))

    def each_group_at_once(self, write: Callable[[int, Any, Call], dict],
                           parts: dict[int, Any] | list[tuple[int, Any]],
                           submit: Callable[[Callable[[Call], dict]], "Future[dict]"]) -> dict:
        """As each_group, but every group's part on its way at once: ``submit(send)`` runs
        ``send(call)`` on a thread with connections of its own (Client's push_async lanes), and
        ``write(group, part, call)`` sends one part over them. A part re-routed by a move goes on
        in its thread. One reply, merged in group order, as each_group's. ``parts`` may be a
        list of (group, part), several for one group (a chunked step's chunks): their replies
        merge as one group's."""
        items = list(parts.items()) if isinstance(parts, dict) else list(parts)
        futures = [self.submit_part(write, g, part, submit) for g, part in items]
        replies: dict[int, dict] = {}
        wait(futures)                   # every part's outcome, before any error is raised
        for future in futures:
            for g, reply in future.result().items():
                replies[g] = merge_same_group(replies[g], reply) if g in replies else reply
        return merge(dict(sorted(replies.items())))

    def submit_part(self, write: Callable[[int, Any, Call], dict], g: int, part: Any,
                    submit: Callable[[Callable[[Call], dict]], "Future[dict]"]) -> "Future[dict]":
        """One part of each_group_at_once, on its way alone: the future gives {group: reply}."""
        return submit(lambda call: self._replies(lambda g2, p2: write(g2, p2, call), {g: part}))

    def _replies(self, write: Any, parts: dict[int, Any]) -> dict[int, dict]:
        replies: dict[int, dict] = {}
        queue = list(parts.items())
        deadline = time.monotonic() + self.timeout
        pause = 0.02
        for _ in range(10_000):             # bounded: each turn sends one part (or waits, bounded by time)
            if not queue:
                return replies
            g, part = queue.pop(0)
            try:
                reply = write(g, part)
            except Moved as exc:
                self.refusals["Moved"] += 1
                queue = _requeue(queue, self.reroute(exc, g, part))
                continue
            except Moving:
                self.refusals["Moving"] += 1
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.25)
                queue.insert(0, (g, part))
                continue
            replies[g] = merge_same_group(replies[g], reply) if g in replies else reply
        raise Unavailable("a request kept being re-routed between groups: the placement keeps changing")

    def reroute(self, moved: Moved, group: int, part: Any) -> list[tuple[int, Any]]:
        """A part refused with Moved, split again by the new placement."""
        if part is None or moved.group is None or not isinstance(moved.tensor, str):
            raise moved
        with self._lock:
            self.learn_placement()
            self.placement[moved.tensor] = moved.group     # the refusal is at least this fresh
        names = dict(part) if isinstance(part, dict) else {n: None for n in part}
        parts = self.split(names)
        if group in parts and moved.tensor in {n[:-len(INDICES_SUFFIX)] if n.endswith(INDICES_SUFFIX) else n
                                               for n in parts[group]}:
            raise moved                      # cannot happen: the tensor would go where it was refused
        return [(g, sub if isinstance(part, dict) else list(sub)) for g, sub in parts.items()]

    def min_version(self, min_version: Any, group: int) -> int:
        if isinstance(min_version, dict):
            return int(min_version.get(group, 0))
        if min_version and self.groups() > 1:
            raise ValueError("with several Raft groups, min_version is a {group: version} map "
                             "(as push and pull return)")
        return int(min_version or 0)


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


def held_probe(message: dict) -> dict | None:
    """A large write sent again after an attempt that may have reached a node: the same write
    without its arrays, naming their content (payloads.content_hash), which a node that took the
    first attempt (or got the payload from that node as its leader) holds: it answers from its
    copy, or ``need_payload`` and the arrays go again. None for a write that cannot name one."""
    if message.get("op") not in HELD_OPS or "encoding" in message or not isinstance(message.get("tensors"), dict):
        return None
    _, _, content = digest_of(message["tensors"])
    return {**{k: v for k, v in message.items() if k != "tensors"}, "held": content,
            "held_names": sorted(message["tensors"])}


def _payload_bytes(message: dict) -> int:
    tensors = message.get("tensors")
    if not isinstance(tensors, dict):
        return 0
    return sum(a.nbytes for a in tensors.values() if isinstance(a, np.ndarray))


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


def merge_same_group(first: dict, second: dict) -> dict:
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


def merge(replies: dict[int, dict]) -> dict:
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
