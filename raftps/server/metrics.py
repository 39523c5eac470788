"""Prometheus metrics of one node, served over HTTP at ``/metrics`` (``raftps serve --metrics-port``).

Most of what a scrape shows is read from the node at scrape time by ``NodeCollector``: Raft role,
term, indices and peers' match indices from pysyncobj, the store's counters and staleness
histogram from the state machine, payload files from the payload store, connections from the
client server. Only what happens between scrapes and is not kept anywhere else is counted as it
happens: by the client server in ``ServerInstruments`` (requests by op and outcome, client bytes),
by each replica in its ``Instruments`` (write, commit and apply latencies, leader changes,
snapshots). Each node has its own registries, so several nodes in one process (tests) do not mix. Names follow Prometheus conventions: ``raftps_<thing>_<unit>``, ``_total`` for counters.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.registry import Collector

from raftps.instruments import Instruments, ServerInstruments

if TYPE_CHECKING:
    from raftps.server.node import RaftNode
    from raftps.server.server import ClientServer

log = logging.getLogger("raftps.server.metrics")
ROLES = ("follower", "candidate", "leader")
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 1024, 4096)


class InstrumentsCollector(Collector):
    """The server's and every hosted replica's instruments as one set of families. With several
    Raft groups a replica's samples carry a ``group`` label (one group: no label, as always); the
    server's do not, since a request may span groups. ``raftps_errors`` is fed by both: refused
    requests without a group, a replica's failed payload fetches with its group."""

    def __init__(self, server: ServerInstruments | None, replicas: "dict[int, Instruments]"):
        self.server = server
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        labelled = len(self.replicas) > 1
        sources: list[tuple[int | None, CollectorRegistry]] = [(None, self.server.registry)] if self.server else []
        sources += [(g, self.replicas[g].registry) for g in sorted(self.replicas)]
        families: dict[str, Metric] = {}
        values: dict[str, dict[tuple, Sample]] = {}
        for group, registry in sources:
            for metric in registry.collect():
                if metric.name not in families:
                    families[metric.name] = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                    values[metric.name] = {}
                samples = values[metric.name]
                for s in metric.samples:
                    labels = {**s.labels, "group": str(group)} if labelled and group is not None else dict(s.labels)
                    key = (s.name, tuple(sorted(labels.items())))
                    seen = samples.get(key)
                    if seen is None:
                        samples[key] = Sample(s.name, labels, s.value, s.timestamp, s.exemplar)
                    else:                    # one node's server and replica counting one class
                        merged = min(seen.value, s.value) if s.name.endswith("_created") else seen.value + s.value
                        samples[key] = seen._replace(value=merged)
        for name, metric in families.items():
            metric.samples = list(values[name].values())
            yield metric


class NodeCollector(Collector):
    """The node's state, read at scrape time. With several Raft groups every family of the
    group's state carries a ``group`` label, a sample per hosted group (one group: no label, as
    always)."""

    def __init__(self, node: "RaftNode | dict[int, RaftNode]", server: "ClientServer | None" = None):
        self.replicas = node if isinstance(node, dict) else {0: node}
        self.server = server

    def collect(self) -> Iterator[Metric]:
        groups = sorted(self.replicas)
        labelled = len(groups) > 1
        views = {g: self.replicas[g].status_record(count_files=True) for g in groups}

        def family(kind: Any, name: str, help_text: str, extra: list[str] | None = None) -> Any:
            return kind(name, help_text, labels=(["group"] if labelled else []) + (extra or []))

        def label(g: int) -> list[str]:
            return [str(g)] if labelled else []

        role = family(GaugeMetricFamily, "raftps_role", "1 for this node's Raft role", ["role"])
        for g in groups:
            for name in ROLES:
                role.add_metric(label(g) + [name], 1.0 if views[g].role == name else 0.0)
        yield role
        for key, help_text in [("term", "Raft term"), ("commit", "Raft commit index"),
                               ("applied", "Raft index of the last applied entry"),
                               ("version", "Store version (writes the state machine applied)"),
                               ("log_len", "Entries in the Raft log (since the last snapshot)"),
                               ("snapshot_index", "Raft index the newest snapshot covers"),
                               ("has_quorum", "1 if this node is connected to a majority of the nodes, itself included"),
                               ("tensors", "Tensors in the store"), ("sessions", "Client sessions in the store"),
                               ("model_bytes", "Bytes of tensors and optimizer state in the store")]:
            name = {"commit": "raftps_commit_index", "applied": "raftps_applied_index",
                    "version": "raftps_store_version", "log_len": "raftps_log_entries",
                    "model_bytes": "raftps_model_bytes"}.get(key, f"raftps_{key}")
            gauge = family(GaugeMetricFamily, name, help_text)
            for g in groups:
                gauge.add_metric(label(g), float(getattr(views[g], key)))
            yield gauge
        match = family(GaugeMetricFamily, "raftps_peer_match_index", "Leader only: the highest log index known "
                       "replicated on each peer", ["peer"])
        connected = family(GaugeMetricFamily, "raftps_peer_connected",
                           "1 if this node's Raft connection to the peer is up", ["peer"])
        for g in groups:
            for peer, index in sorted(views[g].match.items()):
                match.add_metric(label(g) + [peer], float(index))
            for peer, up in sorted(views[g].connected.items()):
                connected.add_metric(label(g) + [peer], float(up))
        yield match
        yield connected
        for name, key, help_text in [
                ("raftps_store_pushes", "pushes", "Pushes applied by the state machine (a sync step counts once)"),
                ("raftps_store_rejected", "rejected", "Writes the state machine refused (changed nothing)"),
                ("raftps_store_duplicates", "duplicates", "Retried writes answered from a client session, not applied again"),
                ("raftps_read_rounds", "read_rounds", "Leader: confirmation rounds that linearizable reads waited for"),
                ("raftps_lease_reads", "lease_reads", "Leader: linearizable reads served on its lease, without a round"),
                ("raftps_votes_withheld", "votes_withheld", "Vote requests refused while this node's lease promise held")]:
            counter = family(CounterMetricFamily, name, help_text)
            for g in groups:
                counter.add_metric(label(g), float(getattr(views[g], key)))
            yield counter
        staleness: dict[int, int] = {}
        for g in groups:                     # one histogram for the node: pushes are pushes
            for tau, n in views[g].staleness.items():
                staleness[tau] = staleness.get(tau, 0) + n
        yield _staleness(staleness)
        for kind, name, help_text, value in [
                (GaugeMetricFamily, "raftps_payload_bytes", "Bytes of payload files waiting for a snapshot",
                 lambda g: views[g].payload_disk_bytes),
                (GaugeMetricFamily, "raftps_payload_files", "Payload files waiting for a snapshot", lambda g: views[g].payload_files),
                (GaugeMetricFamily, "raftps_payload_spare_files", "Collected payload files kept for reuse",
                 lambda g: views[g].payload_spare_files),
                (GaugeMetricFamily, "raftps_payload_spare_bytes", "Bytes of spare payload files",
                 lambda g: views[g].payload_spare_bytes),
                (CounterMetricFamily, "raftps_fetched_payloads", "Payloads fetched from peers (missed puts)",
                 lambda g: views[g].fetched_payloads),
                (CounterMetricFamily, "raftps_fetched_bytes", "Bytes of payloads fetched from peers",
                 lambda g: views[g].fetched_bytes)]:
            metric = family(kind, name, help_text)
            for g in groups:
                metric.add_metric(label(g), float(value(g)))
            yield metric
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


def serve(node: "RaftNode", server: "ClientServer | None", host: str, port: int,
          tls: tuple[str, str] | None = None, extra: CollectorRegistry | None = None) -> Any:
    """Serve ``/metrics`` on host:port (HTTPS with ``tls`` = (cert, key)); None if it cannot bind.
    The state and instruments of every Raft group the server hosts (``node`` alone without a
    server), each group's labelled ``group`` when there are several, the server's counters, and
    ``extra``'s (the placement loop's, hosting.py).

    A node that cannot bind its metrics port logs why and serves clients without metrics: losing
    monitoring must not take a Raft member out of the cluster."""
    replicas = server.replicas if server is not None else {0: node}
    registry = CollectorRegistry(auto_describe=True)
    registry.register(NodeCollector(replicas, server))
    registry.register(InstrumentsCollector(server.instruments if server is not None else None,
                                           {g: r.instruments for g, r in replicas.items()}))
    if extra is not None:
        registry.register(extra)
    try:
        http, _ = start_http_server(port, addr=host, registry=registry,
                                    certfile=tls[0] if tls else None, keyfile=tls[1] if tls else None)
    except OSError as exc:
        log.error("metrics: cannot serve on %s:%d (%s); going on without /metrics", host, port, exc)
        return None
    return http
