"""Every node's /metrics over real HTTP, parsed with prometheus_client's own parser, against status()."""
import json
import os
import re
import socket
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raftps import UnknownTensor
from tests.conftest import wait_converged

BASE = 24050


def scrape(address: str) -> dict:
    """{(sample name, frozenset of labels): value} of one node's /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_every_node_serves_metrics_that_match_status(make_cluster):
    cl = make_cluster(BASE)
    n = 1 << 18                                                    # 1 MiB: through the data plane
    with cl.client(timeout=30) as c:
        c.create("m.w", np.zeros(n, np.float32), {"name": "sgd", "lr": 0.1})
        base = c.push({"m.w": np.ones(n, np.float32)})
        for _ in range(4):
            c.push({"m.w": np.ones(n, np.float32)}, base_version=base)   # staleness 0, 1, 2, 3
        with pytest.raises(UnknownTensor):
            c.push({"nope": np.ones(3)})
        rows = wait_converged(c, 3)
        deadline = time.monotonic() + 15      # a loaded machine may still be reconnecting two followers
        while time.monotonic() < deadline and any(
                sum(v for (name, _), v in scrape(r["metrics"]).items() if name == "raftps_peer_connected") != 2
                for r in rows):
            time.sleep(0.2)
        status = {r["node"]: r for r in rows}
        scraped = {}
        for node, row in status.items():
            assert row["metrics"] == f"127.0.0.1:{BASE + 300 + node}"
            scraped[node] = scrape(row["metrics"])
        again = {r["node"]: r for r in c.status()}
    assert all(again[i]["version"] == status[i]["version"] for i in status), "the store moved while we scraped"
    leader = next(i for i, r in status.items() if r["role"] == "leader")
    for node, s in scraped.items():
        row = status[node]
        for role in ("leader", "follower", "candidate"):
            assert value(s, "raftps_role", role=role) == (1.0 if row["role"] == role else 0.0)
        assert value(s, "raftps_term") == row["term"]
        assert value(s, "raftps_applied_index") == row["applied"]
        assert value(s, "raftps_commit_index") == row["commit"]
        assert value(s, "raftps_store_version") == row["version"]
        assert value(s, "raftps_log_entries") == row["log_len"]
        assert value(s, "raftps_snapshot_index") == row["snapshot_index"]
        assert value(s, "raftps_model_bytes") == row["model_bytes"]
        assert value(s, "raftps_payload_bytes") == row["payload_disk_bytes"]
        assert value(s, "raftps_fetched_payloads_total") == row["fetched_payloads"]
        assert value(s, "raftps_tensors") == 1 and value(s, "raftps_has_quorum") == 1
        assert value(s, "raftps_leader_changes_total") >= 1
        assert value(s, "raftps_apply_seconds_count") >= 6            # create + 5 pushes + rejected push
        # the store's exact staleness counts, as a Prometheus histogram
        hist = {int(k): v for k, v in row["staleness"].items()}
        assert hist == {0: 1, 1: 1, 2: 1, 3: 1}
        assert value(s, "raftps_push_staleness_count") == 4 and value(s, "raftps_push_staleness_sum") == 6
        assert value(s, "raftps_push_staleness_bucket", le="0.0") == 1
        assert value(s, "raftps_push_staleness_bucket", le="2.0") == 3
        assert value(s, "raftps_push_staleness_bucket", le="+Inf") == 4
        assert value(s, "raftps_store_pushes_total") == 5 and value(s, "raftps_store_rejected_total") == 1
        assert sum(v for (name, labels), v in s.items() if name == "raftps_peer_connected") == 2
    s = scraped[leader]
    assert value(s, "raftps_requests_total", op="push", outcome="ok") == 5
    assert value(s, "raftps_requests_total", op="push", outcome="UnknownTensor") == 1
    assert value(s, "raftps_errors_total", **{"class": "UnknownTensor"}) == 1
    assert value(s, "raftps_write_seconds_count") == 7                 # create, 5 pushes, the refused push
    assert value(s, "raftps_commit_seconds_count") >= 7
    assert value(s, "raftps_client_bytes_total", direction="in") > 5 * n * 4
    assert value(s, "raftps_client_bytes_total", direction="out") > 0
    assert value(s, "raftps_payload_files") >= 1
    assert value(s, "raftps_client_connections") >= 1
    matches = {dict(labels)["peer"]: v for (name, labels), v in s.items() if name == "raftps_peer_match_index"}
    assert len(matches) == 2 and all(v >= status[leader]["commit"] for v in matches.values())

    # linearizable reads are counted by how the leader proved them (the default mode: its lease)
    with cl.client([status[leader]["address"]], timeout=30) as c:
        for _ in range(5):
            c.pull(["m.w"])
    after = scrape(status[leader]["metrics"])
    proved = lambda sc: value(sc, "raftps_lease_reads_total") + value(sc, "raftps_read_rounds_total")
    assert proved(after) - proved(s) >= 5 and value(after, "raftps_lease_reads_total") > value(s, "raftps_lease_reads_total")

    # the Grafana dashboard asks only for metrics the nodes serve
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "cluster", "grafana-raftps.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    wanted = {name for e in exprs for name in re.findall(r"raftps_[a-z_]+", e)}
    assert len(wanted) > 15 and wanted <= {name for name, _ in s}, wanted - {name for name, _ in s}

    # a new leader is counted by every survivor
    cl.kill(leader)
    with cl.client(timeout=30) as c:
        c.push({"m.w": np.ones(n, np.float32)})
        rows = wait_converged(c, 2)
    for row in rows:
        s = scrape(row["metrics"])
        assert value(s, "raftps_leader_changes_total") >= 2
        assert value(s, "raftps_store_version") == row["version"]


def test_metrics_port_off_and_explicit(make_cluster):
    cl = make_cluster(BASE + 10, nodes=1, extra_args=["--metrics-port", "0"])
    with cl.client(timeout=30) as c:
        assert c.status()[0]["metrics"] is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", BASE + 10 + 300 + 1), timeout=2).close()
    port = BASE + 10 + 380
    cl2 = make_cluster(BASE + 20, nodes=1, extra_args=["--metrics-port", str(port)])
    with cl2.client(timeout=30) as c:
        row = c.status()[0]
    assert row["metrics"] == f"127.0.0.1:{port}"
    assert value(scrape(row["metrics"]), "raftps_role", role="leader") == 1
