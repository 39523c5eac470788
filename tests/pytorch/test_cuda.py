"""A model on a GPU trains against the store (gradients staged through pinned host buffers,
pulled values copied back without blocking per tensor) exactly as the same model on the CPU,
in sync mode and with a sparse embedding in async mode (pushed and pulled by rows).
Skipped, with its reason, where no CUDA device is present."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine (torch.cuda.is_available() is False)", allow_module_level=True)

import raftps.torch as rpt  # noqa: E402

from tests.conftest import start_cluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("cuda") / "run", 23400)
    yield cl
    cl.wipe()


def test_gpu_model_trains_as_the_cpu_model(cluster):
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    gpu = copy.deepcopy(cpu).cuda()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(10)]
    for prefix, model in (("cuda-cpu", cpu), ("cuda-gpu", gpu)):
        device = next(model.parameters()).device
        with rpt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model,
                                      cluster=cluster.client(), mode="sync", prefix=prefix) as opt:
            for x, y in data:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
                opt.step()
    for p, q in zip(cpu.parameters(), gpu.parameters()):
        assert q.is_cuda and (p - q.cpu()).abs().max().item() < 1e-5


def test_gpu_sparse_embedding_async_equals_torch_sgd(cluster):
    """A sparse embedding on the GPU in async mode: its CUDA row indices go to the host for the
    push, and the rows pulled back go onto the GPU table (test_adapter.py runs this on the CPU)."""
    from tests.pytorch.test_adapter import train_sparse_async
    got, want = train_sparse_async(cluster, "cuda", "cuda-sparse")
    assert got.emb.weight.is_cuda
    for p, q in zip(got.parameters(), want.parameters()):
        assert (p.detach().cpu() - q).abs().max().item() < 1e-6
