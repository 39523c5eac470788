"""The operator's side of elastic hosts (``raftps hosts``; docs/design/elastic.md): add a host to
the hosts record, move one Raft group's replica from one node to another, online, or roll a
move back (``abort``: its target leaves the group, then the record forgets the move).

A move is six steps, each idempotent, so running the command again after any crash goes on
where it stopped (the record says which stage the group's move is at):

1. ``move_start`` in group 0 (stage "learn"): the intent (one move per group at a time). The
   target's node runs a non-voting learner of the group (hosting.py), which catches up from the
   group's leader into the replica's own files (its snapshot, then the log; payloads from its
   peers). Membership is unchanged: the group commits with its 3 voters as before;
2. once the learner has applied what the group had committed: ``move_stage`` add in group 0;
3. Raft add: the group's log makes the target a member (4 voters). A source whose node does not
   answer is removed first: 2 live voters of 2, then 3 with the target;
4. ``move_stage`` catch_up in group 0: the target's node stops its learner and starts its voter
   on the learner's files, so what it still has to catch up is the log since step 2;
5. when the target has applied what the group had committed: Raft remove of the source (a
   leader hands leadership over first, and the request is sent again to the new leader);
6. ``move_done`` in group 0: the source's node stops its replica.

A move left at stage "add" by an older driver goes on from step 3 (its target catches up as a
voter, from nothing).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from raftps import auth, codec
from raftps.errors import InvalidRequest, Unavailable
from raftps.store.hosts import Hosts
from raftps.client.router import Router, parse_addresses
from raftps.client.session import Session
from raftps.replica.config import NodeConfig, offset_address
from raftps.client.transport import TcpTransport

CLIENT_OFFSET = NodeConfig.client_offset      # a node's client port: its Raft port + this


class HostsAdmin:
    """Requests to one cluster's Raft groups, by group: a router and a session of its own."""

    def __init__(self, addresses: str | list[str] | None, token: str | None = None, tls: Any = None,
                 timeout: float = 60.0, attempt_timeout: float = 30.0, connect_timeout: float = 2.0):
        self._transport = TcpTransport(auth.client_token(token), auth.client_tls_context(tls), codec.DEFAULT_LIMITS,
                                       connect_timeout=connect_timeout)
        self._router = Router(parse_addresses(addresses), self._transport, Session(), timeout, attempt_timeout,
                              threading.RLock())
        self.timeout = timeout
        # the last move's (seconds, bytes) of catch-up, its learner's (a move resumed past its
        # learner: its voter's), and the seconds from its Raft add to its voter caught up
        self.last_catch_up: tuple[float, int] | None = None
        self.last_voting_window: float | None = None

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> "HostsAdmin":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- reads and writes ------------------------------------------------------------------

    def groups(self) -> int:
        """How many Raft groups the cluster runs."""
        return self._router.groups()

    def hosts(self) -> Hosts:
        """Group 0's hosts record (as its leader has applied it), or the formula when there is none."""
        if self._router.groups() == 1:
            raise InvalidRequest("this cluster runs one Raft group: its members change with raftps member "
                                 "(hosts are placed per group only with serve --groups G, G > 1)")
        record = self._router.request({"op": "hosts"}, raft_group=0)["hosts"]
        if record is not None:
            return Hosts.from_record(record)
        layout = self._router.request({"op": "layout"}, to_leader=False)
        nodes = [_raft_of_client(a) for a in layout["nodes"]]
        return Hosts(tuple(nodes), tuple(tuple(m) for m in layout["members"]))

    def change(self, action: str, **fields: Any) -> Hosts:
        """One hosts_change entry through group 0's log: the record after it."""
        self._router.groups()                     # the layout first: group 0's members
        return Hosts.from_record(self._router.write("hosts_change", raft_group=0, action=action, **fields)["hosts"])

    def member(self, group: int, action: str, address: str) -> dict:
        """A Raft membership change of ``group`` (on its leader; retried through a leader hand-over)."""
        return self._router.request({"op": "member", "action": action, "node": address}, raft_group=group)

    def group_rows(self, hosts: Hosts, group: int) -> list[dict]:
        """The status rows for ``group`` of every node in ``hosts`` (nodes that do not answer are left out)."""
        return [r for rows in self.status_rows(hosts).values() for r in rows if r.get("group", 0) == group]

    def status_rows(self, hosts: Hosts, timeout: float = 5.0, learners: bool = False) -> dict[int, list[dict]]:
        """Every answering node's status rows (one per Raft group it serves), by node id: the
        hosts' heartbeat (groups, leaders, bytes of state, pushes). The nodes are asked at once,
        one thread each (each node has its own connection), so a host whose packets are dropped costs
        the call one connect timeout (or ``timeout``), not one per silent host. ``learners``: with
        the rows of the learners a node runs (role "learner"), which serve no group yet."""
        def ask(address: str) -> list[dict] | None:
            try:
                reply = self._transport.call(offset_address(address, CLIENT_OFFSET), {"op": "status", "digest": False},
                                             timeout)
            except (OSError, ConnectionError):
                return None
            # a reply without a role is a refusal (a node still starting): it answered, with no rows
            return [r for r in reply.get("groups", [reply]) + (reply.get("learners", []) if learners else [])
                    if r.get("role") not in (None, "down")]
        with ThreadPoolExecutor(max_workers=len(hosts.nodes), thread_name_prefix="heartbeat") as pool:
            replies = list(pool.map(ask, hosts.nodes))
        return {node: rows for node, rows in enumerate(replies, 1) if rows is not None}

    # ---- the operations --------------------------------------------------------------------

    def add_host(self, address: str) -> Hosts:
        """Put a new node in the record (node id N+1); it serves nothing until a move targets it.
        Start it with ``serve --join``."""
        return self.change("add_host", address=address)

    def drain_host(self, address: str) -> Hosts:
        """Mark a host draining: the placement loop moves its replicas to the others, and once it
        serves nothing its node exits. Refused below 3 hosts that are not draining."""
        return self.change("drain_host", address=address)

    def set_leader(self, group: int, node: int) -> Hosts:
        """Name the node that should lead ``group``: its leader hands over (replica/upkeep.py)."""
        return self.change("set_leader", move_group=group, target=node)

    def move(self, group: int, source: str, target: str, catch_up_timeout: float = 120.0,
             gone_after: float | None = None) -> tuple[Hosts, bool]:
        """Move ``group``'s replica from node ``source`` to node ``target`` (node Raft addresses,
        as in --peers); see the module docstring. Returns the record after the move, and False
        if the move had been made before."""
        hosts = self.hosts()
        if not 0 <= group < hosts.groups:
            raise InvalidRequest(f"Raft group {group} is out of range: this cluster has groups 0..{hosts.groups - 1}")
        if group == 0:
            raise InvalidRequest("moving a replica of Raft group 0 (the hosts record's own group) is not built yet: "
                                 "its files share the node's data dir")
        src, tgt = hosts.node_of(source), hosts.node_of(target)
        if tgt in hosts.placed[group] and src not in hosts.placed[group] and hosts.move_of(group) is None:
            return hosts, False                       # done already (a finished move run again)
        self.last_catch_up = self.last_voting_window = learned = added = None
        move = hosts.move_of(group)
        if move is None or (move.source, move.target) != (src, tgt):
            hosts = self.change("move_start", move_group=group, source=src, target=tgt, learn=True)
            move = hosts.move_of(group)
        if move.stage == "learn":
            self._wait_caught_up(hosts, group, tgt, catch_up_timeout, gone_after, learner=True)
            learned = self.last_catch_up
            hosts = self.change("move_stage", move_group=group, stage="add")
            move = hosts.move_of(group)
        if move.stage == "add":
            added = time.monotonic()
            if not any(r.get("node") == src for r in self.group_rows(hosts, group)):
                # a dead source goes first (as member replace does for one group): with it still
                # a voter, the target's add would need the target's voter to commit
                self.member(group, "remove", hosts.raft_address(src, group))
            self._add(hosts, group, tgt)
            hosts = self.change("move_stage", move_group=group)
        self._wait_caught_up(hosts, group, tgt, catch_up_timeout, gone_after)
        if added is not None:
            self.last_voting_window = time.monotonic() - added
        if learned is not None:
            self.last_catch_up = learned          # the copy is the learner's; the voter's is the delta
        self.member(group, "remove", hosts.raft_address(src, group))
        return self.change("move_done", move_group=group), True

    def drain(self, address: str, catch_up_timeout: float = 120.0,
              on_plan: Callable[[int, int], None] = lambda done, total: None) -> tuple[Hosts, int]:
        """Move every replica off node ``address`` (hosts.drain_plan chooses where: a node being
        replaced sends them all to its replacement), one group at a time; its node then exits.
        Refused, with nothing changed, when a group would fall short of replicas or the node
        serves group 0. ``on_plan(done, total)``: before each move and after the last. Returns
        the record and the moves made."""
        hosts = self.hosts()
        plan = hosts.drain_plan(hosts.node_of(address))
        if any(group == 0 for group, _ in plan):
            raise InvalidRequest(f"{address} serves Raft group 0, whose replica cannot be moved yet: "
                                 "draining it is not built")
        moved = 0
        for done, (group, target) in enumerate(plan):
            on_plan(done, len(plan))
            hosts, made = self.move(group, address, hosts.nodes[target - 1], catch_up_timeout)
            moved += made
        on_plan(len(plan), len(plan))
        return hosts, moved

    def abort(self, group: int) -> Hosts:
        """Roll back ``group``'s move in flight: its target leaves the group's Raft membership (if
        it joined), then the record forgets the move. Nothing to abort: InvalidRequest."""
        hosts = self.hosts()
        move = hosts.move_of(group) if 0 <= group < hosts.groups else None
        if move is None:
            raise InvalidRequest(f"Raft group {group} has no move in flight: nothing to abort")
        if move.stage != "learn":                 # a learner changed no membership
            self.member(group, "remove", hosts.raft_address(move.target, group))
        return self.change("move_abort", move_group=group)

    def _add(self, hosts: Hosts, group: int, target: int) -> None:
        """Raft add of ``target``. With one old member down besides the source, the add commits only
        once the target's voter (started at stage catch_up, next) answers: it is in force from
        the moment the leader appends it, so once the leader lists it the move goes on."""
        address = hosts.raft_address(target, group)
        try:
            self.member(group, "add", address)
        except Unavailable:
            if address not in self._router.request({"op": "member", "action": "list"}, raft_group=group)["members"]:
                raise

    def _wait_caught_up(self, hosts: Hosts, group: int, target: int, timeout: float,
                        gone_after: float | None = None, learner: bool = False) -> None:
        """Until the target's replica (``learner``: its learner) has applied what the group's
        leader had committed when we started waiting (bounded; Unavailable sooner if the target's
        node has not answered for ``gone_after`` seconds). Notes the catch-up's time and bytes in
        ``last_catch_up``."""
        start = seen = time.monotonic()
        deadline = start + timeout
        goal = None
        last: Any = "no answer yet"
        while time.monotonic() < deadline:
            answered = self.status_rows(hosts, timeout=2.0, learners=learner)
            rows = [r for node_rows in answered.values() for r in node_rows if r.get("group", 0) == group]
            leader = next((r for r in rows if r.get("role") == "leader"), None)
            if goal is None and leader is not None:
                goal = leader["commit"]
            role = ("learner",) if learner else ("leader", "follower", "candidate")
            mine = next((r for r in rows if r.get("node") == target and r.get("role") in role), None)
            last = mine and mine.get("applied")
            if goal is not None and mine is not None and mine["applied"] >= goal:
                self.last_catch_up = (time.monotonic() - start, int(mine.get("model_bytes") or 0))
                return
            if target in answered:
                seen = time.monotonic()
            if gone_after is not None and time.monotonic() - seen > gone_after:
                raise Unavailable(f"node {target} stopped answering while its replica of Raft group {group} caught "
                                  f"up; roll the move back with raftps hosts abort {group}")
            time.sleep(0.2)
        raise Unavailable(f"Raft group {group}'s new replica on node {target} did not catch up within {timeout:.0f} s "
                          f"(applied {last}, goal {goal}): is its node running (serve --join)? Run the command "
                          "again to go on")


def _raft_of_client(client_address: str) -> str:
    return offset_address(client_address, -CLIENT_OFFSET)
