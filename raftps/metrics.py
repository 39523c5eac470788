"""Prometheus metrics of one node, served over HTTP at ``/metrics`` (``raftps serve --metrics-port``).

Most of what a scrape shows is read from the node at scrape time by ``NodeCollector``: Raft role,
term, indices and peers' match indices from pysyncobj, the store's counters and staleness
histogram from the state machine, payload files from the payload store, connections from the
client server. Only what happens between scrapes and is not kept anywhere else is counted as it
happens, in ``Instruments``: requests by op and outcome, client bytes, commit and apply latencies,
leader changes, snapshots. Each node has its own registry, so several nodes in one process (tests)
do not mix. Names follow Prometheus conventions: ``raftps_<thing>_<unit>``, ``_total`` for counters.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .node import RaftNode
    from .server import ClientServer

log = logging.getLogger("raftps.metrics")
ROLES = ("follower", "candidate", "leader")
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
APPLY_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 1024, 4096)


class Instruments:
    """What the node's code paths count and time as it happens."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("raftps_requests", "Client requests answered, by op and outcome "
                                "(ok, retry, or the error's class)", ["op", "outcome"], registry=r)
        self.client_bytes = Counter("raftps_client_bytes", "Bytes of client frames, by direction (in, out)",
                                    ["direction"], registry=r)
        self.write_seconds = Histogram("raftps_write_seconds", "A write at the leader: payload replication, "
                                       "commit and apply, until its result", buckets=LATENCY_BUCKETS, registry=r)
        self.commit_seconds = Histogram("raftps_commit_seconds", "From proposing an entry to Raft to its apply "
                                        "on this leader", buckets=LATENCY_BUCKETS, registry=r)
        self.apply_seconds = Histogram("raftps_apply_seconds", "One log entry through the state machine",
                                       buckets=APPLY_BUCKETS, registry=r)
        self.leader_changes = Counter("raftps_leader_changes", "Times this node saw a new leader", registry=r)
        self.snapshots = Counter("raftps_snapshots", "Snapshots written (write) and loaded (load)",
                                 ["kind"], registry=r)
        self.errors = Counter("raftps_errors", "Errors by class: refused requests, internal errors, "
                              "failed payload fetches", ["class"], registry=r)
        for kind in ("write", "load"):
            self.snapshots.labels(kind)
        for direction in ("in", "out"):
            self.client_bytes.labels(direction)


class NodeCollector(Collector):
    """The node's state, read at scrape time."""

    def __init__(self, node: "RaftNode", server: "ClientServer | None" = None):
        self.node = node
        self.server = server

    def collect(self) -> Iterator[Metric]:
        node = self.node
        view = node.metrics_view()
        role = GaugeMetricFamily("raftps_role", "1 for this node's Raft role", labels=["role"])
        for name in ROLES:
            role.add_metric([name], 1.0 if view["role"] == name else 0.0)
        yield role
        for key, help_text in [("term", "Raft term"), ("commit", "Raft commit index"),
                               ("applied", "Raft index of the last applied entry"),
                               ("version", "Store version (Raft index of the last entry the state machine applied)"),
                               ("log_len", "Entries in the Raft log (since the last snapshot)"),
                               ("snapshot_index", "Raft index the newest snapshot covers"),
                               ("has_quorum", "1 if this node is connected to a majority of the nodes, itself included"),
                               ("tensors", "Tensors in the store"), ("sessions", "Client sessions in the store"),
                               ("model_bytes", "Bytes of tensors and optimizer state in the store")]:
            name = {"commit": "raftps_commit_index", "applied": "raftps_applied_index",
                    "version": "raftps_store_version", "log_len": "raftps_log_entries",
                    "model_bytes": "raftps_model_bytes"}.get(key, f"raftps_{key}")
            yield GaugeMetricFamily(name, help_text, value=float(view[key]))
        match = GaugeMetricFamily("raftps_peer_match_index", "Leader only: the highest log index known "
                                  "replicated on each peer", labels=["peer"])
        for peer, index in sorted(view["match"].items()):
            match.add_metric([peer], float(index))
        yield match
        connected = GaugeMetricFamily("raftps_peer_connected", "1 if this node's Raft connection to the peer is up",
                                      labels=["peer"])
        for peer, up in sorted(view["connected"].items()):
            connected.add_metric([peer], float(up))
        yield connected
        for key, help_text in [("pushes", "Pushes applied by the state machine (a sync step counts once)"),
                               ("rejected", "Writes the state machine refused (changed nothing)"),
                               ("duplicates", "Retried writes answered from a client session, not applied again")]:
            yield CounterMetricFamily(f"raftps_store_{key}", help_text, value=float(view[key]))
        yield _staleness(view["staleness"])
        payloads = node.payloads
        files, spares = _payload_files(payloads.directory)
        yield GaugeMetricFamily("raftps_payload_bytes", "Bytes of payload files waiting for a snapshot",
                                value=float(payloads.disk_bytes))
        yield GaugeMetricFamily("raftps_payload_files", "Payload files waiting for a snapshot", value=float(files))
        yield GaugeMetricFamily("raftps_payload_spare_files", "Collected payload files kept for reuse",
                                value=float(spares))
        yield GaugeMetricFamily("raftps_payload_spare_bytes", "Bytes of spare payload files",
                                value=float(payloads.spare_bytes_held))
        yield CounterMetricFamily("raftps_fetched_payloads", "Payloads fetched from peers (missed puts)",
                                  value=float(node.fetched[0]))
        yield CounterMetricFamily("raftps_fetched_bytes", "Bytes of payloads fetched from peers",
                                  value=float(node.fetched[1]))
        if self.server is not None:
            yield GaugeMetricFamily("raftps_client_connections", "Open client connections",
                                    value=float(self.server.open_connections()))


def _staleness(histogram: dict[int, int]) -> Metric:
    """The store's exact staleness counts (tau -> pushes) as a Prometheus histogram."""
    buckets, total = [], 0
    for bound in STALENESS_BUCKETS:
        buckets.append((str(float(bound)), float(sum(n for tau, n in histogram.items() if tau <= bound))))
    total = sum(histogram.values())
    buckets.append(("+Inf", float(total)))
    return HistogramMetricFamily("raftps_push_staleness", "Staleness tau of pushes with a base version: updates "
                                 "to the tensor after the version the worker pulled", buckets=buckets,
                                 sum_value=float(sum(tau * n for tau, n in histogram.items())))


def _payload_files(directory: str) -> tuple[int, int]:
    files = spares = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name == "OWNER" or entry.name.endswith(".tmp"):
                    continue
                if entry.name.endswith(".spare"):
                    spares += 1
                else:
                    files += 1
    except OSError:
        pass
    return files, spares


def serve(node: "RaftNode", server: "ClientServer", host: str, port: int,
          tls: tuple[str, str] | None = None) -> Any:
    """Serve ``/metrics`` on host:port (HTTPS with ``tls`` = (cert, key)); None if it cannot bind.

    A node that cannot bind its metrics port logs why and serves clients without metrics: losing
    monitoring must not take a Raft member out of the cluster."""
    node.instruments.registry.register(NodeCollector(node, server))
    try:
        http, _ = start_http_server(port, addr=host, registry=node.instruments.registry,
                                    certfile=tls[0] if tls else None, keyfile=tls[1] if tls else None)
    except OSError as exc:
        log.error("metrics: cannot serve on %s:%d (%s); going on without /metrics", host, port, exc)
        return None
    return http
