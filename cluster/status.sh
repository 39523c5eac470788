#!/usr/bin/env bash
# A table of node, pid, role, term, applied index, store version, digest and leader.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec "$PY" -m raftps cluster status "$@"
