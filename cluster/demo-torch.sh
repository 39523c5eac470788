#!/usr/bin/env bash
# The PyTorch demo in one command: set up (torch's CPU build included); start 3 nodes; train the
# character GPT of examples/char_gpt.py with 4 torchrun workers (--max-restarts 3) while the
# store's leader is SIGKILLed and then one worker is SIGKILLed (torchrun restarts the worker
# group, which resumes from the store); print the final validation loss and the plot's path.
# Flags go to examples/torchrun_demo.py (--steps, --workers, --mode, --out, --base-port).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$HERE/setup.sh" --torch
source "$HERE/_env.sh"
exec "$PY" "$ROOT/examples/torchrun_demo.py" "$@"
