"""raftps nodes with --durability fsync: the durable journal under a real cluster, payloads on
disk in the data dir, a kill of every node survived, and a data dir keeping its mode."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from raftps.tools.localcluster import LocalCluster, NodeExited

SGD = {"name": "sgd", "lr": 1.0}
BASE = 30600


def test_durable_cluster_survives_killing_every_node(tmp_path) -> None:
    cl = LocalCluster(str(tmp_path / "run"), nodes=3, base_port=BASE, durability="fsync")
    try:
        cl.start(timeout=60.0)
        with cl.client(timeout=30.0) as c:
            c.create("big", np.zeros(1 << 20, np.float32), optimizer=SGD)      # 4 MiB: payload path
            c.create("small", np.zeros(4, np.float64), optimizer=SGD)         # inline path
            for _ in range(5):
                c.push({"big": np.full(1 << 20, -1.0, np.float32), "small": np.full(4, -1.0)})
        for node in range(1, 4):
            data = cl.data_dir(node)
            assert os.path.isdir(os.path.join(data, "raft.journal.d")), "no durable journal"
            assert not os.path.exists(os.path.join(data, "raft.journal")), "pysyncobj's journal in durable mode"
            assert os.path.isdir(os.path.join(data, "payloads")), "payloads not in the data dir"
        for node in range(1, 4):
            cl.kill(node)
        cl.start(timeout=60.0)
        with cl.client(timeout=30.0) as c:
            tensors, _ = c.pull(["big", "small"])
        assert float(tensors["big"].min()) == float(tensors["big"].max()) == 5.0
        np.testing.assert_array_equal(tensors["small"], np.full(4, 5.0))
    finally:
        cl.stop()
        cl.drop_payloads()


def test_a_node_switched_to_durable_keeps_its_log_and_cannot_switch_back(tmp_path) -> None:
    run = str(tmp_path / "run")
    cl = LocalCluster(run, nodes=1, base_port=BASE + 20)
    try:
        cl.start(timeout=60.0)
        with cl.client(timeout=30.0) as c:
            c.create("w", np.zeros(3), optimizer=SGD)
            c.push({"w": np.ones(3)})
        cl.kill(1)                                            # no snapshot: the state is in the journal
        cl = LocalCluster(run, nodes=1, base_port=BASE + 20, durability="fsync")
        cl.start(timeout=60.0)
        with cl.client(timeout=30.0) as c:
            tensors, _ = c.pull(["w"])
        np.testing.assert_array_equal(tensors["w"], -np.ones(3))
        assert os.path.exists(os.path.join(cl.data_dir(1), "raft.journal.imported"))
        cl.kill(1)
        back = LocalCluster(run, nodes=1, base_port=BASE + 20)
        try:
            back.start(timeout=30.0)
            raise AssertionError("a durable data dir started without --durability fsync")
        except NodeExited:
            pass
        with open(back.log_file(1)) as f:
            assert "was run with --durability fsync" in f.read()
    finally:
        cl.stop()
        cl.drop_payloads()


def test_serve_refuses_an_unknown_durability() -> None:
    p = subprocess.run([sys.executable, "-m", "raftps", "serve", "--id", "1", "--peers", "127.0.0.1:1",
                        "--data-dir", "/nonexistent", "--insecure", "--durability", "sometimes"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "invalid choice: 'sometimes'" in p.stderr
