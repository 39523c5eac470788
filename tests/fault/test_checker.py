"""The checker on synthetic histories: clean ones pass, each kind of anomaly is caught."""
from __future__ import annotations

import numpy as np
import pytest

from raftps.chaos.checker import check
from raftps.chaos.history import FAILED, OK, PULL, PUSH, UNKNOWN, History, Op

N = 16


class Builder:
    """Builds a history op by op with explicit times; the final tensor follows the pushes."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.final = np.zeros(N)
        self.seq: dict[int, int] = {}

    def _op(self, kind: str, client: int, start: float, end: float, outcome: str, **kw) -> Op:
        seq = self.seq.get(client, 0)
        self.seq[client] = seq + 1
        op = Op(kind=kind, client=client, seq=seq, start=start, end=end, outcome=outcome, **kw)
        self.ops.append(op)
        return op

    def push(self, client: int, k: int, start: float, end: float, outcome: str = OK,
             version: int | None = None, applied: int | None = None) -> Op:
        self.final[k] += (1 if outcome == OK else 0) if applied is None else applied
        return self._op(PUSH, client, start, end, outcome, k=k, version=version)

    def pull(self, client: int, start: float, end: float, version: int, ks: list[int],
             odd: dict | None = None, linearizable: bool = True) -> Op:
        return self._op(PULL, client, start, end, OK, version=version, nonzero=sorted(ks),
                        odd=odd or {}, linearizable=linearizable)


STATUS = [{"node": i, "role": "follower", "applied": 9, "digest": "ab"} for i in (1, 2, 3)]


def clean() -> Builder:
    b = Builder()
    b.push(0, 0, 0.0, 1.0, OK, 2)
    b.push(1, 1, 0.5, 1.5, OK, 3)
    b.pull(0, 2.0, 2.1, 3, [0, 1])
    b.push(0, 2, 3.0, 9.0, UNKNOWN, applied=1)          # applied at version 4, nobody was told
    b.push(1, 3, 3.0, 3.5, FAILED, applied=0)
    b.pull(1, 4.0, 4.2, 3, [0, 1])                      # concurrent with the unknown push: may miss it
    b.push(1, 4, 5.0, 5.5, OK, 5)
    b.pull(1, 6.0, 6.1, 5, [0, 1, 2, 4])
    b.push(2, 5, 6.0, 20.0, UNKNOWN, applied=0)         # never applied: fine
    return b


def test_clean_history_passes() -> None:
    b = clean()
    r = check(b.ops, b.final, STATUS)
    assert r.valid, r.problems
    assert (r.ops, r.ok, r.failed, r.ambiguous, r.ambiguous_applied) == (9, 6, 1, 2, 1)
    line = r.line("synthetic", failover_s=1.234)
    assert "acked_lost=0 duplicated=0" in line and "linearizable=true" in line
    assert "failover_s=1.23" in line and line.endswith("replicas_identical=true")


def test_history_object_and_json_roundtrip(tmp_path) -> None:
    b = clean()
    h = History(ops=b.ops)
    h.dump(str(tmp_path / "h.json"))
    assert check(History.load(str(tmp_path / "h.json")), b.final, STATUS).valid


def test_lost_ack_fails() -> None:
    b = clean()
    b.push(0, 6, 7.0, 7.5, OK, 6, applied=0)
    r = check(b.ops, b.final, STATUS)
    assert r.acked_lost == 1 and not r.valid


def test_duplicate_fails() -> None:
    b = clean()
    b.push(0, 6, 7.0, 7.5, OK, 6, applied=2)
    r = check(b.ops, b.final, STATUS)
    assert r.duplicated == 1 and not r.valid


def test_unknown_applied_twice_is_a_duplicate() -> None:
    b = clean()
    b.push(0, 6, 7.0, 9.5, UNKNOWN, applied=2)
    assert check(b.ops, b.final, STATUS).duplicated == 1


def test_failed_but_applied_fails() -> None:
    b = clean()
    b.push(0, 6, 7.0, 7.5, FAILED, applied=1)
    r = check(b.ops, b.final, STATUS)
    assert r.failed_applied == 1 and not r.valid


def test_phantom_element_fails() -> None:
    b = clean()
    b.final[N - 1] = 1.0
    r = check(b.ops, b.final, STATUS)
    assert r.phantom == 1 and not r.valid


def test_stale_read_fails() -> None:
    b = clean()
    b.pull(2, 7.0, 7.1, 3, [0, 1])          # push k=4 (version 5) was acknowledged at 5.5
    r = check(b.ops, b.final, STATUS)
    assert r.stale_reads == 1 and not r.linearizable and not r.valid


def test_stale_read_after_a_read_fails() -> None:
    b = Builder()
    b.push(0, 0, 0.0, 1.0, UNKNOWN, applied=1)
    b.pull(1, 2.0, 2.5, 7, [0])
    b.pull(2, 3.0, 3.5, 6, [0])              # started after a read at version 7 returned
    assert check(b.ops, b.final, STATUS).stale_reads == 1


def test_stale_non_linearizable_read_is_allowed() -> None:
    b = clean()
    b.pull(2, 7.0, 7.1, 3, [0, 1], linearizable=False)
    assert check(b.ops, b.final, STATUS).valid


def test_backwards_version_fails() -> None:
    b = Builder()
    b.push(0, 0, 0.0, 1.0, OK, 2)
    b.push(1, 1, 0.0, 1.0, OK, 3)
    b.pull(0, 1.5, 1.6, 3, [0, 1], linearizable=False)
    b.pull(0, 2.0, 2.1, 2, [0], linearizable=False)      # not a real-time violation: not linearizable
    r = check(b.ops, b.final, STATUS)
    assert r.backwards == 1 and r.stale_reads == 0 and not r.valid


def test_push_below_what_the_client_saw_fails() -> None:
    b = Builder()
    b.push(1, 1, 0.0, 5.0, UNKNOWN, applied=1)
    b.pull(0, 0.5, 0.6, 4, [1], linearizable=False)
    b.push(0, 0, 1.0, 1.5, OK, 3)                        # landed below version 4, seen earlier
    assert check(b.ops, b.final, STATUS).backwards == 1


def test_read_missing_a_push_at_its_version_fails() -> None:
    b = clean()
    b.pull(2, 7.0, 7.1, 5, [0, 1, 2])                    # k=4 has version 5 but is not set
    r = check(b.ops, b.final, STATUS)
    assert r.bad_contents == 1 and not r.linearizable


def test_read_showing_a_later_push_fails() -> None:
    b = Builder()
    b.push(0, 0, 0.0, 1.0, OK, 2)
    b.push(1, 1, 0.0, 3.0, OK, 3)
    b.pull(2, 0.5, 2.0, 2, [0, 1])                       # version 2 cannot contain version 3
    assert check(b.ops, b.final, STATUS).bad_contents == 1


def test_read_showing_failed_or_lost_push_fails() -> None:
    b = clean()
    b.pull(2, 7.0, 7.1, 5, [0, 1, 2, 3, 4])              # k=3 failed definitely
    assert check(b.ops, b.final, STATUS).bad_contents == 1
    b = clean()
    b.pull(2, 7.0, 7.1, 5, [0, 1, 2, 4, 5])              # k=5 (unknown) was never applied
    assert check(b.ops, b.final, STATUS).bad_contents == 1


def test_read_showing_double_application_fails() -> None:
    b = clean()
    b.pull(2, 7.0, 7.1, 5, [0, 1, 2, 4], odd={4: 2.0})
    assert check(b.ops, b.final, STATUS).bad_contents == 1


def test_unknown_push_flickering_fails() -> None:
    b = Builder()
    b.push(0, 0, 0.0, 9.0, UNKNOWN, applied=1)
    b.pull(1, 1.0, 1.1, 4, [0], linearizable=False)
    b.pull(2, 1.0, 1.1, 6, [], linearizable=False)       # a higher version without it
    assert check(b.ops, b.final, STATUS).bad_contents == 1


def test_versions_shared_by_two_acks_fail() -> None:
    b = Builder()
    b.push(0, 0, 0.0, 1.0, OK, 2)
    b.push(1, 1, 0.0, 1.0, OK, 2)
    assert check(b.ops, b.final, STATUS).version_conflicts == 1


@pytest.mark.parametrize("statuses", [
    [{"node": 1, "role": "leader", "applied": 9, "digest": "ab"},
     {"node": 2, "role": "follower", "applied": 9, "digest": "ab"},
     {"node": 3, "role": "follower", "applied": 9, "digest": "cd"}],     # same index, other bytes
    [{"node": 1, "role": "leader", "applied": 9, "digest": "ab"},
     {"node": 2, "role": "follower", "applied": 9, "digest": "ab"},
     {"node": 3, "role": "follower", "applied": 7, "digest": "ee"}],     # never caught up
    [{"node": 1, "role": "leader", "applied": 9, "digest": "ab"},
     {"node": 2, "role": "follower", "applied": 9, "digest": "ab"},
     {"node": 3, "role": "down", "applied": None, "digest": None}],
])
def test_replica_mismatch_fails(statuses) -> None:
    b = clean()
    r = check(b.ops, b.final, statuses)
    assert not r.replicas_identical and not r.valid and r.replicas == 3
    assert r.line("x").endswith("replicas_identical=false")
