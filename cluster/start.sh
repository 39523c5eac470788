#!/usr/bin/env bash
# Start the nodes of a local cluster that are down (all of them the first time), wait for a leader,
# print the status table, and as the last line RAFTPS_CLUSTER=<client addresses>.
# Usage: cluster/start.sh [--nodes N] [--groups G] [--durability fsync]   (env: RAFTPS_RUN_DIR, RAFTPS_BASE_PORT)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec "$PY" -m raftps cluster start "$@"
