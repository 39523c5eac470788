"""Row-sparse pushes and pull_rows on a real 3-node cluster."""
import numpy as np
import pytest

import raftps
from raftps.compress import encode_rows
from tests.conftest import wait_converged

BASE = 21030


def push_rows(c, rows, values) -> int:
    tensors, encoding = encode_rows("emb", np.asarray(rows), values)
    return c.push(tensors, encoding=encoding)


def test_sparse_push_and_pull_rows_through_the_cluster(make_cluster):
    cl = make_cluster(BASE)
    rng = np.random.default_rng(0)
    init = rng.standard_normal((10_000, 16)).astype(np.float32)
    with cl.client(timeout=20) as c:
        c.create("emb", init, {"name": "adagrad", "lr": 0.1})
        rows = rng.integers(0, 10_000, 300)                   # uncoalesced, like torch's
        values = rng.standard_normal((300, 16)).astype(np.float32)
        tensors, encoding = encode_rows("emb", rows, values)
        version = c.push(tensors, encoding=encoding)
        touched = np.unique(rows)
        got, v = c.pull_rows("emb", touched)
        assert v >= version and got.shape == (len(touched), 16)
        full, _ = c.pull(["emb"])
        assert np.array_equal(got, full["emb"][touched])
        untouched = np.setdiff1d(np.arange(10_000), touched)
        assert np.array_equal(full["emb"][untouched], init[untouched])
        assert not np.array_equal(got, init[touched])
        # after a full pull the next sparse push copies the table once; readers stay consistent
        v1 = push_rows(c, [0, 9_999], np.ones((2, 16), np.float32))
        got2, v2 = c.pull_rows("emb", [9_999, 0], min_version=v1, linearizable=False)   # any node
        assert v2 >= v1 and np.array_equal(got2, c.pull(["emb"])[0]["emb"][[9_999, 0]])
        assert not np.array_equal(got2[1], full["emb"][0])
        with pytest.raises(raftps.InvalidRequest, match=r"row index out of range \[0, 10000\)"):
            c.pull_rows("emb", [10_000])
        with pytest.raises(raftps.InvalidRequest, match="rows must be a 1-D int32 or int64 array, got float64"):
            c.pull_rows("emb", [1.5])
        with pytest.raises(raftps.UnknownTensor, match="unknown tensor 'nope'"):
            c.pull_rows("nope", [1])
        with pytest.raises(raftps.InvalidGradient, match="row index out of range"):
            push_rows(c, [10_000], np.ones((1, 16), np.float32))
        assert c.pull_rows("emb", [])[0].shape == (0, 16)
        wait_converged(c, 3)
