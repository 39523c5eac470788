"""The store room: the pure, deterministic state machine (no sockets, no clocks, no threads).

machine.py (TensorStore: apply one op to the state), moves.py, assign_state.py, sync_jobs.py,
ssp_clocks.py, write_sessions.py, hosts.py and store_snapshot.py (the state's snapshot layout).
Imports only the shared vocabulary; nothing from raftps.server or raftps.client.
"""
