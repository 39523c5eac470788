"""A follower that missed compacted entries of a 64 MiB model catches up through the snapshot.

Found by bench/catchup.py: on 25f6771 the follower received the 64 MiB snapshot exactly 1 MiB short
and failed forever with ``ProtocolError: truncated frame`` (random gradients; 3 of 3 tries)."""
import numpy as np

from tests.conftest import wait_converged

N = 16 * 1024 * 1024          # float32: 64 MiB


def test_follower_behind_a_compacted_log_catches_up_on_a_64_mib_model(make_cluster):
    cl = make_cluster(12700, extra_args=["--compaction-entries", "20"])
    with cl.client(timeout=60) as c:
        c.create("big", np.zeros(N, np.float32), optimizer={"name": "sgd", "lr": 0.01})
        c.create("tick", np.zeros(256, np.float32), optimizer={"name": "sgd", "lr": 0.01})
        follower = next(r["node"] for r in c.status() if r["role"] == "follower")
        cl.kill(follower)
        rng = np.random.default_rng(1)          # incompressible, as real gradients are
        for _ in range(2):
            c.push({"big": rng.standard_normal(N, dtype=np.float32)})
        for _ in range(30):
            c.push({"tick": np.ones(256, np.float32)})
        leader = next(r for r in c.status() if r["role"] == "leader")
        assert leader["snapshot_index"] > 4, "the log should have been compacted past the follower"
        cl.start()
        rows = wait_converged(c, 3, timeout=60)
        assert rows[0]["version"] == leader["version"]
