"""The documented path of `python -m raftps.launch`; it lives in raftps.tools.launch."""
import sys

from raftps.tools.launch import PerRankJob, main

__all__ = ["PerRankJob", "main"]

if __name__ == "__main__":
    sys.exit(main())
