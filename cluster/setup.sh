#!/usr/bin/env bash
# Make .venv with raftps installed from this checkout. `--test` adds what the test suite needs:
# pytest, the trainer's extras, torch's CPU build (raftps.torch), the `frameworks` extra (Lightning,
# Transformers, Accelerate: tests/frameworks; 26 s of pip on a loaded 2-core machine, against 40 s
# for the other extras), the `docs` extra (mkdocs: the site's build test), Debian's iptables
# (network-partition tests) and openssl (TLS tests). `--torch` adds torch alone. Every mode installs the `ops` extra (safetensors, rich: the operator's commands).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
extras="train,ops"

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

with_torch=0
case "${1:-}" in
  ""|--test|--torch) [ $# -le 1 ] || { echo "setup: one option at most; usage: cluster/setup.sh [--test | --torch]" >&2; exit 2; } ;;
  *) echo "setup: unknown option ${1}; usage: cluster/setup.sh [--test | --torch]" >&2; exit 2 ;;
esac
case "${1:-}" in
  --test)
    extras="test,train,torch,frameworks,ops,docs"; with_torch=1
    need iptables iptables "the network-partition tests"
    need openssl openssl "the TLS tests (cluster/make-certs.sh)" ;;
  --torch) extras="train,torch,ops"; with_torch=1 ;;
esac
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
# torch's CPU build, before the `torch` extra asks for torch: a plain `pip install torch` resolves
# to the CUDA build (several GB of nvidia wheels). A CPU wheel on this machine's disk
# ($TORCH_WHEEL, or /opt/wheels) is used first, else PyTorch's CPU index.
if [ "$with_torch" = 1 ] && ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  wheel="${TORCH_WHEEL:-$(ls /opt/wheels/torch-*cpu*.whl 2>/dev/null | head -1 || true)}"
  if [ -n "$wheel" ] && [ -f "$wheel" ]; then
    echo "setup: installing torch (CPU) from $wheel"
    .venv/bin/python -m pip install -q --disable-pip-version-check "$wheel"
  else
    echo "setup: installing torch (CPU) from download.pytorch.org/whl/cpu"
    .venv/bin/python -m pip install -q --disable-pip-version-check torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"
echo "setup: .venv ready ($(.venv/bin/python --version), extras: $extras)"
