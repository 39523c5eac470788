"""Catch-up: how long a restarted follower takes to hold the leader's state, log compacted.

For each model size (one float32 tensor, SGD) a fresh 3-node cluster with ``--compaction-entries
20`` (as tests/test_recovery.py does), so the entries a stopped follower missed are gone from the
leader's log and it must receive a snapshot of the whole model. Two cases per size:

- ``behind``: SIGKILL a follower, push 2 full-size gradients and 30 small pushes (the log is
  compacted past the follower's last entry), restart it with its data dir;
- ``wiped``: the same with the follower's data dir and payload dir deleted before the restart
  (a replaced machine).

Time from starting the process to the follower reporting the leader's version and digest
(``status`` polled every 50 ms), and, within it, the time until the new process first answers
(Python start-up and journal replay).
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any

import numpy as np

from .common import KiB, log, size_label

COMPACTION = ["--compaction-entries", "20"]
SMALL_PUSHES = 30
TIMEOUT = 120.0


def _row(client: Any, node: int) -> dict[str, Any]:
    return next(r for r in client.status(timeout=1.0) if r["node"] == node)


def _last_error(log_file: str) -> str | None:
    """The last exception line of a node's log (why a catch-up failed), if any."""
    try:
        with open(log_file, errors="replace") as f:
            lines = [ln.strip() for ln in f if "Error" in ln or "Exception" in ln]
    except OSError:
        return None
    return lines[-1][:300] if lines else None


def _one(cl: Any, client: Any, size: int, case: str, timeout: float) -> dict[str, Any]:
    from raftps.server.node import default_payload_dir
    name = f"m{size}"
    follower = next(r["node"] for r in client.status() if r["role"] == "follower")
    applied_before = _row(client, follower)["applied"]
    cl.kill(follower)
    if case == "wiped":
        shutil.rmtree(default_payload_dir(cl.data_dir(follower)), ignore_errors=True)
        shutil.rmtree(cl.data_dir(follower), ignore_errors=True)
    rng = np.random.default_rng(size)
    for _ in range(2):
        client.push({name: rng.standard_normal(size // 4, dtype=np.float32)})
    tick = np.full(KiB // 4, 1e-3, np.float32)
    for _ in range(SMALL_PUSHES):
        client.push({"tick": tick})
    leader = next(r for r in client.status() if r["role"] == "leader")
    compacted = leader["snapshot_index"] > applied_before
    t0 = time.monotonic()
    cl.start_node(follower)
    answered = matched = None
    with cl.client([cl.client_address(follower)], timeout=2.0) as probe:
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            try:
                row = probe.status(timeout=1.0)[0]
            except Exception:
                row = {"role": "down"}
            if row.get("role") != "down":
                answered = answered or time.monotonic() - t0
                if row.get("version") == leader["version"] and row.get("digest") == leader["digest"]:
                    matched = time.monotonic() - t0
                    break
            time.sleep(0.05)
    rec = {"system": "raftps-3", "op": "catchup", "case": case, "size": size, "model_mb": size / 2**20,
           "compacted": compacted, "leader_snapshot_index": leader["snapshot_index"],
           "follower_applied_before": applied_before, "catchup_s": matched, "first_answer_s": answered,
           "ok": matched is not None, "timeout_s": timeout,
           "follower_error": None if matched is not None else _last_error(cl.log_file(follower))}
    log(f"catch-up {size_label(size)} {case}: digest matched after "
        f"{'-' if matched is None else f'{matched:.2f} s'} (process answered after "
        f"{'-' if answered is None else f'{answered:.2f} s'}), log compacted past it: {compacted}"
        + ("" if matched is not None else f"; follower's last error: {rec['follower_error']}"))
    return rec


def measure(run_dir: str, sizes: list[int], base_port: int, cases: tuple[str, ...] = ("behind", "wiped"),
            timeout: float = TIMEOUT) -> list[dict[str, Any]]:
    """One fresh cluster per model size; one record per (size, case)."""
    from raftps.tools.localcluster import LocalCluster
    out: list[dict[str, Any]] = []
    for i, size in enumerate(sizes):
        cl = LocalCluster(os.path.join(run_dir, f"catchup{i}"), nodes=3, base_port=base_port, extra_args=COMPACTION)
        try:
            cl.start()
            with cl.client(timeout=60.0) as client:
                client.create(f"m{size}", np.zeros(size // 4, np.float32), optimizer={"name": "sgd", "lr": 0.01})
                client.create("tick", np.zeros(KiB // 4, np.float32), optimizer={"name": "sgd", "lr": 0.01})
                for case in cases:
                    out.append(_one(cl, client, size, case, timeout))
        finally:
            cl.wipe()
    return out
