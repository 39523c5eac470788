"""raftps snapshot save / restore: a cluster lost entirely comes back from a backup file, at the
backup's version and digest, and goes on taking pushes exactly as the original would have."""
import os
import subprocess
import sys

import numpy as np

from raftps import codec
from raftps.tools.localcluster import LocalCluster
from tests.conftest import start_cluster, wait_converged

BASE = 24030
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raftps(env, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "raftps", *args], env={**os.environ, **env, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=timeout)


def test_save_wipe_restore_and_go_on(tmp_path):
    run_dir, backup = tmp_path / "run", tmp_path / "store.backup"
    big = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)     # 4 MiB: data plane
    grad = {"w": np.full(1 << 20, 0.25, np.float32), "b": np.ones(10)}
    cl = start_cluster(run_dir, BASE)
    try:
        with cl.client(timeout=30) as c:
            c.create_many({"w": big, "b": np.zeros(10)}, {"w": {"name": "adam", "lr": 0.01},
                                                          "b": {"name": "momentum", "lr": 0.1}})
            # 1,400 Adam tensors: 4,200 arrays, more than the 4,096 a network frame may hold
            for start in range(0, 1400, 700):
                names = [f"many/t{i}" for i in range(start, start + 700)]
                c.create_many({n: np.zeros(2, np.float32) for n in names}, {n: {"name": "adam", "lr": 0.1} for n in names})
            for _ in range(3):
                c.push(grad)
            c.push_sync({"b": np.ones(10)}, step=0, workers=2, job="job", rank=0)   # a half-full sync step
            c.ssp_join("g", "w0", 2)
            done = raftps(cl.client_env, "snapshot", "save", str(backup))
            assert done.returncode == 0, done.stderr
            saved = codec.read_frame_file(str(backup))
            version, digest = saved["version"], saved["digest"]
            assert f"at version {version} (digest {digest[:16]}" in done.stdout
            rows = wait_converged(c, 3)
            assert {(r["version"], r["digest"]) for r in rows} == {(version, digest)}
            # What the original does next, to compare with the restored cluster.
            c.push(grad)
            expected, _ = c.pull(["w", "b"])
    finally:
        cl.wipe()                                     # the whole cluster is gone: data, payloads, secret
    assert not run_dir.exists()

    done = raftps({}, "snapshot", "restore", str(backup), "--run-dir", str(run_dir))
    assert done.returncode == 0 and f"seeded 3 data dir(s) with the store at version {version}" in done.stdout, done.stderr
    cl = start_cluster(run_dir, BASE)
    try:
        with cl.client(timeout=30) as c:
            rows = wait_converged(c, 3)
            assert {(r["version"], r["digest"]) for r in rows} == {(version, digest)}
            assert c.push(grad) > version                # versions go on from the backup's
            got, _ = c.pull(["w", "b"])
            assert np.array_equal(got["w"], expected["w"]) and np.array_equal(got["b"], expected["b"])
            assert c.push_sync({"b": np.ones(10)}, step=0, workers=2, job="job", rank=1) > version
            assert c.sync_applied("job") == 0          # the half-full step was in the backup
            # The restored nodes persist as usual: a SIGKILLed follower comes back and catches up.
            follower = next(r["node"] for r in c.status() if r["role"] == "follower")
            cl.kill(follower)
            c.push(grad)
            cl.start()
            wait_converged(c, 3)
        # and a restart of the whole restored cluster keeps it all
        cl.stop()
        cl.start()
        with cl.client(timeout=30) as c:
            after = wait_converged(c, 3)[0]
            assert c.pull(["many/t1399"])[0]["many/t1399"].tolist() == [0.0, 0.0]
            assert after["version"] > version
    finally:
        cl.wipe()


def test_bad_backups_and_occupied_dirs_are_refused(tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x00" * 100)
    other = tmp_path / "frame"
    with open(other, "wb") as f:
        codec.write_frame(f, {"hello": "world"})
    # a real backup from a one-node cluster, then damaged copies of it
    cl = start_cluster(tmp_path / "one", BASE + 10, nodes=1)
    try:
        with cl.client(timeout=30) as c:
            c.create("x", np.arange(4.0), {"name": "sgd", "lr": 1.0})
        good = tmp_path / "good"
        done = raftps(cl.client_env, "snapshot", "save", str(good))
        assert done.returncode == 0, done.stderr
        occupied = cl.data_dir(1)
    finally:
        cl.stop()
    data = good.read_bytes()
    truncated = tmp_path / "truncated"
    truncated.write_bytes(data[:-5])
    tampered = tmp_path / "tampered"
    tampered.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))        # one bit of x's bytes
    empty_dir = tmp_path / "new"
    cases = [
        ([str(tmp_path / "missing"), "--data-dir", str(empty_dir)], "cannot read"),
        ([str(junk), "--data-dir", str(empty_dir)], "is not a raftps backup"),
        ([str(other), "--data-dir", str(empty_dir)], "is not a raftps backup of format 1"),
        ([str(truncated), "--data-dir", str(empty_dir)], "is not a raftps backup"),
        ([str(tampered), "--data-dir", str(empty_dir)], "is damaged"),
        ([str(good), "--data-dir", str(empty_dir), "--data-dir", occupied], "already holds a node's data"),
        ([str(good)], "give the data dir of every node"),
    ]
    for argv, message in cases:
        done = raftps({}, "snapshot", "restore", *argv)
        assert done.returncode == 2 and message in done.stderr, (argv, done.returncode, done.stderr)
        assert "Traceback" not in done.stderr
        assert not (empty_dir / "raft.snapshot").exists()
    LocalCluster(str(tmp_path / "one"), nodes=1, base_port=BASE + 10).wipe()
