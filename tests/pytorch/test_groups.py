"""raftps.torch over a cluster of three Raft groups: the model's tensors spread over the groups,
each rank counts its steps in every group, and a crash between the groups' parts of one push
(some groups applied it, others not) resumes without redoing or losing a step in any group."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import raftps.torch as rpt  # noqa: E402
from raftps import jobs  # noqa: E402
from raftps.tools.localcluster import LocalCluster  # noqa: E402

BASE_PORT = 29700


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = LocalCluster(str(tmp_path_factory.mktemp("torch-groups")), nodes=3, base_port=BASE_PORT, groups=3)
    cl.start(timeout=60.0)
    yield cl
    cl.stop()
    cl.drop_payloads()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 2))


def train(opt: rpt.DistributedOptimizer, net: torch.nn.Module, steps: int) -> None:
    g = torch.Generator().manual_seed(opt.start_step)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 2, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def counters(cluster: LocalCluster, prefix: str) -> dict[int, float]:
    with cluster.client() as c:
        names = {g: jobs.step_counter(prefix, 0, g, 3) for g in range(3)}
        tensors, _ = c.pull(list(names.values()))
    return {g: float(tensors[n][0]) for g, n in names.items()}


def test_async_steps_are_counted_in_every_group_and_resume_exactly(cluster) -> None:
    net = model()
    with rpt.DistributedOptimizer(net, cluster=cluster.client(), optimizer={"name": "sgd", "lr": 0.1},
                                  mode="async", prefix="tg", rank=0, world_size=1) as opt:
        assert sorted(opt.counters) == [0, 1, 2], "the model's six tensors should span all three groups"
        train(opt, net, 5)
    assert counters(cluster, "tg") == {0: 5.0, 1: 5.0, 2: 5.0}

    # A worker dies between the groups' parts of its 6th push: group 1 applied it, 0 and 2 did not.
    with cluster.client() as c:
        c.push({jobs.step_counter("tg", 0, 1, 3): np.array([1.0])})    # a counter adds what is pushed
        before, _ = c.pull([f"tg/{k}" for k, _ in net.named_parameters()])
    assert counters(cluster, "tg") == {0: 5.0, 1: 6.0, 2: 5.0}

    net2 = model()
    with rpt.DistributedOptimizer(net2, cluster=cluster.client(), optimizer={"name": "sgd", "lr": 0.1},
                                  mode="async", prefix="tg", rank=0, world_size=1) as opt:
        assert opt.start_step == 5                        # where every group is
        train(opt, net2, 1)                               # step 6: groups 0 and 2 only
        assert counters(cluster, "tg") == {0: 6.0, 1: 6.0, 2: 6.0}
        with cluster.client() as c:
            after, _ = c.pull(list(before))
        moved = {n: not np.array_equal(before[n], after[n]) for n in before}
        for n, changed in moved.items():
            assert changed == (opt.client.group_of(n) != 1), (n, changed)   # group 1 left out once
        train(opt, net2, 2)                               # then every group again
    assert counters(cluster, "tg") == {0: 8.0, 1: 8.0, 2: 8.0}
