"""Run a raftps node with fault-test settings: ``LocalCluster(command_prefix=...)`` puts this in
front of the node's argv, so the node process is still ``python ... raftps serve ...``.

    python -m raftps.chaos.launch [--backoff-fix] -- PYTHON -m raftps serve --id I ...

--backoff-fix    install raftps.chaos.backoff_fix on the node (until the node does it itself)
Node settings (compaction, election timeout, leader fallback) are ``raftps serve`` flags.
"""
from __future__ import annotations

import argparse
import sys


def prefix(*options: str, python: str = sys.executable) -> list[str]:
    """argv to prepend to a node command, e.g. prefix('--backoff-fix')."""
    return [python, "-m", "raftps.chaos.launch", *options, "--"]


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: python -m raftps.chaos.launch [options] -- PYTHON -m raftps serve ...")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="raftps.chaos.launch")
    p.add_argument("--backoff-fix", action="store_true")
    args = p.parse_args(argv[:cut])
    node_argv = argv[cut + 1:]
    if node_argv[1:3] != ["-m", "raftps"]:
        raise SystemExit(f"expected 'PYTHON -m raftps ...' after --, got {node_argv[:3]}")

    from raftps import cli, node
    if args.backoff_fix:
        from . import backoff_fix

        class FixedNode(node.RaftNode):
            def __init__(self, *a, **kw) -> None:
                super().__init__(*a, **kw)
                backoff_fix.install(self)
        node.RaftNode = FixedNode
    return cli.main(node_argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
