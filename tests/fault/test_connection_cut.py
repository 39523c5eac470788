"""Cut the Raft connections (``ss -K``) while a follower receives a snapshot: it must converge.

pysyncobj streams a snapshot in chunks with per-peer progress on the leader and one open file on
the follower; a chunk lost with a dead connection would leave the file short. The leader cancels
the transfer when it sees the peer disconnected and starts again from the first chunk (the
follower reopens its file). This test checks that it converges after two cuts mid-transfer and that
the transfer did restart (the partial file shrank).
"""
from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest

from tests.conftest import wait_converged

BASE = 7770
N = 8 << 20                      # float32: a 32 MiB model, 32 snapshot chunks of 1 MiB


def cut_raft_connections() -> subprocess.CompletedProcess:
    ports = f"( sport >= :{BASE + 1} and sport <= :{BASE + 3} ) or ( dport >= :{BASE + 1} and dport <= :{BASE + 3} )"
    return subprocess.run(["ss", "-K", ports], capture_output=True, text=True, timeout=10)


def ss_kill_works() -> bool:
    import socket
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as c:
            server.accept()[0].close()
            subprocess.run(["ss", "-K", "dport", "=", f":{port}"], capture_output=True, timeout=10)
            try:
                c.send(b"x")
                c.recv(1)
            except OSError:
                return True
    return False


@pytest.mark.skipif(not ss_kill_works(), reason="ss -K cannot destroy sockets here (needs CAP_NET_ADMIN)")
def test_snapshot_transfer_restarts_after_connection_cuts(make_cluster) -> None:
    cl = make_cluster(BASE, extra_args=["--compaction-entries", "20"])
    with cl.client(timeout=60) as c:
        c.create("big", np.zeros(N, np.float32), optimizer={"name": "sgd", "lr": 0.01})
        c.create("tick", np.zeros(256, np.float32), optimizer={"name": "sgd", "lr": 0.01})
        follower = next(r["node"] for r in c.status() if r["role"] == "follower")
        cl.kill(follower)
        rng = np.random.default_rng(3)                   # incompressible, as real gradients are
        c.push({"big": rng.standard_normal(N, dtype=np.float32)})
        for _ in range(30):                               # compact the log past the follower
            c.push({"tick": np.ones(256, np.float32)})
        cl.start_node(follower)
        partial = os.path.join(cl.data_dir(follower), "raft.snapshot.1.tmp")
        cuts, shrank, peak = 0, False, 0
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and (cuts < 2 or not shrank):
            try:
                size = os.path.getsize(partial)
            except OSError:
                size = -1
            if cuts and 0 <= size < peak:
                shrank = True
            peak = max(peak, size)
            if cuts < 2 and size > N // 2 * (cuts + 1):       # at 1/8 and 1/4 of the model's bytes
                assert cut_raft_connections().returncode == 0
                cuts += 1
            time.sleep(0.002)
        assert cuts == 2, f"the transfer ended before two cuts (peak partial file {peak} bytes)"
        assert shrank, "after a cut the follower kept appending to its partial snapshot"
        wait_converged(c, 3, timeout=60)                  # same applied index and digest everywhere
