"""Moved to bench/trainer_bench.py, the benchmarks' one home: ``python -m trainer.bench``, the
name its results (bench/results/trainer_bench.md) and the docs give, still runs it there."""
from __future__ import annotations

from bench.trainer_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
