#!/usr/bin/env bash
# Everything `python -m bench` compares against, installed once (never from the test suite):
#   .venv with raftps (cluster/setup.sh), Debian's etcd-server (etcd 3.4, the comparison store),
#   cryptography (the naive store's pysyncobj password),
#   torch's CPU wheel (the torch.distributed all-reduce training baseline; optional),
#   and torchft 0.2.0 (the goodput part's fault-tolerant baseline).
# `python -m bench` runs this when etcd, torch or cryptography is missing; each step is skipped when done.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[ -x .venv/bin/python ] || bash cluster/setup.sh
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bench setup: installing Debian's etcd-server (etcd 3.4)"
    # The package's own service must not start: the benchmark runs its own cluster on its ports.
    made_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
    fi
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; }) \
      || echo "bench setup: could not install etcd-server; the etcd rows will be skipped" >&2
    [ "$made_policy" = 0 ] || rm -f /usr/sbin/policy-rc.d
  else
    echo "bench setup: etcd missing and not root (or no apt-get): the etcd rows will be skipped" >&2
  fi
fi
if ! .venv/bin/python -c "import cryptography" >/dev/null 2>&1; then
  echo "bench setup: installing the bench extra (cryptography, for the naive store's peer password)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[bench]" \
    || echo "bench setup: cryptography did not install; the naive rows will be skipped" >&2
fi
TORCH_WHEEL="${TORCH_WHEEL:-$(ls /opt/wheels/torch-*cpu*.whl 2>/dev/null | head -1 || true)}"
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if [ -n "$TORCH_WHEEL" ] && [ -f "$TORCH_WHEEL" ]; then
    echo "bench setup: installing torch from $TORCH_WHEEL"
    .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_WHEEL" \
      || echo "bench setup: torch did not install; the torch all-reduce row will be skipped" >&2
  else
    echo "bench setup: no torch wheel (set TORCH_WHEEL=path.whl); the torch all-reduce row will be skipped" >&2
  fi
fi
# torchft (the goodput part's fault-tolerant baseline; its wheel carries torchft_lighthouse), after
# torch's CPU build so that pip does not resolve torchft's torch requirement to the CUDA build.
if .venv/bin/python -c "import torch" >/dev/null 2>&1 && ! .venv/bin/python -c "import torchft" >/dev/null 2>&1; then
  echo "bench setup: installing torchft 0.2.0"
  .venv/bin/python -m pip install -q --disable-pip-version-check "torchft==0.2.0" \
    || echo "bench setup: torchft did not install; the goodput part's torchft rows will be skipped" >&2
fi
echo "bench setup: etcd $(command -v etcd >/dev/null && etcd --version | head -1 || echo missing);" \
     "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)' 2>/dev/null || echo missing);" \
     "torchft $(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torchft"))' 2>/dev/null || echo missing)"
