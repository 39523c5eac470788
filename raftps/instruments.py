"""What the node's code paths count and time as it happens, between scrapes: the client server's
``ServerInstruments`` and each replica's ``Instruments``. The node and its replicas write to
these; metrics.py (the ``/metrics`` exporter) reads them, and imports the node, not the other way.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
APPLY_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)

ERRORS_HELP = "Errors by class: refused requests, internal errors, failed payload fetches"


class ServerInstruments:
    """What the node's client server counts as it happens, for the node as a whole (a request
    may span Raft groups): requests by op and outcome, client bytes, refused requests."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("raftps_requests", "Client requests answered, by op and outcome "
                                "(ok, retry, or the error's class)", ["op", "outcome"], registry=r)
        self.client_bytes = Counter("raftps_client_bytes", "Bytes of client frames, by direction (in, out)",
                                    ["direction"], registry=r)
        self.errors = Counter("raftps_errors", ERRORS_HELP, ["class"], registry=r)
        for direction in ("in", "out"):
            self.client_bytes.labels(direction)


class Instruments:
    """What one replica's code paths count and time as it happens: its writes, commits and
    applies, leader changes, snapshots and failed payload fetches."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.write_seconds = Histogram("raftps_write_seconds", "A write at the leader: payload replication, "
                                       "commit and apply, until its result", buckets=LATENCY_BUCKETS, registry=r)
        self.commit_seconds = Histogram("raftps_commit_seconds", "From proposing an entry to Raft to its apply "
                                        "on this leader", buckets=LATENCY_BUCKETS, registry=r)
        self.apply_seconds = Histogram("raftps_apply_seconds", "One log entry through the state machine",
                                       buckets=APPLY_BUCKETS, registry=r)
        self.leader_changes = Counter("raftps_leader_changes", "Times this node saw a new leader", registry=r)
        self.snapshots = Counter("raftps_snapshots", "Snapshots written (write) and loaded (load)",
                                 ["kind"], registry=r)
        self.errors = Counter("raftps_errors", ERRORS_HELP, ["class"], registry=r)
        for kind in ("write", "load"):
            self.snapshots.labels(kind)


class PlacementInstruments:
    """What the placement loop (server/placement_loop.py) counts on the node that runs it,
    group 0's leader: the steps it carries out, the catch-ups of new replicas, and the groups
    with fewer live replicas than they should have."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.changes = Counter("raftps_placement_changes", "Placement steps carried out by the placement loop, by "
                               "kind (balance, drain, refill, resume, abort, lead)", ["kind"], registry=r)
        self.catch_up_bytes = Counter("raftps_catch_up_bytes", "Bytes of state new replicas caught up with "
                                      "as learners (their group's model and optimizer state)", registry=r)
        self.catch_up_seconds = Histogram("raftps_catch_up_seconds", "From a move's learner starting to its "
                                          "having applied what the group had committed (a move of an older "
                                          "driver's, resumed past its learner: from the voter's add)",
                                          buckets=(0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500), registry=r)
        self.voting_window_seconds = Histogram("raftps_voting_window_seconds", "From a move's Raft add of its "
                                               "new replica to that voter having applied what the group had "
                                               "committed: the time the group has 4 voters, one catching up",
                                               buckets=(0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500), registry=r)
        self.host_load = Gauge("raftps_host_load", "Each host's load as of the placement loop's last heartbeat: "
                               "replicas, leaders, bytes (of the groups it serves), pushes_per_second (applied by "
                               "the groups it leads)", ["node", "kind"], registry=r)
        self.heartbeat_seconds = Gauge("raftps_placement_heartbeat_seconds", "How long the placement loop's last "
                                       "heartbeat of every host took (the hosts are asked at once: a host whose "
                                       "packets are dropped costs one connect timeout, 1 s)", registry=r)
        self.under_replicated = Gauge("raftps_groups_under_replicated", "Raft groups with fewer answering "
                                      "replicas than the hosts record places (as of the last heartbeat)", registry=r)
