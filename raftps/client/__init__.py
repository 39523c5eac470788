"""The client room: everything a training process runs to talk to a raftps cluster.

client.py (the public Client), transport.py (TCP and in-process), session.py (exactly-once
sequence numbers), router.py (layout, placement, leaders), job_steps.py, pipeline.py,
tensor_move.py, ssp.py and diloco.py (the SSP and DiLoCo helpers on top of Client).
Imports the shared vocabulary (raftps.ops, schema, codec, errors, ...), never the server or store.
"""
from raftps.client.client import Client

__all__ = ["Client"]
