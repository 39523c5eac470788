"""DistributedOptimizer(mode="diloco"): any torch optimizer is the inner one, the outer step is
the store's, against a real 3-node cluster; compared with DiLoCo computed by hand in one process."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import raftps.torch as rpt  # noqa: E402
from raftps import jobs  # noqa: E402

from tests.conftest import start_cluster  # noqa: E402
from tests.pytorch.ranks import run_ranks  # noqa: E402
from tests.pytorch.compare import max_diff  # noqa: E402
from tests.pytorch.test_torch_native import Net, batches  # noqa: E402

BASE_PORT = 23500
H, ROUNDS, WORLD = 3, 2, 2
OUTER = {"name": "momentum", "lr": 0.7, "momentum": 0.9, "nesterov": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("tdiloco") / "run", BASE_PORT)
    yield cl
    cl.wipe()


def inner(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def loss_step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def by_hand(data) -> torch.nn.Module:
    """DiLoCo in one process: each rank runs its own AdamW (kept across rounds) from the global
    parameters on its half of each batch for H steps; the outer Nesterov step on the mean of
    (global - local), as the store's momentum optimizer computes it."""
    glob = Net()
    ranks = [copy.deepcopy(glob) for _ in range(WORLD)]
    opts = [inner(m) for m in ranks]
    velocity = {n: torch.zeros_like(p) for n, p in glob.named_parameters()}
    for r in range(ROUNDS):
        for rank, (m, o) in enumerate(zip(ranks, opts)):
            for x, y in data[r * H:(r + 1) * H]:
                part = slice(rank * len(x) // WORLD, (rank + 1) * len(x) // WORLD)
                loss_step(m, o, x[part], y[part])
        with torch.no_grad():
            for n, p in glob.named_parameters():
                mean = sum(p - dict(m.named_parameters())[n] for m in ranks) / WORLD
                velocity[n] = 0.9 * velocity[n] + mean
                p -= 0.7 * (mean + 0.9 * velocity[n])
            for m in ranks:
                m.load_state_dict(glob.state_dict())
    return glob


def test_diloco_rounds_equal_diloco_by_hand_and_restart_at_the_stores_round(cluster):
    data = batches(ROUNDS * H, seed=21)
    want = by_hand(data)
    models = [Net() for _ in range(WORLD)]
    sent, synced = {}, {}

    def body(rank: int) -> None:
        model = models[rank]
        with rpt.DistributedOptimizer(inner(model), model=model, cluster=cluster.client(), mode="diloco",
                                      sync_every=H, outer=OUTER, prefix="tdiloco", rank=rank,
                                      world_size=WORLD) as opt:
            assert isinstance(opt, torch.optim.AdamW) and opt.start_step == 0
            for x, y in data[opt.start_step:]:
                part = slice(rank * len(x) // WORLD, (rank + 1) * len(x) // WORLD)
                loss_step(model, opt, x[part], y[part])
                synced.setdefault(rank, []).extend((r.round, r.count, r.late) for r in opt.synced)
            sent[rank] = opt.bytes_sent
    run_ranks(WORLD, body)
    for model in models:
        assert max_diff(model, want) < 1e-5, max_diff(model, want)
    assert max_diff(want, Net()) > 1e-3
    params = sum(p.numel() * 4 for p in Net().parameters())
    assert sent == {0: ROUNDS * params, 1: ROUNDS * params}      # one pseudo-gradient per round, nothing else
    # every round acknowledged to each rank, in order, with both contributions
    assert synced == {r: [(n, WORLD, False) for n in range(ROUNDS)] for r in range(WORLD)}
    with cluster.client() as c:
        assert c.sync_applied(jobs.diloco_job("tdiloco", 0, 1)) == ROUNDS - 1     # rounds 0..ROUNDS-1 applied
        versions = c.export("tdiloco/")["tensor_versions"]
        assert set(versions.values()) == {ROUNDS}                  # each global tensor: one update per round
    # a restarted rank resumes at the store's round, from the global parameters
    fresh = Net(seed=5)
    with rpt.DistributedOptimizer(torch.optim.RMSprop(fresh.parameters(), lr=1e-3), model=fresh,
                                  cluster=cluster.client(), mode="diloco", sync_every=H, outer=OUTER,
                                  prefix="tdiloco", rank=1, world_size=WORLD) as opt:
        assert opt.start_step == ROUNDS * H and isinstance(opt, torch.optim.RMSprop)
        assert max_diff(fresh, want) < 1e-6


def test_diloco_bad_input_is_refused_before_any_io(cluster):
    model = Net()
    for options, message in (({"sync_every": 0}, "sync_every"), ({"fragments": 99}, "fragments=99"),
                             ({"outer": {"name": "momentum", "lr": -1.0}}, "lr"),
                             ({"outer": {"name": "rmsprop", "lr": 0.1}}, "unknown optimizer")):
        with pytest.raises(Exception, match=message):
            rpt.DistributedOptimizer(inner(model), model=model, cluster="127.0.0.1:1", mode="diloco", **options)
    with pytest.raises(ValueError, match="needs a torch optimizer"):
        rpt.DistributedOptimizer(model, cluster=cluster.client(), optimizer={"name": "sgd", "lr": 0.1}, mode="diloco")


def test_diloco_async_trains_without_waiting(cluster):
    data = batches(8, seed=23)
    model = Net()
    start = copy.deepcopy(model)
    with rpt.DistributedOptimizer(inner(model), model=model, cluster=cluster.client(), mode="diloco-async",
                                  sync_every=4, prefix="tdiloco-async", rank=0, world_size=2) as opt:
        for x, y in data:
            loss_step(model, opt, x, y)
        assert opt.bytes_sent == 2 * sum(p.numel() * 4 for p in model.parameters())
    with cluster.client() as c:
        stored, _ = c.pull([f"tdiloco-async/{n}" for n, _ in model.named_parameters()])
    for n, p in model.named_parameters():
        assert np.array_equal(stored[f"tdiloco-async/{n}"], p.detach().numpy())     # the model is the store's
    assert max_diff(model, start) > 1e-3


def test_a_subclass_with_its_own_step_runs_as_the_inner_optimizer(cluster):
    """Sync and async modes refuse an optimizer subclass whose step() is its own
    (test_torch_native.py); under diloco that step runs locally, every inner step."""
    calls = []

    class CountingAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            calls.append(1)
            return super().step(closure)

    model = Net()
    with rpt.DistributedOptimizer(CountingAdamW(model.parameters(), lr=1e-2), model=model, cluster=cluster.client(),
                                  mode="diloco", sync_every=2, prefix="tdiloco-subclass") as opt:
        for x, y in batches(4, seed=25):
            loss_step(model, opt, x, y)
        assert len(calls) == 4 and len(opt.synced) == 1
