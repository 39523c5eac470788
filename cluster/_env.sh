# Shared by the cluster scripts: run raftps from this checkout with the project's venv if present.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export RAFTPS_RUN_DIR="${RAFTPS_RUN_DIR:-$ROOT/cluster/run}"
export RAFTPS_BASE_PORT="${RAFTPS_BASE_PORT:-7100}"
# The client token the nodes were started with (made by `raftps cluster start`, mode 600).
export RAFTPS_TOKEN_FILE="${RAFTPS_TOKEN_FILE:-$RAFTPS_RUN_DIR/token}"
if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else
  PY="${PYTHON:-python3}"
  "$PY" -c "import msgpack, numpy, pysyncobj" 2>/dev/null \
    || { echo "$(basename "$0"): $PY lacks raftps's dependencies: run cluster/setup.sh first" >&2; exit 2; }
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Start the local cluster's nodes that are down, print start.sh's status table on stdout and export
# its last lines (RAFTPS_TOKEN_FILE, RAFTPS_CLUSTER) into this shell. The output is captured and
# printed once: `tee /dev/stderr` reopened a log file that stdout and stderr share at offset 0
# and wrote NUL bytes over it (`demo.sh > demo.log 2>&1`).
start_and_export() {
  local out
  out="$(bash "$ROOT/cluster/start.sh" "$@")"
  printf '%s\n' "$out"
  eval "$(printf '%s\n' "$out" | grep -E '^RAFTPS_(CLUSTER|TOKEN_FILE)=' | sed 's/^/export /')"
}
