#!/usr/bin/env bash
# SIGKILL node NODE (1..N): the fault-injection primitive. cluster/start.sh restarts it.
# Usage: cluster/kill.sh NODE
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
[ $# -ge 1 ] || { echo "usage: $0 NODE" >&2; exit 2; }
exec "$PY" -m raftps cluster kill "$@"
