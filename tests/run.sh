#!/usr/bin/env bash
# Install what the tests need (venv, packages, Debian's iptables) and run the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/cluster/setup.sh" --test
cd "$ROOT"
exec .venv/bin/python -m pytest -q "$@"
