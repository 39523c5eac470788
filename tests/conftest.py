import threading
import time

import pytest

from raftps import Client
from raftps.tools.localcluster import LocalCluster


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


def push_concurrently(cluster: LocalCluster, grads: list[dict], pushes: int, seconds: float = 60.0) -> list[int]:
    """One client thread per gradient map in ``grads``, each pushing it up to ``pushes`` times
    within ``seconds``; returns how many each completed. Re-raises the first error a thread hit."""
    deadline = time.monotonic() + seconds
    done = [0] * len(grads)
    errors: list[BaseException] = []

    def pusher(i: int) -> None:
        try:
            with cluster.client() as c:
                while done[i] < pushes and time.monotonic() < deadline:
                    c.push(grads[i])
                    done[i] += 1
        except BaseException as exc:      # reported below; a thread must not hide it
            errors.append(exc)

    threads = [threading.Thread(target=pusher, args=(i,)) for i in range(len(grads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30.0)
    if errors:
        raise errors[0]
    return done


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
