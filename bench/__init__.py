"""raftps benchmarks: ``python -m bench [--quick|--full] [--out DIR]``.

Every speed figure is reported next to a baseline measured in the same run (the naive pysyncobj
store, a 1-node raftps, the raw loopback socket), because absolute numbers on a shared 2-core
machine drift from run to run while ratios measured together hold.
"""
