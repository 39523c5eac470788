#!/usr/bin/env bash
# The main job in one command: set up; start a 3-node cluster, create a model, push gradients,
# SIGKILL the leader, push again (the client fails over), show status, stop; then train an MLP with
# 4 async workers while the leader is SIGKILLed halfway, print the test accuracy and the plot path.
set -euo pipefail
[ $# -eq 0 ] || { echo "usage: $0 (no arguments; env: RAFTPS_RUN_DIR, RAFTPS_BASE_PORT, RAFTPS_DEMO_OUT)" >&2; exit 2; }
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$HERE/setup.sh"
export RAFTPS_RUN_DIR="${RAFTPS_RUN_DIR:-$(mktemp -d /tmp/raftps-demo.XXXXXX)}"
source "$HERE/_env.sh"
trap '"$PY" -m raftps cluster wipe >/dev/null 2>&1 || true' EXIT
echo "== starting a 3-node cluster in $RAFTPS_RUN_DIR"
start_and_export
"$PY" - <<'PY'
import os, subprocess, time
import numpy as np
from raftps import Client, ShapeMismatch

here = os.path.join(os.environ["PYTHONPATH"].split(":")[0], "cluster")
with Client(timeout=30) as c:
    print("== create w (1M float32 = 4 MiB) with adam, and push 20 gradients")
    c.create("w", np.zeros(1 << 20, np.float32), optimizer={"name": "adam", "lr": 0.01})
    grad = np.full(1 << 20, 0.5, np.float32)
    t0 = time.perf_counter()
    for _ in range(20):
        version = c.push({"w": grad})
    print(f"   20 pushes of 4 MiB in {time.perf_counter() - t0:.2f} s, store version {version}")
    leader = next(s["node"] for s in c.status() if s["role"] == "leader")
    print(f"== SIGKILL the leader, node {leader}")
    subprocess.run(["bash", os.path.join(here, "kill.sh"), str(leader)], check=True)
    t0 = time.perf_counter()
    version = c.push({"w": grad})
    print(f"   next push committed {time.perf_counter() - t0:.2f} s after the kill, at version {version}")
    tensors, version = c.pull(["w"])
    print(f"== linearizable pull at version {version}: w[:3] = {tensors['w'][:3]}")
    try:
        c.push({"w": np.ones(3, np.float32)})
    except ShapeMismatch as e:
        print(f"== a bad push is refused and changes nothing: ShapeMismatch: {e}")
    print("== restart the killed node; it catches up")
    subprocess.run(["bash", os.path.join(here, "start.sh")], check=True, stdout=subprocess.DEVNULL)
    for _ in range(100):
        rows = c.status()
        if len({r["digest"] for r in rows if r["role"] != "down"}) == 1 and all(r["role"] != "down" for r in rows):
            break
        time.sleep(0.1)
PY
echo "== status"
bash "$HERE/status.sh"
"$PY" -m raftps cluster wipe >/dev/null
trap - EXIT
echo
echo "== training: a 1.08M-parameter MLP on digits, 4 async workers, the leader SIGKILLed halfway"
"$PY" -m trainer demo --base-port "$RAFTPS_BASE_PORT" --out "${RAFTPS_DEMO_OUT:-runs/demo}"
