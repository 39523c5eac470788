# Shared by the cluster scripts: run raftps from this checkout with the project's venv if present.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export RAFTPS_RUN_DIR="${RAFTPS_RUN_DIR:-$ROOT/cluster/run}"
export RAFTPS_BASE_PORT="${RAFTPS_BASE_PORT:-7100}"
# The client token the nodes were started with (made by `raftps cluster start`, mode 600).
export RAFTPS_TOKEN_FILE="${RAFTPS_TOKEN_FILE:-$RAFTPS_RUN_DIR/token}"
if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="${PYTHON:-python3}"; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
