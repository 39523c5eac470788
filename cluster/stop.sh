#!/usr/bin/env bash
# Stop every node of the local cluster gracefully (SIGTERM, then SIGKILL after 10 s).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec "$PY" -m raftps cluster stop "$@"
