"""The documented path of LocalCluster; it lives in raftps.tools.localcluster."""
from raftps.tools.localcluster import LocalCluster

__all__ = ["LocalCluster"]
