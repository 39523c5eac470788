#!/usr/bin/env bash
# The PyTorch demo in one command: set up (torch's CPU build included); start 3 nodes; train the
# character GPT of examples/char_gpt.py with 4 workers while the store's leader is SIGKILLed and
# then one worker is SIGKILLed; print the final validation loss and the plot's path. By default
# every worker is a process of its own, restarted alone if it dies (--launch torchrun: one
# torchrun --max-restarts 3, which restarts the whole group); mode sync by default (the best
# validation loss at 300 batches here), --mode diloco for DiLoCo with the outer step in the store.
# Flags go to examples/torchrun_demo.py (--steps, --workers, --mode, --sync-every, --launch, --out, --base-port).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$HERE/setup.sh" --torch
source "$HERE/_env.sh"
exec "$PY" "$ROOT/examples/torchrun_demo.py" "$@"
