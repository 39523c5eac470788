"""One Raft group's replica on a node, split by job; ``raftps.server.node.RaftNode`` composes them.

- ``config``: NodeConfig, addresses, where payload files live.
- ``applier``: the Applier the log drives (state machine, apply lock, snapshots) and the doors
  other threads read it through.
- ``writes``: a write's payload to a majority, then its entry through group commit.
- ``reads``: linearizable reads (lease, ReadIndex, barrier entry).
- ``fetch``: payloads an entry waits for, fetched from peers; a peer's snapshot when none has one.
- ``upkeep``: payload collection, the payload budget's snapshots, leader balancing.
- ``membership``: the other members, the majority, membership changes.
- ``status``: one status record per replica (``stats``, status rows, metrics).
"""
