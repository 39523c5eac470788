"""Hand-written backward passes against central finite differences (float64), and the data schedules."""
import numpy as np
import pytest

from trainer.data import async_batch, async_shard, global_batch, load_dataset, steps_per_epoch, sync_shard
from trainer.networks import MLP, Softmax, make_model


def numeric_grad(model, params, x, y, name, eps=1e-6, samples=20, seed=0):
    """Central differences at a few random coordinates of params[name]."""
    rng = np.random.default_rng(seed)
    flat = params[name].reshape(-1)
    out = {}
    for i in rng.choice(flat.size, size=min(samples, flat.size), replace=False):
        old = flat[i]
        flat[i] = old + eps
        up = model.loss(params, x, y)
        flat[i] = old - eps
        down = model.loss(params, x, y)
        flat[i] = old
        out[int(i)] = (up - down) / (2 * eps)
    return out


@pytest.mark.parametrize("model", [Softmax(12, 5), MLP(12, 5, hidden=(16,)), MLP(12, 5, hidden=(16, 8))])
def test_gradients_match_finite_differences(model):
    rng = np.random.default_rng(1)
    params = {k: v.astype(np.float64) for k, v in model.init(3).items()}
    for k in params:          # non-zero biases so their gradient paths are exercised too
        params[k] += 0.1 * rng.standard_normal(params[k].shape)
    x = rng.standard_normal((32, 12))
    y = rng.integers(0, 5, 32)
    loss, grads = model.loss_and_grads(params, x, y)
    assert loss == pytest.approx(model.loss(params, x, y), rel=1e-12)
    assert model.loss_and_accuracy(params, x, y) == (model.loss(params, x, y), model.accuracy(params, x, y))
    assert set(grads) == set(params)
    for name in params:
        assert grads[name].shape == params[name].shape and grads[name].dtype == np.float64
        flat = grads[name].reshape(-1)
        for i, num in numeric_grad(model, params, x, y, name).items():
            assert flat[i] == pytest.approx(num, rel=1e-5, abs=1e-8), (name, i)


def test_float32_gradients_stay_float32():
    model = MLP(64, 10, hidden=(32,))
    params = model.init(0)
    x = np.random.default_rng(0).random((8, 64), dtype=np.float32)
    _, grads = model.loss_and_grads(params, x, np.arange(8))
    assert all(g.dtype == np.float32 for g in grads.values())


def test_default_mlp_is_about_a_million_parameters():
    model = make_model("mlp", 64, 10)
    assert 1_000_000 <= model.parameters() <= 1_200_000
    assert sum(v.size for v in model.init(0).values()) == model.parameters()


def test_init_is_deterministic():
    a, b = MLP(64, 10, (32,)).init(7), MLP(64, 10, (32,)).init(7)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_digits_split_is_fixed_and_disjoint():
    d1, d2 = load_dataset("digits"), load_dataset("digits")
    assert d1.x_train.shape == (1438, 64) and d1.x_test.shape == (359, 64) and d1.classes == 10
    assert np.array_equal(d1.x_test, d2.x_test) and d1.x_train.dtype == np.float32
    assert 0.0 <= d1.x_train.min() and d1.x_train.max() <= 1.0
    with pytest.raises(ValueError):
        load_dataset("imagenet")


def test_sync_shards_partition_the_global_batch():
    n, batch, workers = 1438, 64, 4
    for step in (0, 5, steps_per_epoch(n, batch) + 3):
        parts = [sync_shard(n, batch, step, 9, r, workers) for r in range(workers)]
        assert all(len(p) == batch // workers for p in parts)
        assert np.array_equal(np.concatenate(parts), global_batch(n, batch, step, 9))
    with pytest.raises(ValueError):
        sync_shard(n, 30, 0, 0, 0, 4)


def test_async_shards_cover_the_training_set_once():
    n, workers = 1438, 4
    shards = [async_shard(n, r, workers) for r in range(workers)]
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(n))
    one_epoch = np.concatenate([async_batch(shards[1], 32, s, 0, 1) for s in range(steps_per_epoch(len(shards[1]), 32))])
    assert len(set(one_epoch)) == len(one_epoch) and set(one_epoch) <= set(shards[1])
