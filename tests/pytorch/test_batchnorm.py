"""BatchNorm under sync mode: a CNN with BatchNorm2d and AdamW on a real 3-node cluster, K = 1
and K = 2 ranks, with and without clipping, against plain torch computed independently.

K = 1: parameters, running statistics, num_batches_tracked and AdamW's state equal one torch
process on the full batch (with torch.nn.utils.clip_grad_norm_ where the job clips). K = 2:
each rank trains on its half of the batch, as DDP with SyncBatchNorm off: the reference is two
torch copies of the model, one per half, whose gradients are averaged (then clipped by torch)
and whose running statistics are averaged after each step."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import raftps.torch as rpt  # noqa: E402

from tests.conftest import start_cluster  # noqa: E402
from tests.pytorch.compare import max_diff, state_diff  # noqa: E402
from tests.pytorch.ranks import run_ranks  # noqa: E402

BASE_PORT = 18100
STEPS = 10
BATCH = 16
CLIP = 0.5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("batchnorm") / "run", BASE_PORT)
    yield cl
    cl.wipe()


class Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # no bias ahead of BatchNorm (as torchvision's CNNs): its true gradient is 0, so AdamW turns
        # float rounding noise (~1e-9) into lr-sized steps. Measured in plain torch: scaling the
        # fc weight by 1 + 1.2e-7 at the start leaves that bias 4.3e-2 and running_mean 2.7e-2
        # apart after these 10 steps (everything else <= 3e-7 without the bias): the issue's
        # "parameters 1.6e-2 apart without clipping" is this, not the store
        self.conv, self.bn = torch.nn.Conv2d(1, 4, 3, bias=False), torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    # shifted and scaled inputs: the running statistics move far from their initial 0 and 1
    return [(torch.randn(BATCH, 1, 8, 8, generator=g) * 3 + 2, torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def loss_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    torch.nn.functional.cross_entropy(model(x), y).backward()


def reference(world: int, clip: bool) -> tuple[torch.nn.Module, dict]:
    """Plain torch: ``world`` copies of the model, one per part of each batch; the step takes the
    mean of their gradients (clipped by torch when ``clip``), the running statistics become the
    mean of the copies' (each copy counts its own batches, as each rank does)."""
    model = Cnn()
    opt = adamw(model)
    for x, y in data():
        replicas = [model] + [copy.deepcopy(model) for _ in range(world - 1)]
        opt.zero_grad()
        for r, replica in enumerate(replicas):
            part = slice(r * BATCH // world, (r + 1) * BATCH // world)
            loss_backward(replica, x[part], y[part])
        with torch.no_grad():
            for p, *others in zip(model.parameters(), *(m.parameters() for m in replicas[1:])):
                p.grad = (p.grad + sum(o.grad for o in others)) / world
            for name, b in model.named_buffers():
                if b.is_floating_point():
                    b.copy_(sum(dict(m.named_buffers())[name] for m in replicas) / world)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return model, opt.state_dict()


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("world", [1, 2])
def test_batchnorm_sync_equals_plain_torch(cluster, world, clip):
    want, want_state = reference(world, clip)
    assert (want.bn.running_mean - Cnn().bn.running_mean).abs().max() > 0.5     # the statistics moved
    models = [Cnn() for _ in range(world)]
    states: list[dict] = [{}] * world
    norms: list[float] = []

    def body(rank: int) -> None:
        model = models[rank]
        with rpt.DistributedOptimizer(adamw(model), model=model, cluster=cluster.client(), mode="sync",
                                      prefix=f"bn-{world}-{clip}", rank=rank, world_size=world) as opt:
            for x, y in data():
                part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
                opt.zero_grad()
                loss_backward(model, x[part], y[part])
                if clip:
                    opt.clip_grad_norm_(CLIP)
                opt.step()
                if rank == 0 and clip:
                    norms.append(opt.last_grad_norm)
            states[rank] = opt.state_dict()
    run_ranks(world, body)
    if clip:
        assert any(n > CLIP for n in norms), norms           # clipping acted
    for rank, model in enumerate(models):
        # parameters, running_mean, running_var, num_batches_tracked; AdamW's step, exp_avg, exp_avg_sq
        assert max_diff(model, want) < 2e-5, f"K={world} clip={clip} rank {rank}: {model.state_dict()}"
        assert state_diff(states[rank], want_state) < 2e-5, f"K={world} clip={clip} rank {rank}"
        assert model.bn.num_batches_tracked.item() == STEPS
