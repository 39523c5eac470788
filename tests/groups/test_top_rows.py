"""raftps top's rows with several Raft groups: a row per node and group, lag per group."""
from __future__ import annotations

import pytest

pytest.importorskip("rich")

from raftps.tools.top import rows, table  # noqa: E402


def sample(applied: dict[tuple[int, int], int]) -> list[dict]:
    return [{"node": n, "group": g, "role": "leader" if n == g + 1 else "follower", "term": 1,
             "commit": max(a for (_, gg), a in applied.items() if gg == g), "applied": a, "pushes": a}
            for (n, g), a in sorted(applied.items())]


def test_lag_is_behind_the_leader_of_the_rows_group() -> None:
    before = (0.0, sample({(1, 0): 10, (2, 0): 10, (1, 1): 50, (2, 1): 50}))
    after = (1.0, sample({(1, 0): 20, (2, 0): 15, (1, 1): 100, (2, 1): 100}))
    out = {(r["node"], r["group"]): r for r in rows(before, after)}
    assert out[(2, 0)]["lag"] == 5 and out[(1, 1)]["lag"] == 0 and out[(2, 1)]["lag"] == 0
    assert out[(2, 0)]["applied/s"] == 5.0 and out[(2, 1)]["applied/s"] == 50.0
    assert "group" in [c.header for c in table(list(out.values()), "t").columns]
