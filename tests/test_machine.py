"""The pure state machine: commands, exactly-once sessions, rejections that change nothing,
determinism, snapshot/restore, sync steps."""
import numpy as np
import pytest

from raftps import codec
from raftps.errors import InvalidGradient
from raftps.store.machine import SessionLimits, TensorStore
from raftps.tensor import check_finite

F32 = np.float32


class Log:
    """Feeds commands to a store with consecutive indices and per-client sequence numbers."""

    def __init__(self, store=None):
        self.store = store or TensorStore()
        self.index = 0
        self.seq = {}
        self.entries = []

    def __call__(self, op, client="c1", seq=None, **fields):
        if seq is None:
            seq = self.seq.get(client, 0) + 1
        self.seq[client] = max(self.seq.get(client, 0), seq)
        cmd = {"op": op, "client": client, "seq": seq, "ack": seq, **fields}
        self.index += 1
        self.entries.append((self.index, cmd))
        return self.store.apply(self.index, cmd)


def make(log, name="w", shape=(4,), spec=None, dtype=F32, client="c1"):
    return log("create", client=client, tensors={name: np.zeros(shape, dtype)}, optimizer={name: spec or {"name": "sgd", "lr": 1.0}})


def test_create_push_assign_delete():
    log = Log()
    assert make(log) == {"version": 1, "created": ["w"]}
    assert log("push", tensors={"w": np.ones(4, F32)}) == {"version": 2}
    assert np.array_equal(log.store.tensors["w"].data, -np.ones(4))
    assert log.store.tensors["w"].version == 1
    log("assign", tensors={"w": np.full(4, 7, F32)})
    assert log.store.tensors["w"].data[0] == 7 and log.store.tensors["w"].version == 2
    log("delete", names=["w"])
    assert "w" not in log.store.tensors and log.store.version == 4


def test_create_again_same_spec_is_noop_and_different_is_error():
    log = Log()
    make(log)
    assert make(log)["created"] == []
    assert make(log, shape=(5,))["error"] == "TensorExists"
    assert make(log, spec={"name": "adam", "lr": 0.1})["error"] == "TensorExists"


def test_duplicate_request_returns_cached_result_and_applies_once():
    log = Log()
    make(log)
    first = log("push", seq=2, tensors={"w": np.ones(4, F32)})
    again = log("push", seq=2, tensors={"w": np.ones(4, F32)})
    assert again["duplicate"] and again["version"] == first["version"]
    assert log.store.tensors["w"].version == 1 and log.store.stats["duplicates"] == 1


@pytest.mark.parametrize("grad, code", [
    ({"w": np.ones(5, F32)}, "ShapeMismatch"),
    ({"w": np.ones(4, np.float64)}, "DtypeMismatch"),
    ({"nope": np.ones(4, F32)}, "UnknownTensor"),
    ({"w": np.array([1, np.nan, 0, 0], F32)}, "InvalidGradient"),
    ({"w": np.array([1, np.inf, 0, 0], F32)}, "InvalidGradient"),
    ({"w": np.array([-np.inf, 0, 0, 0], F32)}, "InvalidGradient"),
    ({"w": np.array([np.inf, -np.inf, 0, 0], F32)}, "InvalidGradient"),
    ({"bad name!": np.ones(4, F32)}, "InvalidRequest"),
])
def test_rejected_push_changes_no_tensor_even_in_a_multi_tensor_push(grad, code):
    log = Log()
    make(log)
    make(log, name="v")
    before = [(n, t.version, t.data.tobytes()) for n, t in log.store.tensors.items()]
    result = log("push", tensors={"v": np.ones(4, F32), **grad})
    assert result["error"] == code and ("w" in result["message"] or "nope" in result["message"] or "bad" in result["message"])
    assert [(n, t.version, t.data.tobytes()) for n, t in log.store.tensors.items()] == before


def test_finite_values_whose_sum_overflows_are_accepted_and_exactly_counted_when_not():
    """check_finite sums once; an overflowing sum of finite values must not read as NaN/Inf."""
    big = np.full(4, np.finfo(F32).max, F32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(big.sum())
    check_finite("w", big)
    check_finite("h", np.full(3, 60000.0, np.float16))
    check_finite("i", np.array([2**62, 2**62], np.int64))
    with pytest.raises(InvalidGradient, match="'w': gradient has 2 NaN/Inf"):
        check_finite("w", np.array([np.finfo(F32).max, np.nan, 1.0, -np.inf], F32))


def test_malformed_commands_never_raise():
    store = TensorStore()
    for i, cmd in enumerate([None, 3, {}, {"op": "nope"}, {"op": "push"}, {"op": "push", "client": "a", "seq": 0},
                             {"op": "push", "client": "a", "seq": 1, "ack": 1, "tensors": []},
                             {"op": "create", "client": "a", "seq": 2, "ack": 2, "tensors": {"w": np.ones(2)},
                              "optimizer": {"w": {"name": "sgd", "lr": -1}}},
                             {"op": "create", "client": "a", "seq": 3, "ack": 3, "tensors": {"w": np.ones(2, np.int32)},
                              "optimizer": {"w": {"name": "sgd", "lr": 1}}}], 1):
        assert "error" in store.apply(i, cmd)
    assert store.tensors == {}


def test_same_log_same_digest_and_snapshot_restore_is_exact():
    a, b = Log(), Log()
    rng = np.random.default_rng(0)
    for log in (a, b):
        make(log, spec={"name": "adam", "lr": 0.01})
        make(log, name="m", spec={"name": "momentum", "lr": 0.1, "nesterov": True}, dtype=np.float64)
    grads = [(rng.standard_normal(4).astype(F32), rng.standard_normal(4)) for _ in range(20)]
    for log in (a, b):
        for i, (g, h) in enumerate(grads):
            log("push", client=f"c{i % 3}", tensors={"w": g, "m": h}, base_version=max(1, log.index - 2))
    assert a.store.digest() == b.store.digest()
    restored = TensorStore()
    restored.restore(codec.decode(codec.encode_bytes(a.store.snapshot())))
    assert restored.digest() == a.store.digest()
    # the restored store continues bit-identically, sessions included
    r = Log(restored); r.index, r.seq = a.index, dict(a.seq)
    assert a("push", client="c1", seq=a.seq["c1"], tensors={"w": grads[0][0], "m": grads[0][1]})["duplicate"]
    assert r("push", client="c1", seq=r.seq["c1"], tensors={"w": grads[0][0], "m": grads[0][1]})["duplicate"]
    a("push", tensors={"w": grads[1][0], "m": grads[1][1]})
    r("push", tensors={"w": grads[1][0], "m": grads[1][1]})
    assert a.store.digest() == r.store.digest()


def test_sessions_expire_deterministically_and_a_forgotten_session_is_refused():
    log = Log(TensorStore(SessionLimits(max_sessions=2, idle_entries=100)))
    make(log, client="a")
    for client in ("b", "c"):
        log("push", client=client, tensors={"w": np.ones(4, F32)})
    assert list(log.store.sessions) == ["b", "c"]          # a, the least recently active, is gone
    result = log.store.apply(99, {"op": "push", "client": "a", "seq": 2, "ack": 2, "tensors": {"w": np.ones(4, F32)}})
    assert result["error"] == "SessionExpired"
    assert log.store.tensors["w"].version == 2


def test_ack_forgets_answered_results():
    log = Log()
    make(log)
    for seq in range(2, 6):
        log.store.apply(log.index + seq, {"op": "push", "client": "c1", "seq": seq, "ack": 2, "tensors": {"w": np.ones(4, F32)}})
    assert sorted(log.store.sessions["c1"].results) == [2, 3, 4, 5]
    log.store.apply(100, {"op": "push", "client": "c1", "seq": 6, "ack": 5, "tensors": {"w": np.ones(4, F32)}})
    assert sorted(log.store.sessions["c1"].results) == [5, 6]
    stale = log.store.apply(101, {"op": "push", "client": "c1", "seq": 3, "ack": 3, "tensors": {"w": np.ones(4, F32)}})
    assert stale["duplicate"] and log.store.tensors["w"].version == 5


def test_staleness_counts_pushes_since_the_base_version():
    log = Log()
    make(log)
    v = log("push", tensors={"w": np.ones(4, F32)})["version"]
    for _ in range(3):
        log("push", client="other", tensors={"w": np.ones(4, F32)})
    assert log("push", tensors={"w": np.ones(4, F32)}, base_version=v)["staleness"] == 3
    assert log.store.staleness_histogram() == {3: 1}


def test_sync_step_applies_the_mean_once_and_close_step_proceeds_without_the_missing():
    log = Log()
    make(log, spec={"name": "sgd", "lr": 1.0})
    g = [np.full(4, x, F32) for x in (1.0, 2.0, 6.0)]
    r = [log("push_sync", client=f"w{i}", tensors={"w": g[i]}, step=0, workers=3) for i in range(3)]
    assert [x["applied"] for x in r] == [False, False, True]
    assert np.array_equal(log.store.tensors["w"].data, -np.full(4, 3.0))
    assert log("push_sync", client="w0", tensors={"w": g[0]}, step=0, workers=3)["late"]
    log("push_sync", client="w0", tensors={"w": g[0]}, step=1, workers=3)
    log("push_sync", client="w1", tensors={"w": g[1]}, step=1, workers=3)
    assert log("close_step", client="w0", step=1)["count"] == 2
    assert np.array_equal(log.store.tensors["w"].data, -np.full(4, 4.5))
    assert log.store.tensors["w"].version == 2 and log.store.sync_applied == 1


def test_sync_groups_have_their_own_steps_and_buffers():
    log = Log()
    make(log, spec={"name": "sgd", "lr": 1.0})
    one = np.ones(4, F32)
    # Job A and job B both number their steps from 0; neither applies the other's step.
    assert not log("push_sync", client="a0", tensors={"w": one}, step=0, workers=2, job="jobA")["applied"]
    assert not log("push_sync", client="b0", tensors={"w": 3 * one}, step=0, workers=2, job="jobB")["applied"]
    assert log.store.sync_step_applied("jobA") == -1 and log.store.sync_step_applied("jobB") == -1
    assert log("push_sync", client="a1", tensors={"w": one}, step=0, workers=2, job="jobA")["applied"]
    assert log.store.sync_step_applied("jobA") == 0 and log.store.sync_step_applied("jobB") == -1
    assert np.array_equal(log.store.tensors["w"].data, -one)            # only A's mean (1)
    assert log.store.sync_applied == -1                                  # the default group is untouched
    assert log("close_step", client="b0", step=0, job="jobB")["count"] == 1
    assert np.array_equal(log.store.tensors["w"].data, -4 * one)         # B's mean of one contribution (3)
    # the default group ("" or no group) still works as before
    assert log("push_sync", client="c0", tensors={"w": one}, step=0, workers=1)["applied"]
    assert log.store.sync_applied == 0 and log.store.sync_step_applied("") == 0
    assert log("push_sync", client="c0", tensors={"w": one}, step=0, workers=1, job="")["late"]


def test_sync_rank_is_counted_once_and_a_restarted_worker_changes_nothing():
    log = Log()
    make(log, spec={"name": "sgd", "lr": 1.0})
    g = [np.full(4, x, F32) for x in (2.0, 4.0)]
    r0 = log("push_sync", client="w0", tensors={"w": g[0]}, step=5, workers=2, rank=0, job="job")
    assert r0 == {"version": 2, "step": 5, "applied": False, "count": 1}
    before = log.store.digest()
    # rank 0 died after its push and restarted: a new session pushes step 5 again
    again = log("push_sync", client="w0-restarted", tensors={"w": g[1]}, step=5, workers=2, rank=0, job="job")
    assert again == {"version": 3, "step": 5, "applied": False, "count": 1, "duplicate_rank": True}
    assert log.store.sync.jobs["job"]["buffers"][5]["ranks"] == [0]
    assert np.array_equal(log.store.sync.total("job", 5)["w"], g[0])
    done = log("push_sync", client="w1", tensors={"w": g[1]}, step=5, workers=2, rank=1, job="job")
    assert done["applied"] and done["count"] == 2
    assert np.array_equal(log.store.tensors["w"].data, -np.full(4, 3.0, F32))
    assert before != log.store.digest()
    # without rank, the same worker pushing twice counts twice (today's behaviour)
    log("push_sync", client="x", tensors={"w": g[0]}, step=0, workers=2)
    assert log("push_sync", client="y", tensors={"w": g[0]}, step=0, workers=2)["applied"]


@pytest.mark.parametrize("fields, words", [
    (dict(rank=2), "rank must be an int in [0, workers=2)"),
    (dict(rank=-1), "rank must be an int in [0, workers=2)"),
    (dict(rank=True), "rank must be an int"),
    (dict(job="bad group!"), "bad sync group 'bad group!'"),
    (dict(job=7), "bad sync group 7"),
])
def test_sync_bad_rank_or_group_is_refused_and_changes_nothing(fields, words):
    log = Log()
    make(log)
    r = log("push_sync", tensors={"w": np.ones(4, F32)}, step=0, workers=2, **fields)
    assert r["error"] == "InvalidRequest" and words in r["message"]
    assert log.store.sync.jobs == {} and np.array_equal(log.store.tensors["w"].data, np.zeros(4))
    assert log("close_step", step=0, job="bad group!")["error"] == "InvalidRequest"
    assert log.store.sync.jobs == {}


def test_sync_ranked_and_unranked_contributions_do_not_mix():
    log = Log()
    make(log)
    log("push_sync", client="a", tensors={"w": np.ones(4, F32)}, step=0, workers=2, rank=0)
    r = log("push_sync", client="b", tensors={"w": np.ones(4, F32)}, step=0, workers=2)
    assert r["error"] == "InvalidRequest" and "with and without rank" in r["message"]
    assert log.store.sync.jobs[""]["buffers"][0]["count"] == 1


def test_sync_groups_and_ranks_survive_snapshot_restore_and_digest():
    a, b = Log(), Log()
    for log in (a, b):
        make(log)
        log("push_sync", client="w0", tensors={"w": np.ones(4, F32)}, step=3, workers=3, rank=2, job="j1")
        log("push_sync", client="w1", tensors={"w": np.ones(4, F32)}, step=0, workers=1, job="j2")
    assert a.store.digest() == b.store.digest()
    restored = TensorStore()
    restored.restore(codec.decode(codec.encode_bytes(a.store.snapshot())))
    assert restored.digest() == a.store.digest()
    assert restored.sync_step_applied("j2") == 0 and restored.sync.jobs["j1"]["buffers"][3]["ranks"] == [2]
    r = Log(restored); r.index, r.seq = a.index, dict(a.seq)
    assert r("push_sync", client="w9", tensors={"w": np.ones(4, F32)}, step=3, workers=3, rank=2,
             job="j1")["duplicate_rank"]


def test_restore_reads_a_format_1_snapshot():
    log = Log()
    make(log)
    log("push_sync", client="w0", tensors={"w": np.ones(4, F32)}, step=7, workers=2)
    snap = log.store.snapshot()
    [[group, applied, buffers]] = snap["sync"]
    old = dict(snap, format=1, sync=[applied, [[s, c, w, sums] for s, c, w, _, sums in buffers]])
    restored = TensorStore()
    restored.restore(codec.decode(codec.encode_bytes(old)))
    assert restored.digest() == log.store.digest() and restored.sync_count("", 7) == 1
