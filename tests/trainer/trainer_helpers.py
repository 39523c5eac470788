"""Run ``python -m trainer train`` as a real process; the caller's test stops it, by PID."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_trainer(args: list[str], out: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``env``: added to the trainer's environment (a cluster's client_env: its token)."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(os.path.join(os.path.dirname(out), os.path.basename(out) + ".log"), "wb")
    return subprocess.Popen([sys.executable, "-m", "trainer", "train", *args, "--out", out],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, out: str, timeout: float) -> dict:
    """Wait (bounded) for the trainer; kill its process group if it overruns. Returns summary.json."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)      # the coordinator and its workers share its session
        proc.wait()
    with open(out + ".log", errors="replace") as f:
        log = f.read()
    assert proc.returncode == 0, f"trainer exited {proc.returncode}:\n{log[-4000:]}"
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    summary["log"] = log
    return summary


def run_trainer(args: list[str], out: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> dict:
    return finish(start_trainer(args, out, env), out, timeout)


def metric_rows(out: str) -> list[dict]:
    try:
        with open(os.path.join(out, "metrics.csv"), newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
