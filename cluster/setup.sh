#!/usr/bin/env bash
# Make .venv with raftps installed from this checkout. `--test` adds what the test suite needs:
# pytest, the trainer's extras, Debian's iptables (network-partition tests) and openssl (TLS tests).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
extras="train"

# need COMMAND PACKAGE WHY: install Debian's PACKAGE when COMMAND is missing (as root), or say what
# will be skipped.
need() {
  command -v "$1" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's $2 ($3)"
    (apt-get install -y -qq "$2" >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq "$2" >/dev/null; }) \
      || echo "setup: could not install $2; $3 will fail or be skipped" >&2
  else
    echo "setup: $1 missing and not root: $3 will fail or be skipped" >&2
  fi
}

if [ "${1:-}" = "--test" ]; then
  extras="test,train"
  need iptables iptables "the network-partition tests"
  need openssl openssl "the TLS tests (cluster/make-certs.sh)"
fi
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"
echo "setup: .venv ready ($(.venv/bin/python --version), extras: $extras)"
