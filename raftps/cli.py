"""The documented path of the `raftps` command; it lives in raftps.tools.cli."""
import sys

from raftps.tools.cli import OneLineParser, main

__all__ = ["OneLineParser", "main"]

if __name__ == "__main__":
    sys.exit(main())
