"""A job confined to its prefix by roles (rbac.py) trains through raftps.torch: every name the
adapter writes (parameters, step counters, the sync group) is under the prefix. An admin on the
prefix creates; a `write` identity trains what exists and is told why it cannot start a job."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import raftps.torch as rpt  # noqa: E402
from raftps import Client, PermissionDenied  # noqa: E402
from tests.conftest import start_cluster  # noqa: E402

TOKENS = {"ownerA": "owner-token-aaaaaaaa", "trainA": "train-token-aaaaaaaa"}
GRANTS = {"ownerA": [{"prefix": "jobA/", "role": "admin"}], "trainA": [{"prefix": "jobA/", "role": "write"}]}


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
    # A trainer with `write` on the prefix goes on from the store (it cannot create, and need not).
    with rpt.DistributedOptimizer(torch.nn.Linear(4, 1), cluster=as_(cluster, "trainA"),
                                  optimizer={"name": "sgd", "lr": 0.1}, mode=mode, prefix=f"jobA/{mode}") as opt:
        assert opt.start_step == 3
        opt.zero_grad()
        (opt.params[0].tensor.sum()).backward()
        opt.step()


def test_a_write_identity_cannot_start_a_new_job_and_is_told_why(cluster):
    with pytest.raises(PermissionDenied, match="a first run needs admin on 'jobA/new/'"):
        rpt.DistributedOptimizer(torch.nn.Linear(4, 1), cluster=as_(cluster, "trainA"), prefix="jobA/new")
    with pytest.raises(PermissionDenied, match="create: identity 'ownerA' has no admin role on tensor 'jobB/weight'"):
        rpt.DistributedOptimizer(torch.nn.Linear(4, 1), cluster=as_(cluster, "ownerA"), prefix="jobB")
