"""The server room: one node's processes, frames in, replicated writes, frames out.

server.py and handlers.py (dispatch by raftps.ops), node.py (one process hosting its replicas),
dataplane.py and payloads.py (tensor bytes beside the Raft log), aggregate.py, group_commit.py,
hosting.py, placement_loop.py and elastic.py (who serves what), snapshot_file.py, metrics.py.
Applies writes through the pure store (raftps.store) and the replica (raftps.replica).
"""
