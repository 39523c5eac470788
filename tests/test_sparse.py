"""Row-sparse pushes (compress "rows") in the pure state machine: exactly the pushed rows and
their optimizer state change, bit for bit; refusals change nothing; replicas stay identical
whatever reads happen between entries (the in-place / copy-on-read design of machine.py)."""
import numpy as np
import pytest

from raftps import codec
from raftps.compress import encode_rows
from raftps.errors import InvalidRequest
from raftps.store.machine import TensorStore
from tests.test_machine import Log

F32 = np.float32
ROWS, DIM = 50, 4
PUSHED = np.array([3, 7, 20, 49])


def table(log, spec, name="emb", seed=0):
    init = np.random.default_rng(seed).standard_normal((ROWS, DIM)).astype(F32)
    assert "error" not in log("create", tensors={name: init}, optimizer={name: spec})
    return init


def sparse_push(log, rows, values, name="emb", **fields):
    tensors, encoding = encode_rows(name, np.asarray(rows), np.asarray(values))
    return log("push", tensors=tensors, encoding=encoding, **fields)


def state_copy(store, name="emb"):
    t = store.tensors[name]
    return t.data.copy(), {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in t.state.items()}


def expected_rows(spec, p, g, state):
    """The dense formulas of optim.py written out again, on the pushed rows only."""
    lr = F32(spec["lr"])
    if spec["name"] == "sgd":
        g = g + F32(spec.get("weight_decay", 0.0)) * p if spec.get("weight_decay") else g
        return p - lr * g, {}
    if spec["name"] == "adagrad":
        acc = state["accumulator"] + g * g
        return p - lr * g / (np.sqrt(acc) + F32(1e-10)), {"accumulator": acc}
    b1, b2 = 0.9, 0.999
    m = F32(b1) * state["m"] + F32(1.0 - b1) * g
    v = F32(b2) * state["v"] + F32(1.0 - b2) * (g * g)
    b1t, b2t = state["beta1_t"] * b1, state["beta2_t"] * b2
    new = p - lr * (m / F32(1.0 - b1t)) / (np.sqrt(v / F32(1.0 - b2t)) + F32(1e-8))
    return new, {"m": m, "v": v, "beta1_t": b1t, "beta2_t": b2t}


@pytest.mark.parametrize("spec", [{"name": "sgd", "lr": 0.5}, {"name": "sgd", "lr": 0.5, "weight_decay": 0.1},
                                  {"name": "adagrad", "lr": 0.1}, {"name": "adam", "lr": 0.01}])
def test_sparse_push_changes_exactly_the_pushed_rows_and_their_state(spec):
    log = Log()
    table(log, spec)
    rng = np.random.default_rng(1)
    log("push", tensors={"emb": rng.standard_normal((ROWS, DIM)).astype(F32)})    # non-trivial state
    for _ in range(3):                                                            # and sparse after sparse
        data0, state0 = state_copy(log.store)
        grad = rng.standard_normal((len(PUSHED), DIM)).astype(F32)
        assert sparse_push(log, PUSHED, grad)["version"] == log.index
        t = log.store.tensors["emb"]
        want, want_state = expected_rows(spec, data0[PUSHED], grad, {k: v[PUSHED] if isinstance(v, np.ndarray) else v
                                                                     for k, v in state0.items()})
        assert np.array_equal(t.data[PUSHED], want)                      # bit for bit
        others = np.setdiff1d(np.arange(ROWS), PUSHED)
        assert np.array_equal(t.data[others], data0[others])
        for k, v in want_state.items():
            if isinstance(v, np.ndarray):
                assert np.array_equal(t.state[k][PUSHED], v) and np.array_equal(t.state[k][others], state0[k][others])
            else:
                assert t.state[k] == v                                   # Adam's beta^t: once per push
    assert t.version == 4


def test_momentum_rows_are_lazy():
    log = Log()
    table(log, {"name": "momentum", "lr": 0.1, "momentum": 0.9})
    sparse_push(log, [1], np.ones((1, DIM), F32))
    sparse_push(log, [2], np.ones((1, DIM), F32))
    vel = log.store.tensors["emb"].state["velocity"]
    assert np.array_equal(vel[1], np.ones(DIM)) and np.array_equal(vel[2], np.ones(DIM))   # row 1 not decayed
    assert not vel[[0, 3]].any()


def test_adam_rows_match_torch_sparse_adam():
    torch = pytest.importorskip("torch")
    log = Log()
    init = table(log, {"name": "adam", "lr": 0.01})
    emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init))
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    rng = np.random.default_rng(2)
    for _ in range(5):
        ids = torch.from_numpy(rng.integers(0, ROWS, 12))                # repeats: uncoalesced gradients
        opt.zero_grad()
        (emb(ids) * torch.from_numpy(rng.standard_normal((12, DIM)).astype(F32))).sum().backward()
        grad = emb.weight.grad                                           # uncoalesced sparse COO
        sparse_push(log, grad._indices()[0].numpy(), grad._values().numpy())
        opt.step()
    # Not bit-equal: SparseAdam updates m as m + (g - m)(1 - b1) and adds eps to sqrt(v) before
    # the bias correction (ours, like torch's dense Adam, to sqrt(v_hat)); both are O(1 ulp) or
    # O(eps) differences, far below a step (lr = 0.01).
    assert np.allclose(log.store.tensors["emb"].data, emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert not np.array_equal(log.store.tensors["emb"].data, init)


def test_encode_rows_sorts_and_sums_duplicate_rows():
    rows = np.array([9, 2, 9, 0, 2, 9])
    values = np.arange(6 * 3, dtype=F32).reshape(6, 3)
    tensors, encoding = encode_rows("e", rows, values)
    assert encoding == {"e": {"kind": "rows"}}
    dense = np.zeros((10, 3), F32)
    np.add.at(dense, rows, values)
    assert tensors["e:indices"].tolist() == [0, 2, 9] and tensors["e:indices"].dtype == np.int32
    assert np.array_equal(tensors["e"], dense[[0, 2, 9]])
    with pytest.raises(InvalidRequest, match="row indices must be a 1-D integer array"):
        encode_rows("e", np.array([0.5]), values[:1])
    with pytest.raises(InvalidRequest, match="2 row indices but values of shape"):
        encode_rows("e", np.array([0, 1]), values[:3])


GOOD = {"emb": np.ones((2, DIM), F32), "emb:indices": np.array([1, 5], np.int32)}
BAD = [
    (dict(GOOD, **{"emb:indices": np.array([1.0, 5.0])}), "InvalidRequest", "must be a 1-D int32 or int64 array, got float64"),
    (dict(GOOD, **{"emb:indices": np.array([5, 1], np.int32)}), "InvalidGradient", "strictly increasing"),
    (dict(GOOD, **{"emb:indices": np.array([1, 1], np.int32)}), "InvalidGradient", "strictly increasing"),
    (dict(GOOD, **{"emb:indices": np.array([-1, 5], np.int64)}), "InvalidGradient", "row index out of range [0, 50)"),
    (dict(GOOD, **{"emb:indices": np.array([1, 50], np.int64)}), "InvalidGradient", "row index out of range [0, 50)"),
    (dict(GOOD, emb=np.ones((2, DIM + 1), F32)), "InvalidRequest", "2 rows need values of shape (2, 4), got (2, 5)"),
    (dict(GOOD, emb=np.ones((3, DIM), F32)), "InvalidRequest", "2 rows need values of shape (2, 4), got (3, 4)"),
    (dict(GOOD, emb=np.ones((2, DIM), np.float64)), "InvalidRequest", "row values are float64, the tensor is float32"),
    (dict(GOOD, emb=np.full((2, DIM), np.nan, F32)), "InvalidGradient", "gradient has 8 NaN/Inf value(s)"),
    ({"emb": GOOD["emb"]}, "InvalidRequest", "rows encoding needs the row numbers in 'emb:indices'"),
]


@pytest.mark.parametrize("tensors, error, words", BAD)
def test_bad_sparse_push_is_refused_by_name_and_changes_nothing(tensors, error, words):
    log = Log()
    table(log, {"name": "adam", "lr": 0.1})
    log("create", tensors={"dense": np.zeros(3, F32)}, optimizer={"dense": {"name": "sgd", "lr": 1.0}})
    before = {n: (t.data.copy(), t.version, dict(t.state)) for n, t in log.store.tensors.items()}
    # a valid dense tensor in the same push: the push applies whole or not at all
    r = log("push", tensors={**tensors, "dense": np.ones(3, F32)}, encoding={"emb": {"kind": "rows"}})
    assert r["error"] == error and words in r["message"] and "'emb'" in r["message"], r
    for name, (data, version, state) in before.items():
        t = log.store.tensors[name]
        assert np.array_equal(t.data, data) and t.version == version and t.state == state


def test_optimizer_without_a_row_form_is_refused():
    log = Log()
    table(log, {"name": "adarevision", "lr": 0.1})
    r = sparse_push(log, [1], np.ones((1, DIM), F32))
    assert r["error"] == "InvalidRequest" and "optimizer 'adarevision' cannot apply a row-sparse push" in r["message"]


def test_same_log_same_digest_whatever_reads_happen_and_readers_keep_their_view():
    """Store a is read (pull, snapshot) between sparse pushes, which makes the next push copy;
    store b is never read, so it updates in place throughout. Same bits, and every reference a
    reader got still shows the state it read."""
    a, b = Log(), Log()
    held = []
    for log in (a, b):
        table(log, {"name": "adam", "lr": 0.01})
    rng = np.random.default_rng(3)
    for i in range(6):
        rows = np.sort(rng.choice(ROWS, 5, replace=False))
        grad = rng.standard_normal((5, DIM)).astype(F32)
        for log in (a, b):
            sparse_push(log, rows, grad)
        if i % 2:
            tensors, _ = a.store.read(["emb"])
            held.append((tensors["emb"], tensors["emb"].data.copy(), tensors["emb"].state["m"].copy()))
        if i == 3:
            snap = a.store.snapshot()
            held.append((None, snap, codec.encode_bytes(snap)))
        if i == 4:
            dense = rng.standard_normal((ROWS, DIM)).astype(F32)
            for log in (a, b):
                log("push", tensors={"emb": dense})                     # a dense push in between
    assert a.store.digest() == b.store.digest()
    for tensor, data, m in held:
        if tensor is None:
            assert codec.encode_bytes(data) == m                         # a snapshot message did not change
        else:
            assert np.array_equal(tensor.data, data) and np.array_equal(tensor.state["m"], m)
    restored = TensorStore()
    restored.restore(codec.decode(codec.encode_bytes(a.store.snapshot())))
    assert restored.digest() == a.store.digest()


def test_read_rows_copies_the_rows_and_refuses_bad_rows():
    log = Log()
    init = table(log, {"name": "sgd", "lr": 1.0})
    values, tensor_version, version = log.store.read_rows("emb", np.array([4, 0, 4], np.int64))
    assert np.array_equal(values, init[[4, 0, 4]]) and tensor_version == 0 and version == 1
    sparse_push(log, [4], np.ones((1, DIM), F32))                      # in place: the copy must not move
    assert np.array_equal(values, init[[4, 0, 4]])
    for rows, words in [(np.array([50]), "row index out of range [0, 50): min 50, max 50"),
                        (np.array([-1]), "row index out of range"),
                        (np.array([[1]]), "must be a 1-D int32 or int64 array"),
                        (np.array([1.0]), "got float64"), ([1], "got list")]:
        with pytest.raises(InvalidRequest, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            log.store.read_rows("emb", rows)
