"""A job confined to its prefix by roles (rbac.py) trains through raftps.torch: every name the
adapter writes (parameters, step counters, the sync group) is under the prefix. `write` on the
prefix starts a job (creates its tensors) and goes on with one that exists; a `read` identity is
told why it cannot start one."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import raftps.torch as rpt  # noqa: E402
from raftps import Client, PermissionDenied  # noqa: E402
from tests.conftest import start_cluster  # noqa: E402

TOKENS = {"ownerA": "owner-token-aaaaaaaa", "trainA": "train-token-aaaaaaaa", "readA": "read-token-aaaaaaaaa"}
GRANTS = {"ownerA": [{"prefix": "jobA/", "role": "write"}], "trainA": [{"prefix": "jobA/", "role": "write"}],
          "readA": [{"prefix": "jobA/", "role": "read"}]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run = tmp_path_factory.mktemp("roles")
    auth = run / "identities.json"
    auth.write_text(json.dumps({"identities": [{"name": n, "token": TOKENS[n], "grants": GRANTS[n]}
                                               for n in TOKENS]}))
    cl = start_cluster(run / "cluster", 23800, extra_args=["--auth-file", str(auth)])
    yield cl
    cl.wipe()


def as_(cluster, who: str) -> Client:
    return Client(cluster.addresses, token=TOKENS[who], timeout=20, tls=False)


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_a_job_confined_to_its_prefix_trains(cluster, mode):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with rpt.DistributedOptimizer(model, cluster=as_(cluster, "ownerA"), optimizer={"name": "sgd", "lr": 0.1},
                                  mode=mode, prefix=f"jobA/{mode}") as opt:
        for _ in range(3):
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
    # Another trainer with `write` on the prefix goes on from the store.
    with rpt.DistributedOptimizer(torch.nn.Linear(4, 1), cluster=as_(cluster, "trainA"),
                                  optimizer={"name": "sgd", "lr": 0.1}, mode=mode, prefix=f"jobA/{mode}") as opt:
        assert opt.start_step == 3
        opt.zero_grad()
        (opt.params[0].tensor.sum()).backward()
        opt.step()


def test_a_read_identity_cannot_start_a_new_job_and_is_told_why(cluster):
    with as_(cluster, "readA") as c, pytest.raises(PermissionDenied, match="a first run needs write on 'jobA/new/'"):
        rpt.DistributedOptimizer(torch.nn.Linear(4, 1), cluster=c, prefix="jobA/new")
    with as_(cluster, "ownerA") as c, \
            pytest.raises(PermissionDenied, match="create: identity 'ownerA' has no write role on tensor 'jobB/weight'"):
        rpt.DistributedOptimizer(torch.nn.Linear(4, 1), cluster=c, prefix="jobB")
