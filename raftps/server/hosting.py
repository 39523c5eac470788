"""A node's replicas kept in step with the hosts record (hosts.py; docs/design/elastic.md).

A node of a cluster of several Raft groups runs one replica per group the record gives it. At
start that is its data dir's copy of the newest record it saw (``hosts.json``), else the formula
(groups.py): a cluster that never changed starts as it always did. A node started with
``--join`` has no copy and hosts nothing until the record names it. Then a thread asks group 0's
members for the record every ``poll`` seconds (any replica's copy: records are numbered by their
epoch, and a node only ever moves to a newer one) and, for a newer record, starts the replicas
of the groups that now name this node and stops the ones that no longer do (their data dir is
set aside, ``group<g>.left-e<epoch>``). The node's layout op and the member op's checks read the
record through this object, so clients route by it.

A move's target first runs a non-voting learner of the group (the record's stages "learn" and
"add": ``learners``), which catches up into the replica's own data dir. Once the group's log
makes the node a member (the move's Raft add, which reaches the learner as any entry does, and
is in force on append) or the record reaches "catch_up", whichever comes first, the node stops
the learner and starts the voter on the same files: a voter started before its add could only
raise its term, unheard, and disturb the group when it is added. A move rolled back stops the
learner (or the voter) and sets its files aside. Learners serve no client: they are not in
``replicas``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from typing import Any, Callable

from raftps import codec
from raftps.groups import Layout, data_dir, group_config
from raftps.store.hosts import Hosts
from raftps.server.placement_loop import PlacementLoop
from raftps.raft.durability import Durability
from raftps.replica.config import NodeConfig, offset_address
from raftps.client.transport import TcpTransport

log = logging.getLogger("raftps.server.hosting")
RECORD_FILE = "hosts.json"
LEARNER_CHECK = 0.2        # seconds between looks at whether a learner's group has made it a member


class Hosting:
    def __init__(self, config: NodeConfig, layout: Layout, make_replica: Callable[[NodeConfig], Any],
                 join: bool = False, poll: float = 1.0, dead_host_timeout: float = 0.0, balance: bool = False):
        self.config = config
        self.node = config.node_id
        self.replicas: dict[int, Any] = {}        # Raft group -> this node's replica (RaftNode); shared
        self.learners: dict[int, Any] = {}        # Raft group -> this node's learner (a move's target)
        self._make_replica = make_replica
        self._file = os.path.join(config.data_dir, RECORD_FILE)
        self.current: Hosts | None = self._load() or (None if join else Hosts.from_layout(layout))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poll = poll
        self._loop = PlacementLoop(config.client_token, dead_host_timeout, self._applied_here, self._leads_group_0,
                                   balance=balance) \
            if (dead_host_timeout > 0 or balance) and config.client_token is not None and not config.tls_cert else None
        # the placement loop's counters, for /metrics (on every node: the loop runs on whichever leads group 0)
        self.metrics_registry = self._loop.instruments.registry if self._loop is not None else None
        self.drained = threading.Event()          # set when a record leaves this node nothing to host
        self._seeds = [offset_address(a, config.client_offset) for a in layout.nodes]
        # the formula, the base of the record's first change; a joining node's --peers are not
        # the ones the cluster started with, so it offers none (it is never group 0's first leader)
        self._base = {} if join else layout.base_fields()

    # ---- what the handlers read (the layout op, member checks), as of groups.Layout -----------

    @property
    def groups(self) -> int:
        return self.current.groups if self.current else 1

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.current.nodes if self.current else ()

    def members(self, group: int) -> list[int]:
        return self.current.members(group)

    def base_fields(self) -> dict:
        return self._base

    def member_change_refusal(self, group: int, action: str, address: str) -> str | None:
        """Why a Raft membership change of ``group`` must not run now, or None: with several
        groups only the move the record has in flight may add its target or remove its source
        (or, aborting, its target). The node may not have polled the record since the move
        started: it reads it once more before it refuses."""
        if self._allows(group, action, address):
            return None
        self.refresh()
        if self._allows(group, action, address):
            return None
        return (f"Raft group {group} has no move in flight that {action}s {address}: with several Raft groups, "
                "membership changes go through the hosts record: to replace a host, raftps cluster add-host NEW, "
                "then drain-host OLD (or raftps hosts move)")

    def _allows(self, group: int, action: str, address: str) -> bool:
        hosts = self.current
        move = hosts.move_of(group) if hosts else None
        return move is not None and (action, address) in (("add", hosts.raft_address(move.target, group)),
                                                          ("remove", hosts.raft_address(move.source, group)),
                                                          ("remove", hosts.raft_address(move.target, group)))

    # ---- start, follow, stop ---------------------------------------------------------------

    def start(self) -> None:
        """Start the replicas the record gives this node (none for a joining node yet), then the
        thread that follows the record."""
        if self.current is not None:
            for group in self.current.hosted_by(self.node):
                self.replicas[group] = self._make_replica(group_config(self.config, self.current, group))
            self._follow_learners(self.current)       # a learner's host restarted: it goes on from its files
        threading.Thread(target=self._run, name="hosting", daemon=True).start()
        if self._loop is not None:
            self._loop.start()

    def stop(self) -> None:
        self._stop.set()
        if self._loop is not None:
            self._loop.stop()
        with self._lock:
            for group in sorted(self.learners):
                self._stop_learner(group)

    def _applied_here(self) -> Hosts | None:
        """The record as this node's replica of group 0 has applied it (the newest there is, on
        group 0's leader: the placement loop decides from it), else the one this node follows."""
        replica = self.replicas.get(0)
        record = replica.read_locked(lambda m: m.hosts.snapshot()) if replica is not None else None
        return Hosts.from_record(record) if record is not None else self.current

    def _leads_group_0(self) -> bool:
        replica = self.replicas.get(0)
        return replica is not None and replica.is_leader()

    def _run(self) -> None:
        if self.config.client_token is None or self.config.tls_cert:
            # it reads the record over the client port with the cluster's token, without TLS
            # (docs/design/elastic.md, "What is next")
            log.warning("this node does not follow the hosts record: it needs --token-file and no --tls-cert")
            return
        transport = self._transport()             # its connections kept from one poll to the next
        polled = time.monotonic()
        try:
            while not self._stop.wait(min(self._poll, LEARNER_CHECK)):
                if time.monotonic() - polled >= self._poll:
                    polled = time.monotonic()
                    self.refresh(transport)
                self._promote_joined()
        finally:
            transport.close()

    def _promote_joined(self) -> None:
        """A learner whose group's log has just made this node a member becomes the voter now,
        on the learner's files, not at the next record: with a member of the group down, the
        add commits only once this voter answers."""
        with self._lock:
            hosts = self.current
            for group in sorted(self.learners):
                # only once the record says the add is due: a learner restarted on the files of an
                # attempt rolled back since may still hold that attempt's add (a stale member)
                move = hosts.move_of(group) if hosts is not None else None
                if move is None or move.target != self.node or move.stage != "add" or not self.learners[group].joined():
                    continue
                log.warning("Raft group %d's log has this node as a member: its learner hands over to the voter",
                            group)
                self._stop_learner(group)
                try:
                    config = dataclasses.replace(learner_config(self.config, hosts, group), learner=False)
                    self.replicas[group] = replica = self._make_replica(config)
                    replica.set_preferred_leader(hosts.raft_address(hosts.preferred_leader(group), group))
                except Exception:         # a voter that would not start: the record's catch_up starts it
                    log.exception("starting this node's voter of Raft group %d failed", group)

    def _transport(self) -> TcpTransport:
        return TcpTransport(self.config.client_token, None, codec.DEFAULT_LIMITS, connect_timeout=2.0)

    def refresh(self, transport: TcpTransport | None = None) -> None:
        """Ask group 0's members for the record once, and follow the newest they answer."""
        own = transport or self._transport()
        try:
            newest = self._fetch(own)
            if newest is not None:
                self.follow(newest)
        except Exception:                         # a replica that would not start: try again next poll
            log.exception("following the hosts record failed")
        finally:
            if transport is None:
                own.close()

    def _fetch(self, transport: TcpTransport) -> Hosts | None:
        """The newest record group 0's members answer (each its own copy), or None."""
        if self.current is not None:
            asked = [offset_address(self.current.raft_address(m, 0), self.config.client_offset)
                     for m in self.current.members(0)]
        else:
            asked = self._seeds
        newest = None
        for address in asked:
            try:
                reply = transport.call(address, {"op": "hosts"}, 2.0)
                if reply.get("hosts") is not None:
                    record = Hosts.from_record(reply["hosts"])
                    newest = record if newest is None or record.epoch > newest.epoch else newest
            except (OSError, ConnectionError, ValueError) as exc:
                log.debug("hosts from %s: %s", address, exc)
            except Exception as exc:              # AuthenticationFailed: no token this cluster takes
                log.warning("cannot read the hosts record from %s: %s", address, exc)
        return newest

    def follow(self, newest: Hosts) -> None:
        """Take up ``newest`` if it is newer than what this node follows."""
        with self._lock:
            if self.current is not None and newest.epoch <= self.current.epoch:
                return
            self._save(newest)
            self.current = newest
            hosted = bool(self.replicas)
            # a voter started from its learner at stage add (``_promote_joined``) stays; at stage
            # learn (a new attempt after a rollback) it goes, and a learner starts afresh
            wanted = set(newest.hosted_by(self.node)) | {
                g for g in self.replicas if newest.learner_of(g) == self.node and newest.move_of(g).stage == "add"}
            for group in sorted(set(self.replicas) - wanted):
                log.warning("hosts epoch %d: stopping this node's replica of Raft group %d", newest.epoch, group)
                self.replicas.pop(group).stop(snapshot_timeout=0.0)
                self._set_aside(group, newest.epoch)
            self._follow_learners(newest)
            for group in sorted(wanted - set(self.replicas)):
                log.warning("hosts epoch %d: starting this node's replica of Raft group %d", newest.epoch, group)
                config = dataclasses.replace(group_config(self.config, newest, group), metrics_port=0)
                self.replicas[group] = self._make_replica(config)
            for group, replica in self.replicas.items():      # the named leaders (set_leader)
                replica.set_preferred_leader(newest.raft_address(newest.preferred_leader(group), group))
            # a node that served and now serves nothing was drained; a host started with --join
            # before the record gives it a group (replace, add-host) waits for one
            if not self.replicas and (hosted or self.node in newest.draining):
                self.drained.set()

    def _follow_learners(self, newest: Hosts) -> None:
        """Run a learner for each group whose move in flight targets this node at stage learn or
        add; stop the others. A learner whose move reached catch_up leaves its files for the
        voter that starts on them next; one whose move is gone (rolled back) has them set aside."""
        learning = {g for g in range(newest.groups) if newest.learner_of(g) == self.node}
        for group in sorted(set(self.learners) - learning):
            promoted = self.node in newest.members(group)
            log.warning("hosts epoch %d: stopping this node's learner of Raft group %d (%s)", newest.epoch, group,
                        "the voter starts on its files" if promoted else "the move was rolled back")
            self._stop_learner(group)
            if not promoted:
                self._set_aside(group, newest.epoch)
        for group in sorted(learning - set(self.learners) - set(self.replicas)):
            log.warning("hosts epoch %d: starting a learner of Raft group %d", newest.epoch, group)
            self.learners[group] = self._make_replica(learner_config(self.config, newest, group))

    def _stop_learner(self, group: int, timeout: float = 15.0) -> None:
        """Stop a learner and wait for its Raft thread to end: the voter opens the same journal."""
        learner = self.learners.pop(group)
        learner.stop(snapshot_timeout=0.0)
        deadline = time.monotonic() + timeout
        while learner.tick_thread_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if learner.tick_thread_alive():
            log.error("the learner of Raft group %d did not stop within %.0f s", group, timeout)

    def _set_aside(self, group: int, epoch: int) -> None:
        """A left replica's files, kept but out of the way: a later replica of the group starts
        empty. Its payloads in tmpfs (raft/durability.py) are deleted: they are named after the
        data dir's path, so a later replica of the group would find them as its own; its peers
        hold every payload it had."""
        if group and not self.config.payload_dir:
            durability = Durability.for_mode(self.config.durability)
            if not durability.durable:
                shutil.rmtree(durability.payload_dir(data_dir(self.config.data_dir, group)), ignore_errors=True)
        for base in {self.config.data_dir, self.config.payload_dir} - {None}:
            path = data_dir(base, group)
            if group and os.path.isdir(path):
                os.rename(path, f"{path}.left-e{epoch}")

    def _load(self) -> Hosts | None:
        try:
            with open(self._file) as f:
                return Hosts.from_record(json.load(f))
        except FileNotFoundError:
            return None

    def _save(self, hosts: Hosts) -> None:
        os.makedirs(self.config.data_dir, exist_ok=True)
        tmp = self._file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(hosts.record(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._file)


def learner_config(config: NodeConfig, hosts: Hosts, group: int) -> NodeConfig:
    """The config of this node's learner of ``group``: the replica's config as it will be once
    the move's target is a member (its data dir, its addresses, the members as peers), marked
    learner, without /metrics of its own."""
    joined = tuple(dataclasses.replace(m, stage="catch_up") if m.group == group else m for m in hosts.moves)
    return dataclasses.replace(group_config(config, dataclasses.replace(hosts, moves=joined), group),
                               learner=True, metrics_port=0)
