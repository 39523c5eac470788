"""Asynchrony-aware apply paths on the pure state machine: per-tensor staleness, staleness-aware
lr, AdaRevision against a transcription of the paper, EASGD's elastic add, compressed pushes,
SSP clocks. Determinism: two stores fed the same log end with the same digest."""
import math

import numpy as np
import pytest

from raftps import codec, compress, optim
from raftps.store.machine import TensorStore

from test_machine import Log, make

F32, F64 = np.float32, np.float64


def pushes(log, n, client="other", value=1.0, name="w", shape=(4,)):
    for _ in range(n):
        log("push", client=client, tensors={name: np.full(shape, value, F32)})


def test_staleness_counts_updates_to_the_tensor_not_raft_indices():
    log = Log()
    make(log, name="w")
    make(log, name="v")
    base = log("push", tensors={"w": np.ones(4, F32)})["version"]
    pushes(log, 2, name="v")                       # other tensor: does not make w's gradient staler
    log("barrier")
    pushes(log, 3, name="w")
    log("push", client="bad", tensors={"w": np.full(4, np.nan, F32)})   # rejected: not an update
    assert log("push", tensors={"w": np.ones(4, F32)}, base_version=base)["staleness"] == 3
    assert log.store.tensor_staleness("v", base) == 2
    assert log.store.staleness_histogram() == {3: 1}


def test_base_version_in_the_future_is_refused_and_changes_nothing():
    log = Log()
    make(log)
    r = log("push", tensors={"w": np.ones(4, F32)}, base_version=99)
    assert r["error"] == "InvalidRequest" and "base_version" in r["message"]
    assert log.store.tensors["w"].version == 0


def test_staleness_aware_lr_divides_by_tau_for_every_optimizer():
    for name in ("sgd", "momentum", "adagrad", "adam"):
        spec = {"name": name, "lr": 0.1, "staleness_aware": True}
        full = optim.normalize(spec)
        p, g = np.arange(4, dtype=F64), np.full(4, 0.5)
        state = optim.init_state(full, p)
        aware, _ = optim.step(full, p, g, state, optim.Context(10, 5, 4))
        plain, _ = optim.step(optim.normalize(dict(spec, lr=0.1 / 4, staleness_aware=False)), p, g, state)
        assert np.array_equal(aware, plain), name
        fresh, _ = optim.step(full, p, g, state, optim.Context(10, 9, 0))     # tau 0 counts as 1
        assert np.array_equal(fresh, optim.step(optim.normalize(dict(spec, staleness_aware=False)), p, g, state)[0])


def test_staleness_aware_through_the_store():
    log = Log()
    make(log, spec={"name": "sgd", "lr": 1.0, "staleness_aware": True})
    base = log("push", tensors={"w": np.ones(4, F32)})["version"]        # w = -1
    pushes(log, 3)                                                      # w = -4
    log("push", tensors={"w": np.full(4, 3.0, F32)}, base_version=base)  # tau 3: w -= 3/3
    assert np.array_equal(log.store.tensors["w"].data, np.full(4, -5.0, F32))


# ---- AdaRevision -------------------------------------------------------------------------------

def adarevision_reference(alpha, z0, x0, schedule, grad_fn):
    """McMahan & Streeter 2014, Algorithm 2, one coordinate at a time, Python floats. Workers
    read (x, gbar) and later update with (g, gbar_old): the worker-echo form of the paper."""
    n = len(x0)
    x, gbar, z, zp = list(map(float, x0)), [0.0] * n, [z0] * n, [z0] * n
    reads = {}
    for event, worker in schedule:
        if event == "read":
            reads[worker] = (list(x), list(gbar))
            continue
        seen, gbar_old = reads[worker]
        g_all = grad_fn(np.array(seen))
        for i in range(n):
            g = float(g_all[i])
            g_bck = gbar[i] - gbar_old[i]
            eta_old = alpha / math.sqrt(zp[i])
            z[i] = z[i] + g * g + 2.0 * g * g_bck
            zp[i] = max(z[i], zp[i])
            eta = alpha / math.sqrt(zp[i])
            x[i] = x[i] - eta * g + (eta_old - eta) * g_bck
            gbar[i] = gbar[i] + g
    return np.array(x)


def run_adarevision_store(alpha, z0, x0, schedule, grad_fn, dtype, window=64):
    log = Log()
    log("create", tensors={"w": x0.astype(dtype)},
        optimizer={"w": {"name": "adarevision", "lr": alpha, "initial_accumulator": z0, "window": window}})
    reads = {}
    for event, worker in schedule:
        if event == "read":
            reads[worker] = (log.store.tensors["w"].data, log.store.version)   # what a pull returns
            continue
        seen, version = reads[worker]
        r = log("push", client=worker, tensors={"w": grad_fn(seen).astype(dtype)}, base_version=version)
        assert "error" not in r, r
    return log


def async_schedule(workers=3, rounds=12):
    """Each worker reads, the others update in between: delays 0..workers-1 (deterministic)."""
    out = [("read", f"w{k}") for k in range(workers)]
    for r in range(rounds):
        for k in range(workers):
            out += [("update", f"w{k}"), ("read", f"w{k}")]
        if r % 3 == 2:                                  # an extra-long delay for w0 now and then
            out += [("update", "w1"), ("read", "w1"), ("update", "w2"), ("read", "w2")]
    return out


A = np.array([[2.0, 0.3, 0.0], [0.3, 1.0, -0.2], [0.0, -0.2, 0.5]])
B = np.array([1.0, -2.0, 0.5])


def lsq_grad(x):
    """Gradient of 0.5 x^T A x - b^T x, in the dtype of x."""
    return (A.astype(x.dtype) @ x - B.astype(x.dtype)).astype(x.dtype)


def test_adarevision_matches_the_paper_bit_for_bit_in_float64():
    # float64 throughout, the same operations in the same order: IEEE gives the same bits, so
    # the test demands equality, not a tolerance (any reordering of the update would show).
    x0 = np.array([0.5, -0.5, 1.0])
    sched = async_schedule()
    ref = adarevision_reference(0.5, 0.1, x0, sched, lsq_grad)
    log = run_adarevision_store(0.5, 0.1, x0, sched, lsq_grad, F64)
    assert np.array_equal(log.store.tensors["w"].data, ref)
    assert max(log.store.staleness_histogram()) >= 4        # the schedule really is delayed


def test_adarevision_float32_is_close_to_the_float64_paper():
    # float32 rounds every operation to 24 bits; the reference is exact float64: a tolerance.
    x0 = np.array([0.5, -0.5, 1.0])
    sched = async_schedule()
    ref = adarevision_reference(0.5, 0.1, x0, sched, lsq_grad)
    log = run_adarevision_store(0.5, 0.1, x0, sched, lsq_grad, F32)
    assert np.allclose(log.store.tensors["w"].data, ref, rtol=1e-4, atol=1e-5)


def test_adarevision_base_outside_the_window_is_a_clear_error_that_changes_nothing():
    x0 = np.zeros(3)
    log = run_adarevision_store(0.5, 0.1, x0, [], lsq_grad, F64, window=2)
    log("push", client="other", tensors={"w": np.ones(3)}, base_version=log.store.version)
    old = log.store.version
    done = []
    for _ in range(3):                 # tau 3 > window 2: the sum at `old` was evicted
        done.append(log("push", client="other", tensors={"w": np.ones(3)}, base_version=log.store.version)["version"])
    before = log.store.tensors["w"]
    r = log("push", tensors={"w": np.ones(3)}, base_version=old)
    assert r["error"] == "StaleBase" and f"base_version {old}" in r["message"], r
    assert log.store.tensors["w"] is before
    ok = log("push", tensors={"w": np.ones(3)}, base_version=done[0])   # tau 2: corrected
    assert "error" not in ok and ok["staleness"] == 2


def test_a_push_refused_by_adarevision_updates_none_of_its_tensors():
    log = Log()
    make(log, name="a")                                           # sgd, sorted before w
    log("create", tensors={"w": np.zeros(3)}, optimizer={"w": {"name": "adarevision", "lr": 0.1, "window": 1}})
    old = log.store.version
    for _ in range(3):
        log("push", client="other", tensors={"a": np.ones(4, F32), "w": np.ones(3)}, base_version=log.store.version)
    before = dict(log.store.tensors)
    r = log("push", tensors={"a": np.ones(4, F32), "w": np.ones(3)}, base_version=old)
    assert r["error"] == "StaleBase"
    assert all(log.store.tensors[k] is before[k] for k in before)


def test_adarevision_is_deterministic_and_survives_snapshot_restore():
    x0 = np.array([0.5, -0.5, 1.0])
    a = run_adarevision_store(0.5, 0.1, x0, async_schedule(rounds=4), lsq_grad, F32, window=4)
    b = run_adarevision_store(0.5, 0.1, x0, async_schedule(rounds=4), lsq_grad, F32, window=4)
    assert a.store.digest() == b.store.digest()
    restored = TensorStore()
    restored.restore(codec.decode(codec.encode_bytes(a.store.snapshot())))
    assert restored.digest() == a.store.digest()
    for store in (a.store, restored):
        store.apply(10_000, {"op": "push", "client": "z", "seq": 1, "ack": 1,
                             "tensors": {"w": np.ones(3, F32)}, "base_version": store.version - 2})
    assert restored.digest() == a.store.digest()


# ---- EASGD ------------------------------------------------------------------------------------

def test_elastic_adds_the_pushed_delta():
    log = Log()
    make(log, spec={"name": "elastic"})
    log("push", tensors={"w": np.full(4, 0.25, F32)})
    log("push", client="b", tensors={"w": np.full(4, -1.0, F32)})
    assert np.array_equal(log.store.tensors["w"].data, np.full(4, -0.75, F32))


# ---- compression ------------------------------------------------------------------------------

def test_fp16_push_decodes_to_the_scaled_value_on_every_replica():
    g = np.random.default_rng(0).standard_normal(1000).astype(F32) * 1e-4
    tensors, enc = compress.encode_push({"w": g}, "fp16")
    assert tensors["w"].dtype == np.float16 and tensors["w"].nbytes == g.nbytes // 2
    assert enc["w"]["scale"] == 2.0 ** round(math.log2(enc["w"]["scale"]))
    logs = [Log(), Log()]
    for log in logs:
        make(log, shape=(1000,))
        log("push", tensors=tensors, encoding=enc)
    got = -logs[0].store.tensors["w"].data
    assert np.allclose(got, g, rtol=2e-3, atol=1e-9)          # fp16's 11-bit mantissa
    assert logs[0].store.digest() == logs[1].store.digest()


def test_topk_push_scatters_and_payload_scales_with_k():
    rng = np.random.default_rng(1)
    g = rng.standard_normal((50, 40)).astype(F32)
    topk = compress.TopK(0.01)
    tensors, enc = compress.encode_push({"w": g}, "topk", topk)
    idx = tensors["w" + compress.INDICES_SUFFIX]
    assert len(idx) == 20 and idx.dtype == np.int32 and sum(a.nbytes for a in tensors.values()) == 160
    assert set(idx) == set(np.argsort(-np.abs(g.ravel()))[:20])
    # error feedback: what was not sent is kept, what was sent is zeroed
    assert np.array_equal(topk.residual["w"].ravel()[idx], np.zeros(20, F32))
    assert np.array_equal(topk.residual["w"] + np.isin(np.arange(2000), idx).reshape(50, 40) * g, g)
    log = Log()
    make(log, shape=(50, 40))
    log("push", tensors=tensors, encoding=enc)
    expect = np.zeros(2000, F32)
    expect[idx] = -g.ravel()[idx]
    assert np.array_equal(log.store.tensors["w"].data.ravel(), expect)


@pytest.mark.parametrize("tensors, enc, message", [
    ({"w": np.ones(2, F32), "w:indices": np.array([0, 4], np.int32)}, {"w": {"kind": "topk"}}, "out of range"),
    ({"w": np.ones(2, F32), "w:indices": np.array([-1, 2], np.int32)}, {"w": {"kind": "topk"}}, "out of range"),
    ({"w": np.ones(2, F32), "w:indices": np.array([1, 1], np.int32)}, {"w": {"kind": "topk"}}, "duplicates"),
    ({"w": np.ones(2, F32), "w:indices": np.array([2, 1], np.int32)}, {"w": {"kind": "topk"}}, "increasing"),
    ({"w": np.ones(2, F32), "w:indices": np.array([0, 1], np.float32)}, {"w": {"kind": "topk"}}, "int32 or int64"),
    ({"w": np.ones(2, F64), "w:indices": np.array([0, 1], np.int32)}, {"w": {"kind": "topk"}}, "values are float64"),
    ({"w": np.ones(3, F32), "w:indices": np.array([0, 1], np.int32)}, {"w": {"kind": "topk"}}, "equal length"),
    ({"w": np.ones(2, F32)}, {"w": {"kind": "topk"}}, "needs 'w:indices'"),
    ({"w": np.ones(4, np.float16)}, {"w": {"kind": "fp16", "scale": 0.0}}, "scale"),
    ({"w": np.ones(4, F32)}, {"w": {"kind": "fp16", "scale": 2.0}}, "float16"),
    ({"w": np.ones(4, np.float16)}, {"w": {"kind": "zip"}}, "kind"),
    ({"w": np.full(4, np.inf, np.float16)}, {"w": {"kind": "fp16", "scale": 1.0}}, "NaN/Inf"),
])
def test_bad_encoded_pushes_are_named_and_change_nothing(tensors, enc, message):
    log = Log()
    make(log)
    before = log.store.tensors["w"]
    r = log("push", tensors=tensors, encoding=enc)
    assert "error" in r and message in r["message"], r
    assert log.store.tensors["w"] is before


# ---- SSP --------------------------------------------------------------------------------------

def ssp_push(log, worker, group="g"):
    return log("push", client=worker, tensors={"w": np.ones(4, F32)}, ssp={"ssp_group": group, "worker": worker})


def test_ssp_bound_rejects_the_fast_worker_until_the_slowest_catches_up():
    log = Log()
    make(log)
    for w in ("a", "b"):
        assert log("ssp_join", client=w, ssp_group="g", worker=w, staleness=1)["clock"] == 0
    assert ssp_push(log, "a")["clock"] == 1
    assert ssp_push(log, "a")["clock"] == 2                      # 1 ahead: allowed
    r = ssp_push(log, "a")                                       # 2 ahead of b: refused
    assert r["error"] == "StalenessBound" and log.store.tensors["w"].version == 2
    ssp_push(log, "b")
    assert ssp_push(log, "a")["clock"] == 3


def test_ssp_zero_is_bsp_and_leave_and_drop_unblock_the_others():
    log = Log()
    make(log)
    for w in ("a", "b", "c"):
        log("ssp_join", client=w, ssp_group="g", worker=w, staleness=0)
    ssp_push(log, "a")
    assert ssp_push(log, "a")["error"] == "StalenessBound"
    log("ssp_leave", client="b", ssp_group="g", worker="b")
    assert log("ssp_drop", client="a", ssp_group="g", worker="c", clock=5)["dropped"] is False   # clock moved/wrong
    assert log("ssp_drop", client="a", ssp_group="g", worker="c", clock=0)["dropped"] is True
    assert ssp_push(log, "a")["clock"] == 2
    assert ssp_push(log, "c")["error"] == "NotInGroup"
    assert log("ssp_join", client="c", ssp_group="g", worker="c", staleness=0)["clock"] == 2   # rejoins at the slowest
    assert log("ssp_join", client="d", ssp_group="g", worker="d", staleness=3)["error"] == "InvalidRequest"


def test_ssp_unbounded_is_asp_and_state_is_in_snapshots():
    log = Log()
    make(log)
    log("ssp_join", client="a", ssp_group="g", worker="a", staleness=None)
    log("ssp_join", client="b", ssp_group="g", worker="b", staleness=None)
    for _ in range(10):
        ssp_push(log, "a")
    restored = TensorStore()
    restored.restore(codec.decode(codec.encode_bytes(log.store.snapshot())))
    assert restored.ssp_state("g") == {"staleness": None, "clocks": {"a": 10, "b": 0}}
    assert restored.digest() == log.store.digest()


def test_mixed_log_is_deterministic():
    def feed():
        log = Log()
        make(log, name="w", spec={"name": "adam", "lr": 0.01, "staleness_aware": True})
        make(log, name="v", spec={"name": "adarevision", "lr": 0.1, "window": 3})
        log("ssp_join", client="a", ssp_group="g", worker="a", staleness=2)
        rng = np.random.default_rng(7)
        topk = compress.TopK(0.25)
        for i in range(30):
            g = {"w": rng.standard_normal(4).astype(F32), "v": rng.standard_normal(4).astype(F32)}
            kind = ("none", "fp16", "topk")[i % 3]
            tensors, enc = compress.encode_push(g, kind, topk)
            fields = {"encoding": enc} if enc else {}
            log("push", client="a", tensors=tensors, base_version=max(0, log.index - i % 4),
                ssp={"ssp_group": "g", "worker": "a"}, **fields)
        return log.store
    a, b = feed(), feed()
    assert a.digest() == b.digest() and a.tensors["v"].version == 30
