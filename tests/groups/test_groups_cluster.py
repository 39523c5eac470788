"""Several Raft groups on real node processes: a push spanning groups, per-group versions and
replicas, a SIGKILL of a node that leads groups while pushes go on, and a node outside group 0."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from raftps.client.client import Client
from raftps.errors import RaftpsError
from raftps.groups import group_of
from raftps.tools.localcluster import LocalCluster

SGD = {"name": "sgd", "lr": 1.0}
NAMES = [f"t{i}" for i in range(12)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = LocalCluster(str(tmp_path_factory.mktemp("groups3")), nodes=3, base_port=29100, groups=3)
    cl.start(timeout=60.0)
    yield cl
    cl.stop()
    cl.drop_payloads()


def by_group(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in rows:
        out.setdefault(row["group"], []).append(row)
    return out


def wait_identical(cl: LocalCluster, timeout: float = 20.0) -> dict[int, list[dict]]:
    """Every group's three replicas up, at one version with one digest (or the last rows seen)."""
    deadline = time.monotonic() + timeout
    while True:
        groups = by_group([r for r in cl.status() if r["role"] != "down"])
        same = all(len(rows) == 3 and len({(r["version"], r["digest"]) for r in rows}) == 1
                   for rows in groups.values())
        if same or time.monotonic() > deadline:
            return groups
        time.sleep(0.2)


def test_status_has_a_row_per_group_and_every_group_a_leader(cluster) -> None:
    rows = cluster.status()
    groups = by_group(rows)
    assert sorted(groups) == [0, 1, 2]
    for g, members in groups.items():
        assert sorted(r["node"] for r in members) == [1, 2, 3]
        assert sum(r["role"] == "leader" for r in members) == 1, members
    with cluster.client() as c:
        assert c.groups() == 3


def test_push_across_groups_applies_each_part_once(cluster) -> None:
    with cluster.client(timeout=30.0) as c:
        c.create_many({n: np.zeros(4, np.float32) for n in NAMES}, {n: SGD for n in NAMES})
        touched = {group_of(n, 3) for n in NAMES}
        assert touched == {0, 1, 2}
        version = c.push({n: np.full(4, -1.0, np.float32) for n in NAMES})
        assert isinstance(version, dict) and sorted(version) == [0, 1, 2]
        tensors, seen = c.pull(NAMES)
        assert all(seen[g] >= version[g] for g in version)
        for n in NAMES:
            np.testing.assert_array_equal(tensors[n], np.ones(4, np.float32))
        rows = c.tensors()
        assert [r["name"] for r in rows] == sorted(NAMES)
        assert all(r["group"] == group_of(r["name"], 3) for r in rows)
        # a follower read with the push's versions sees it (min_version per group)
        tensors, _ = c.pull(NAMES, min_version=version, linearizable=False)
        assert all(float(tensors[n][0]) == 1.0 for n in NAMES)
        with pytest.raises(ValueError, match="min_version is a {group: version} map"):
            c.pull(NAMES, min_version=3, linearizable=False)
    groups = wait_identical(cluster)
    for g, rows in groups.items():
        assert len({r["digest"] for r in rows}) == 1, f"group {g}'s replicas differ: {rows}"


def test_sync_step_over_groups_applies_the_mean_once(cluster) -> None:
    names = [f"s{i}" for i in range(6)]
    with cluster.client(timeout=30.0) as a, cluster.client(timeout=30.0) as b:
        a.create_many({n: np.zeros(2, np.float32) for n in names}, {n: SGD for n in names})
        a.push_sync({n: np.full(2, 2.0, np.float32) for n in names}, step=0, workers=2, job="job", rank=0)
        b.push_sync({n: np.full(2, 4.0, np.float32) for n in names}, step=0, workers=2, job="job", rank=1)
        b.push_sync({n: np.full(2, 4.0, np.float32) for n in names}, step=0, workers=2, job="job", rank=1)
        a.wait_step(0, timeout=10.0, job="job")
        assert a.sync_applied("job") == 0
        tensors, _ = a.pull(names)
        for n in names:
            np.testing.assert_array_equal(tensors[n], np.full(2, -3.0, np.float32))


def test_kill_a_node_that_leads_groups_while_pushing(cluster) -> None:
    """Two clients push one-hot increments over counters in every group; the node leading group
    0 is SIGKILLed mid-way. Every acknowledged push is applied exactly once in every group."""
    counters = [f"c{i}" for i in range(6)]
    with cluster.client(timeout=30.0) as c:
        c.create_many({n: np.zeros(8, np.float64) for n in counters}, {n: SGD for n in counters})
    acked = [0, 0]
    errors: list[str] = []
    stop = threading.Event()

    def pusher(k: int) -> None:
        with cluster.client(timeout=30.0) as c:
            grad = np.zeros(8, np.float64)
            grad[k] = -1.0
            for _ in range(400):                 # bounded in count and by the stop event
                if stop.is_set():
                    return
                try:
                    c.push({n: grad for n in counters})
                except RaftpsError as exc:
                    errors.append(repr(exc))
                    return
                acked[k] += 1

    threads = [threading.Thread(target=pusher, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    victim = cluster.leader(0)
    led = [g for g in range(3) if cluster.leader(g) == victim]
    cluster.kill(victim)
    time.sleep(3.0)
    cluster.start_node(victim)
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(60.0)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert led and min(acked) > 0
    with cluster.client(timeout=30.0) as c:
        tensors, _ = c.pull(counters)
    for n in counters:
        assert tensors[n][0] == acked[0] and tensors[n][1] == acked[1], (n, tensors[n][:2], acked)
    groups = wait_identical(cluster, timeout=30.0)
    for g, rows in groups.items():
        assert len(rows) == 3 and len({r["digest"] for r in rows}) == 1, f"group {g}: {rows}"


def test_a_node_outside_group_0_serves_its_groups(tmp_path) -> None:
    """Four nodes, four groups: node 4 hosts groups 1-3 and no replica of group 0."""
    cl = LocalCluster(str(tmp_path), nodes=4, base_port=29150, groups=4)
    try:
        cl.start(timeout=60.0)
        rows = cl.status()
        assert sorted(r["group"] for r in rows if r["node"] == 4) == [1, 2, 3]
        names = [f"w{i}" for i in range(16)]
        with Client(cl.client_address(4), timeout=30.0, token=cl.token) as c:   # told of node 4 only
            c.create_many({n: np.arange(3, dtype=np.float32) for n in names}, {n: SGD for n in names})
            c.push({n: np.ones(3, np.float32) for n in names})
            tensors, version = c.pull(names)
        assert sorted(version) == [0, 1, 2, 3]
        for n in names:
            np.testing.assert_array_equal(tensors[n], np.arange(3, dtype=np.float32) - 1)
    finally:
        cl.stop()
        cl.drop_payloads()


def test_leaders_spread_one_group_per_node(cluster) -> None:
    """Whoever won the elections (and after the kill above), each group's leadership moves to its
    preferred member: group g to node g+1, so each of the three nodes leads one group."""
    deadline = time.monotonic() + 40.0
    leaders: list = []
    while time.monotonic() < deadline:
        leaders = [cluster.leader(g) for g in range(3)]
        if leaders == [1, 2, 3]:
            break
        time.sleep(0.5)
    assert leaders == [1, 2, 3]


def test_export_and_import_across_groups(cluster, tmp_path) -> None:
    from raftps.tools.model_files import export_model, import_model
    names = [f"m/layer{i}" for i in range(8)]
    with cluster.client(timeout=30.0) as c:
        c.create_many({n: np.full(3, float(i), np.float32) for i, n in enumerate(names)}, {n: SGD for n in names})
        path = str(tmp_path / "m.safetensors")
        summary = export_model(c, "m", "safetensors", path)
        assert summary["tensors"] == 8 and isinstance(summary["version"], dict)
        result = import_model(c, path, "copy", {"name": "sgd", "lr": 0.5})
        assert result["created"] == 8
        tensors, _ = c.pull([f"copy/layer{i}" for i in range(8)])
    for i in range(8):
        np.testing.assert_array_equal(tensors[f"copy/layer{i}"], np.full(3, float(i), np.float32))


def test_metrics_have_a_sample_per_group(cluster) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    row = next(r for r in cluster.status() if r["node"] == 1 and r.get("metrics"))
    text = urllib.request.urlopen(f"http://{row['metrics']}/metrics", timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    applied = {s.labels["group"]: s.value for s in families["raftps_applied_index"].samples}
    assert sorted(applied) == ["0", "1", "2"] and all(v > 0 for v in applied.values())
    roles = [s for s in families["raftps_role"].samples if s.value == 1.0]
    assert sorted(s.labels["group"] for s in roles) == ["0", "1", "2"]


def test_metrics_export_every_groups_write_commit_and_apply_histograms(cluster) -> None:
    """Each node's /metrics has the instruments of every Raft group it hosts, labelled by group:
    a group's leader timed its writes and commits, every replica its applies."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    names = [f"metrics/{i}" for i in range(12)]
    with cluster.client(timeout=30.0) as c:
        c.create_many({n: np.zeros(4, np.float32) for n in names}, {n: SGD for n in names})
        assert {group_of(n, 3) for n in names} == {0, 1, 2}
        for _ in range(3):
            c.push({n: np.ones(4, np.float32) for n in names})
    rows = wait_identical(cluster)
    leaders = {g: next(r["node"] for r in members if r["role"] == "leader") for g, members in rows.items()}
    metrics_at = {r["node"]: r["metrics"] for r in cluster.status() if r.get("metrics")}
    assert sorted(metrics_at) == [1, 2, 3]
    for node, address in metrics_at.items():
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
        samples = {(s.name, frozenset(s.labels.items())): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        for g in ("0", "1", "2"):
            count = lambda name: samples.get((name, frozenset({"group": g}.items())), 0.0)
            assert count("raftps_apply_seconds_count") >= 4, (node, g)      # create + 3 pushes
            assert count("raftps_leader_changes_total") >= 1, (node, g)
            assert (("raftps_snapshots_total", frozenset({"group": g, "kind": "write"}.items())) in samples)
            if leaders[int(g)] == node:
                assert count("raftps_write_seconds_count") >= 4, (node, g)
                assert count("raftps_commit_seconds_count") >= 4, (node, g)
            buckets = [v for (name, labels), v in samples.items()
                       if name == "raftps_apply_seconds_bucket" and ("group", g) in labels]
            assert len(buckets) > 1 and max(buckets) == count("raftps_apply_seconds_count")
        # no group's histogram goes out without its label; the server's counters carry none
        assert not [k for k in samples if k[0].startswith(("raftps_write_seconds", "raftps_commit_seconds",
                                                            "raftps_apply_seconds")) and "group" not in dict(k[1])]
        requests = [dict(labels) for name, labels in samples if name == "raftps_requests_total"]
        assert requests and all("group" not in labels for labels in requests)


def test_backup_of_three_groups_restores_every_group(cluster, tmp_path) -> None:
    """raftps snapshot save of a 3-group cluster (each group at a version of its own), restore
    into a new cluster's empty data dirs, and every group comes up with the same digest."""
    from raftps.tools import backup
    with cluster.client(timeout=30.0) as c:
        c.create_many({f"b{i}": np.full(5, float(i)) for i in range(9)}, {f"b{i}": SGD for i in range(9)})
        saved = backup.save(c, str(tmp_path / "store.backup"))
    assert sorted(saved["version"]) == [0, 1, 2]
    fresh = LocalCluster(str(tmp_path / "new"), nodes=3, base_port=30250, groups=3)
    out = backup.restore(str(tmp_path / "store.backup"), [fresh.data_dir(n) for n in (1, 2, 3)], fresh.peers)
    assert out["groups"] == 3 and out["digest"] == saved["digest"]
    try:
        fresh.start(timeout=60.0)
        digests = {r["group"]: r["digest"] for r in fresh.status() if r["role"] != "down"}
        assert digests == saved["digest"]
        with fresh.client(timeout=30.0) as c:
            tensors, _ = c.pull([f"b{i}" for i in range(9)])
            c.push({"b4": np.ones(5)})                      # and training goes on
        assert all(float(tensors[f"b{i}"][0]) == i for i in range(9))
    finally:
        fresh.stop()
        fresh.drop_payloads()
