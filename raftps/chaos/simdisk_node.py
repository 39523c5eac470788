"""A raftps node whose files go through the simulated disk of ``$RAFTPS_SIMDISK``, for power cuts.

    RAFTPS_SIMDISK=<state dir> python -m raftps.chaos.simdisk_node serve --durability fsync ...

takes the same arguments as ``python -m raftps``: it hands the disk to the product's one hook
(``raftps.raft.storage.use_storage``) and runs the command line, so the product itself never
imports the simulator. ``Harness(power_cuts=True)`` starts its nodes this way.
"""
import os
import sys

from raftps.tools.cli import main
from raftps.raft.storage import use_storage

from raftps.chaos.simdisk import SIMDISK_ENV, storage_from_env

if __name__ == "__main__":
    if not os.environ.get(SIMDISK_ENV):
        sys.exit(f"simdisk_node: set {SIMDISK_ENV} to the simulated disk's state dir")
    use_storage(storage_from_env())
    sys.exit(main())
