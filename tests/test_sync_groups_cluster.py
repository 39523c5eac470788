"""Sync steps per group (job) and per rank on a real 3-node cluster."""
import threading

import numpy as np
import pytest

import raftps
from tests.conftest import wait_converged

BASE = 21000


def test_two_jobs_step_independently_and_a_restarted_rank_counts_once(make_cluster):
    cl = make_cluster(BASE)
    with cl.client(timeout=20) as c:
        c.create("w", np.zeros(8, np.float32), {"name": "sgd", "lr": 1.0})
        assert c.sync_applied("jobA") == -1 and c.sync_applied() == -1
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(c2.wait_step(0, 20.0, job="jobA")))
        with cl.client(timeout=20) as c2:
            waiter.start()
            c.push_sync({"w": np.ones(8, np.float32)}, 0, 2, job="jobA", rank=0)
            # rank 0 restarted: a new client (session) pushes the same step; it is ignored
            with cl.client(timeout=20) as restarted:
                r = restarted.push_sync_result({"w": np.full(8, 5.0, np.float32)}, 0, 2, job="jobA", rank=0)
            assert r["duplicate_rank"] and r["count"] == 1 and not r["applied"]
            # job B's step 0 does not apply job A's, and vice versa
            c.push_sync({"w": np.full(8, 10.0, np.float32)}, 0, 1, job="jobB", rank=0)
            assert c.sync_applied("jobB") == 0 and c.sync_applied("jobA") == -1
            with pytest.raises(raftps.StepTimeout, match="sync step 0 of job 'jobA'"):
                c.wait_step(0, 0.5, job="jobA")
            version = c.push_sync({"w": np.full(8, 3.0, np.float32)}, 0, 2, job="jobA", rank=1)
            waiter.join(30)
        assert got and got[0] >= version
        assert c.sync_applied("jobA") == 0 and c.sync_applied() == -1
        tensors, _ = c.pull(["w"])
        assert np.array_equal(tensors["w"], np.full(8, -(10.0 + 2.0), np.float32))   # B's 10, A's mean of 1 and 3
        with pytest.raises(raftps.InvalidRequest, match="job: expected a job name"):
            c.push_sync({"w": np.ones(8, np.float32)}, 1, 2, job="no spaces", rank=0)
        with pytest.raises(raftps.InvalidRequest,
                           match=r"push_sync: rank: expected an int in \[0, workers=2\), got an int 2"):
            c.push_sync({"w": np.ones(8, np.float32)}, 1, 2, job="jobA", rank=2)
        with pytest.raises(raftps.InvalidRequest, match="job: expected a job name"):
            c.sync_applied("no spaces")
        assert c.close_step(1, job="jobA") > 0 and c.sync_applied("jobA") == 1
        wait_converged(c, 3)
