"""The tools room: the operator's commands built on the client and the server.

cli.py (the `raftps` command), localcluster.py and localcluster_cli.py (a cluster on one host),
elastic_cli.py, top.py (live view), backup.py and model_files.py (export/import), launch.py
(per-rank training launcher).
"""
