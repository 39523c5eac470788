#!/usr/bin/env bash
# Make .venv with raftps installed from this checkout. `--test` adds what the test suite needs:
# pytest, the trainer's extras, and Debian's iptables for the network-partition tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
extras="train"
if [ "${1:-}" = "--test" ]; then
  extras="test,train"
  if ! command -v iptables >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "setup: installing Debian's iptables (network-partition tests)"
      (apt-get install -y -qq iptables >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq iptables >/dev/null; }) \
        || echo "setup: could not install iptables; partition tests will be skipped" >&2
    else
      echo "setup: iptables missing and not root: partition tests will be skipped" >&2
    fi
  fi
fi
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"
echo "setup: .venv ready ($(.venv/bin/python --version), extras: $extras)"
