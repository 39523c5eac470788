import time

import pytest

from raftps import Client
from raftps.localcluster import LocalCluster


def start_cluster(run_dir, base_port: int, nodes: int = 3, **kwargs) -> LocalCluster:
    cluster = LocalCluster(str(run_dir), nodes=nodes, base_port=base_port, **kwargs)
    try:
        cluster.start(timeout=60)
    except BaseException:
        cluster.wipe()
        raise
    return cluster


def wait_converged(client: Client, want_up: int, timeout: float = 30.0) -> list[dict]:
    """Every node up, at the same applied index, with the same digest (bounded wait)."""
    deadline = time.monotonic() + timeout
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = [r for r in client.status() if r["role"] != "down"]
        if len(rows) == want_up and len({(r["version"], r["digest"]) for r in rows}) == 1 \
                and any(r["role"] == "leader" for r in rows):
            return rows
        time.sleep(0.1)
    raise AssertionError(f"replicas did not converge within {timeout} s: "
                         f"{[(r['node'], r['role'], r.get('version'), (r.get('digest') or '')[:8]) for r in rows]}")


@pytest.fixture
def make_cluster(tmp_path):
    """Factory: make_cluster(base_port, nodes=3, extra_args=[...]); every cluster is stopped after the test."""
    made: list[LocalCluster] = []

    def make(base_port: int, nodes: int = 3, **kwargs) -> LocalCluster:
        cluster = start_cluster(tmp_path / f"run{base_port}", base_port, nodes, **kwargs)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.wipe()
