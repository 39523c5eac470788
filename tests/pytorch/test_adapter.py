"""raftps.torch.DistributedOptimizer against a real 3-node cluster (one per module, tests use
their own prefixes): parity of sync mode with torch.optim on one process, resume from the store
alone, dtypes, buffers, refusals."""
from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import raftps.torch as rpt  # noqa: E402
from raftps import InvalidOptimizer  # noqa: E402

from tests.conftest import start_cluster  # noqa: E402
from tests.pytorch.compare import max_diff, state_diff  # noqa: E402
from tests.pytorch.ranks import run_ranks  # noqa: E402

BASE_PORT = 23000
STEPS = 50


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("torch") / "run", BASE_PORT)
    yield cl
    cl.wipe()


def mlp(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(dtype)


def batches(steps: int, batch: int = 32, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 10, generator=g)
    y = torch.randint(0, 3, (256,), generator=g)
    out = []
    for s in range(steps):
        idx = torch.randint(0, 256, (batch,), generator=g)
        out.append((x[idx], y[idx]))
    return out


def loss_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def run_sync_workers(cluster, model: torch.nn.Module, spec: dict, prefix: str, data,
                     world: int = 2, **options) -> tuple[list, list[dict]]:
    """``world`` sync workers in threads, each on its 1/world of every batch; their models and
    their optimizers' state_dicts. ``options``: the optimizer's (chunk_bytes, ...)."""
    models = [copy.deepcopy(model) for _ in range(world)]
    states: list[dict] = [{}] * world

    def worker(rank: int) -> None:
        with rpt.DistributedOptimizer(models[rank], cluster=cluster.client(), optimizer=spec, mode="sync",
                                      prefix=prefix, rank=rank, world_size=world, **options) as opt:
            assert opt.start_step == 0
            for x, y in data:
                part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
                opt.zero_grad()
                loss_fn(models[rank], x[part], y[part]).backward()
                opt.step()
            states[rank] = opt.state_dict()
    run_ranks(world, worker, timeout=120)
    return models, states


@pytest.mark.parametrize("spec,reference", [
    ({"name": "sgd", "lr": 0.1}, lambda p: torch.optim.SGD(p, lr=0.1)),
    ({"name": "momentum", "lr": 0.05, "momentum": 0.9}, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    ({"name": "adam", "lr": 0.01}, lambda p: torch.optim.Adam(p, lr=0.01)),
], ids=["sgd", "momentum", "adam"])
def test_sync_two_workers_equal_one_process_with_torch_optim(cluster, spec, reference):
    model, data = mlp(), batches(STEPS)
    local = copy.deepcopy(model)
    opt = reference(local.parameters())
    for x, y in data:
        opt.zero_grad()
        loss_fn(local, x, y).backward()
        opt.step()
    workers, states = run_sync_workers(cluster, model, spec, f"parity-{spec['name']}", data)
    for name, p in local.named_parameters():
        for w in workers:
            diff = (dict(w.named_parameters())[name] - p).abs().max().item()
            assert diff < 1e-5, f"{spec['name']}: {name} differs by {diff} after {STEPS} steps"
    for state in states:                        # momentum's velocity, Adam's m, v and step: torch's
        assert state_diff(state, opt.state_dict()) < 1e-5, spec["name"]
    # Not trivially equal: the parameters moved.
    assert max((p - q).abs().max().item() for p, q in zip(local.parameters(), model.parameters())) > 1e-3


def test_sync_steps_in_chunks_leave_the_bits_of_whole_steps(cluster):
    """chunk_bytes=64: every tensor of the model a chunk of its own, each its own entry; the
    parameters end as the same job's in whole steps, bit for bit, and as torch's SGD. With
    pairs (the two ranks partners: their pair sum is the sum in rank order), the same bits."""
    model, data = mlp(), batches(STEPS)
    whole, _ = run_sync_workers(cluster, model, {"name": "sgd", "lr": 0.1}, "whole-steps", data)
    chunked, _ = run_sync_workers(cluster, model, {"name": "sgd", "lr": 0.1}, "chunked-steps", data, chunk_bytes=64)
    paired, _ = run_sync_workers(cluster, model, {"name": "sgd", "lr": 0.1}, "paired-steps", data, chunk_bytes=64,
                                 pairs=True)
    local = copy.deepcopy(model)
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        loss_fn(local, x, y).backward()
        opt.step()
    for name, p in local.named_parameters():
        assert torch.equal(dict(whole[0].named_parameters())[name], dict(chunked[0].named_parameters())[name]), name
        assert torch.equal(dict(whole[0].named_parameters())[name], dict(paired[1].named_parameters())[name]), name
        assert (dict(chunked[1].named_parameters())[name] - p).abs().max().item() < 1e-5, name


def test_resume_continues_parameters_and_optimizer_state_bit_for_bit(cluster):
    """20 steps, a new process's worth of objects (another random init), 20 more steps ==
    40 steps in one go, bit for bit: the store kept the parameters, Adam's m, v and step
    counts, and the step count."""
    spec, data = {"name": "adam", "lr": 0.01}, batches(40, seed=3)

    def train(model, prefix, part):
        with rpt.DistributedOptimizer(model, cluster=cluster.client(), optimizer=spec, prefix=prefix) as opt:
            start = opt.start_step
            for x, y in data[start:start + part]:
                opt.zero_grad()
                loss_fn(model, x, y).backward()
                opt.step()
            return start, opt.step_count

    whole = mlp(0)
    assert train(whole, "resume-a", 40) == (0, 40)
    first = mlp(0)
    assert train(first, "resume-b", 20) == (0, 20)
    second = mlp(7)                          # a different init: the store's values must win
    assert train(second, "resume-b", 20) == (20, 40)
    for (name, p), q in zip(whole.named_parameters(), second.parameters()):
        assert torch.equal(p, q), f"{name} differs after resuming"
    with cluster.client() as c:
        versions = {t["name"]: t["version"] for t in c.tensors()}
    assert versions["resume-b/0.weight"] == 40


def test_first_creator_wins_and_every_worker_starts_from_the_store(cluster):
    a, b = mlp(1), mlp(2)
    opt_a = rpt.DistributedOptimizer(a, cluster=cluster.client(), optimizer={"name": "sgd", "lr": 0.1}, prefix="init")
    opt_b = rpt.DistributedOptimizer(b, cluster=cluster.client(), optimizer={"name": "sgd", "lr": 0.1}, prefix="init",
                                     rank=1, world_size=2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(next(b.parameters()), next(mlp(1).parameters()))
    opt_a.close()
    opt_b.close()


def test_half_precision_parameters_are_kept_in_float32_and_cast_back(cluster):
    for dtype in (torch.float16, torch.bfloat16):
        model = mlp(0, dtype)
        with rpt.DistributedOptimizer(model, cluster=cluster.client(), optimizer={"name": "sgd", "lr": 0.5},
                                      prefix=f"half-{str(dtype)[6:]}") as opt:
            before = [p.detach().clone() for p in model.parameters()]
            x, y = batches(1)[0]
            opt.zero_grad()
            # the loss in float32, as autocast does: torch before 2.4 has no half cross_entropy on CPU
            torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y).backward()
            opt.step()
            assert all(p.dtype == dtype for p in model.parameters())
            assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
        with cluster.client() as c:
            dtypes = {t["dtype"] for t in c.tensors() if t["name"].startswith(f"half-{str(dtype)[6:]}/0.")}
        assert dtypes == {"float32"}


def test_batchnorm_running_stats_go_through_the_store_as_torch_keeps_them(cluster):
    """Async, one worker pulling every step: the running statistics (pushed as their drift, added
    by the store) and the parameters equal plain torch's SGD loop, and the store holds them; a
    fresh replica starts from the store's statistics. (Sync mode, K = 1 and 2: test_batchnorm.py.)"""
    def bn_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1))
    g = torch.Generator().manual_seed(6)
    data = [torch.randn(64, 4, generator=g) * 3 + 5 for _ in range(5)]

    def loop(model, opt):
        for x in data:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    want = bn_model()
    loop(want, torch.optim.SGD(want.parameters(), lr=0.01))
    model = bn_model()
    with rpt.DistributedOptimizer(model, cluster=cluster.client(), optimizer={"name": "sgd", "lr": 0.01},
                                  prefix="bn") as opt:
        loop(model, opt)
    assert max_diff(model, want) < 1e-5
    assert float(want[1].running_mean.abs().max()) > 0.1      # it moved from zeros
    with cluster.client() as c:
        stored, _ = c.pull(["bn/1.running_mean", "bn/1.running_var"])
    np.testing.assert_array_equal(stored["bn/1.running_mean"], model[1].running_mean.numpy())
    np.testing.assert_array_equal(stored["bn/1.running_var"], model[1].running_var.numpy())
    # A fresh replica starts from the store's running statistics.
    fresh = copy.deepcopy(model)
    fresh[1].reset_running_stats()
    rpt.DistributedOptimizer(fresh, cluster=cluster.client(), optimizer={"name": "sgd", "lr": 0.01}, prefix="bn").close()
    assert torch.equal(fresh[1].running_mean, model[1].running_mean)


def test_bad_arguments_are_refused_before_anything_is_created(cluster):
    model = mlp()
    with pytest.raises(ValueError, match="mode must be one of"):
        rpt.DistributedOptimizer(model, cluster=cluster.client(), mode="allreduce")
    with pytest.raises(ValueError, match="n_push must be an int >= 1"):
        rpt.DistributedOptimizer(model, cluster=cluster.client(), n_push=0)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, world_size=2\)"):
        rpt.DistributedOptimizer(model, cluster=cluster.client(), rank=2, world_size=2)
    with pytest.raises(InvalidOptimizer, match="unknown optimizer 'lamb'"):
        rpt.DistributedOptimizer(model, cluster=cluster.client(), optimizer={"name": "lamb", "lr": 1})
    with pytest.raises(TypeError, match="parameter '0.weight' has dtype torch.float8_e4m3fn"):
        rpt.DistributedOptimizer(torch.nn.Sequential(torch.nn.Linear(2, 2)).to(torch.float8_e4m3fn),
                                 cluster=cluster.client())
    with cluster.client() as c:
        assert not [t for t in c.tensors() if t["name"].startswith("job/")]


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(5000, 8, sparse=True)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, tokens):
        return self.out(self.emb(tokens).mean(1))


@pytest.mark.parametrize("spec", [{"name": "sgd", "lr": 0.5}, {"name": "adagrad", "lr": 0.5},
                                  {"name": "adam", "lr": 0.05}], ids=lambda s: s["name"])
def test_sparse_embedding_push_changes_exactly_the_rows_looked_up(cluster, spec):
    model = Bag()
    prefix = f"sparse-{spec['name']}"
    with rpt.DistributedOptimizer(model, cluster=cluster.client(), optimizer=spec, prefix=prefix) as opt:
        table = f"{prefix}/emb.weight"
        with cluster.client() as c:
            before, _ = c.pull([table])
        tokens = torch.tensor([[3, 7, 7, 42], [7, 4999, 3, 3]])
        opt.zero_grad()
        model(tokens).pow(2).mean().backward()
        assert model.emb.weight.grad.is_sparse
        opt.step()
        with cluster.client() as c:
            after, _ = c.pull([table])
        changed = np.flatnonzero(np.any(after[table] != before[table], axis=1))
        assert changed.tolist() == [3, 7, 42, 4999]
        # The replica holds the store's rows (pulled by rows, not the whole table).
        assert torch.equal(model.emb.weight, torch.from_numpy(after[table]))
        # A second worker starts from the store's table, not its own init.
        second = Bag()
        rpt.DistributedOptimizer(second, cluster=cluster.client(), optimizer=spec, prefix=prefix,
                                 rank=1, world_size=2).close()
        assert torch.equal(second.emb.weight, model.emb.weight)
        # pull_rows brings another writer's update of a row this replica did not touch.
        with cluster.client() as c:
            written = c.push({table: np.ones((1, 8), np.float32), f"{table}:indices": np.array([10], np.int32)},
                             encoding={table: {"kind": "rows"}})
            latest, _ = c.pull([table])
        assert not torch.equal(model.emb.weight[10], torch.from_numpy(latest[table][10]))
        # pull_rows reads any node (not linearizable; it waits only for this optimizer's own
        # pushes), so another writer's update shows once that node has applied it: bounded wait.
        deadline = time.monotonic() + 10.0
        while opt.pull_rows(model.emb.weight, [10]) < written and time.monotonic() < deadline:
            time.sleep(0.05)
        assert torch.equal(model.emb.weight[10], torch.from_numpy(latest[table][10]))


def train_sparse_async(cluster, device: str, prefix: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A sparse embedding on ``device`` trained 5 steps in async mode (pushed by rows, the touched
    rows pulled back by rows) and the same model trained by torch.optim.SGD on the CPU."""
    g = torch.Generator().manual_seed(4)
    data = [torch.randint(0, 5000, (4, 6), generator=g) for _ in range(5)]

    def loop(model: torch.nn.Module, opt: torch.optim.Optimizer, on: str) -> None:
        for tokens in data:
            opt.zero_grad()
            model(tokens.to(on)).pow(2).mean().backward()
            opt.step()
    want = Bag()
    loop(want, torch.optim.SGD(want.parameters(), lr=0.5), "cpu")
    got = Bag().to(device)
    with rpt.DistributedOptimizer(torch.optim.SGD(got.parameters(), lr=0.5), model=got, cluster=cluster.client(),
                                  mode="async", prefix=prefix) as opt:
        loop(got, opt, device)
    return got, want


def test_sparse_embedding_async_equals_torch_sgd(cluster):
    """The row-sparse push and the pull by rows (the path a GPU model takes too: test_cuda.py)
    train as torch.optim.SGD on the same sparse gradients."""
    got, want = train_sparse_async(cluster, "cpu", "sparse-vs-torch")
    assert (want.emb.weight - Bag().emb.weight).abs().max() > 1e-3        # it trained
    for p, q in zip(got.parameters(), want.parameters()):
        assert (p.detach().cpu() - q).abs().max().item() < 1e-6


def test_close_pushes_the_steps_not_pushed_yet(cluster):
    """Downpour with n_push 3: 5 steps are two pushes (3 + the 2 that close() flushes), and the
    step counter says 5, so a resumed worker neither loses nor repeats them."""
    model, data = mlp(), batches(5, seed=5)
    with rpt.DistributedOptimizer(model, cluster=cluster.client(), optimizer={"name": "sgd", "lr": 0.1},
                                  prefix="flush", n_push=3, n_fetch=3) as opt:
        for x, y in data:
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
    with cluster.client() as c:
        versions = {t["name"]: t["version"] for t in c.tensors()}
        steps, _ = c.pull(["flush/_raftps/steps.rank0"])
    assert versions["flush/0.weight"] == 2
    assert steps["flush/_raftps/steps.rank0"][0] == 5.0


@pytest.mark.parametrize("kwargs", [
    {"mode": "ssp", "ssp_staleness": 1},
    {"mode": "easgd", "n_push": 2},
    {"mode": "async", "compress": "fp16"},
    {"mode": "async", "compress": "topk:0.25"},
    {"mode": "async", "n_push": 2, "n_fetch": 2, "staleness_aware": True},
], ids=["ssp", "easgd", "fp16", "topk", "downpour"])
def test_every_async_mode_trains_two_workers(cluster, kwargs):
    """Two workers (threads) fit a linear target in each async mode: the loss falls 10x and
    the store applied every rank's counted steps."""
    torch.manual_seed(0)
    w_true = torch.randn(6, 1)
    prefix = "modes-" + "-".join(f"{k}{v}" for k, v in kwargs.items()).replace(":", "").replace(".", "")
    losses: dict[int, list[float]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = torch.nn.Linear(6, 1, bias=False)
            g = torch.Generator().manual_seed(rank)
            with rpt.DistributedOptimizer(model, cluster=cluster.client(), optimizer={"name": "sgd", "lr": 0.05},
                                          prefix=prefix, rank=rank, world_size=2, **kwargs) as opt:
                for _ in range(60):
                    x = torch.randn(32, 6, generator=g)
                    opt.zero_grad()
                    loss = (model(x) - x @ w_true).pow(2).mean()
                    loss.backward()
                    opt.step()
                    losses[rank].append(loss.item())
        except BaseException as exc:          # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    for rank in (0, 1):
        assert np.mean(losses[rank][-5:]) < np.mean(losses[rank][:5]) / 10, (rank, losses[rank][:5], losses[rank][-5:])
    with cluster.client() as c:
        steps, _ = c.pull([f"{prefix}/_raftps/steps.rank{r}" for r in range(2)])
    assert [float(v[0]) for v in steps.values()] == [60.0, 60.0]
