"""Case 10: the seeded random nemesis. CI runs a short form; the soak is `-m soak`."""
from __future__ import annotations

import subprocess
import sys

import pytest

from raftps.chaos.nemesis import schedule


def test_seed_reproduces_the_schedule() -> None:
    assert schedule(7, 60, True) == schedule(7, 60, True)
    assert schedule(7, 60, True) != schedule(8, 60, True)
    assert all(s.fault.split("-")[0] in ("kill", "pause") for s in schedule(7, 60, False))


def run(seconds: int, seed: int, port: int) -> str:
    p = subprocess.run([sys.executable, "-m", "raftps.chaos", "--seconds", str(seconds), "--seed", str(seed),
                        "--base-port", str(port)], capture_output=True, text=True, timeout=seconds + 120)
    print(p.stdout[-3000:], p.stderr[-3000:])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(l for l in p.stdout.splitlines() if l.startswith("case=nemesis"))
    assert "acked_lost=0 duplicated=0" in line and line.endswith("replicas_identical=true")
    return line


def test_nemesis_short() -> None:
    run(25, 7, 7810)


@pytest.mark.soak
@pytest.mark.parametrize("seed", [7, 11, 23])
def test_nemesis_soak(seed: int) -> None:
    run(300, seed, 7820)
