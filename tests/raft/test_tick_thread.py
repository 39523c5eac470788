"""A replica's Raft log made in a thread that then ends keeps ticking: the node starts the
replicas the hosts record gives it from whatever thread read the record (a request's among
them), and pysyncobj's tick thread used to end with the thread that made it; the node then
exited ("the raft tick thread died")."""
from __future__ import annotations

import threading

from raftps.raft import RaftSettings
from raftps.raft.pysyncobj_log import SyncObjLog

from test_memory_log import Recorder, propose
from test_snapshot_saved import wait_until

PORT = 28430


def test_a_log_made_in_a_thread_that_ends_keeps_ticking(tmp_path) -> None:
    rec = Recorder()
    made: list[SyncObjLog] = []
    maker = threading.Thread(target=lambda: made.append(SyncObjLog(RaftSettings(f"127.0.0.1:{PORT}", [], str(tmp_path),
                                                                               b""), rec)))
    maker.start()
    maker.join(30)
    assert not maker.is_alive() and made
    log = made[0]
    try:
        ticks = rec.ticks
        wait_until(lambda: rec.ticks > ticks + 20)     # ticks well after its maker ended
        assert log.alive()
        wait_until(log.is_leader)
        done, box = propose(log, b"after")
        assert done.wait(10) and box[0][1] is None, box
    finally:
        log.stop()
