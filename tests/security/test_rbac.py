"""Named identities with roles over name prefixes (raftps.rbac), on a real 3-node cluster: each
refusal with its message and nothing changed; two jobs isolated on one cluster; the cluster token
still all-powerful; tokens rotated and revoked by editing the identity file (SIGHUP or mtime),
without a restart; a broken file keeps the old identities; no token in any log."""
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from raftps import AuthenticationFailed, Client, InvalidRequest, PermissionDenied, rbac
from security_helpers import assert_nothing_applied, raft_state, start, state

BASE = 26020
TOKENS = {name: secrets.token_hex(16) for name in ("jobA", "jobA-admin", "jobB", "eval", "evalA", "jobA2")}
GRANTS = {
    "jobA": [{"prefix": "jobA/", "role": "write"}],
    "jobA-admin": [{"prefix": "jobA/", "role": "admin"}],
    "jobB": [{"prefix": "jobB/", "role": "write"}],
    "eval": [{"prefix": "", "role": "read"}],
    "evalA": [{"prefix": "jobA/", "role": "read"}],
}


def write_identities(path: str, tokens: dict, grants: dict, hashed: tuple = ("eval",)) -> None:
    entries = []
    for name, g in grants.items():
        entry = {"name": name, "grants": g}
        if name in hashed:
            entry["token_sha256"] = rbac.token_digest(tokens[name]).hex()
        else:
            entry["token"] = tokens[name]
        entries.append(entry)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"identities": entries}, f)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def rbac_cluster(tmp_path_factory):
    run = tmp_path_factory.mktemp("rbac")
    auth_file = str(run / "identities.json")
    write_identities(auth_file, TOKENS, GRANTS)
    cluster = start(run / "cluster", BASE, extra_args=["--auth-file", auth_file])
    cluster.auth_file = auth_file
    with cluster.client(timeout=20) as admin:             # the cluster token: admin on every name
        for job in ("jobA", "jobB"):
            admin.create_many({f"{job}/w": np.zeros(4, np.float32), f"{job}/b": np.zeros(2, np.float32)},
                              {f"{job}/w": {"name": "sgd", "lr": 1.0}, f"{job}/b": {"name": "sgd", "lr": 1.0}})
        admin.create("shared", np.zeros(2, np.float32), {"name": "sgd", "lr": 1.0})
    yield cluster
    cluster.wipe()


def client(cluster, who: str, **kw) -> Client:
    return Client(cluster.addresses, token=TOKENS[who], timeout=kw.pop("timeout", 20), tls=False, **kw)


def versions(cluster) -> dict:
    with cluster.client(timeout=20) as c:
        return {t["name"]: t["version"] for t in c.tensors()}


REFUSALS = [   # (identity, call, message)
    ("jobA", lambda c: c.push({"jobB/w": np.ones(4, np.float32)}),
     "push: identity 'jobA' has no write role on tensor 'jobB/w'; it has write on 'jobA/'"),
    ("jobA", lambda c: c.push({"jobA/w": np.ones(4, np.float32), "jobB/w": np.ones(4, np.float32)}),
     "push: identity 'jobA' has no write role on tensor 'jobB/w'"),
    ("jobA", lambda c: c.create("jobB/new", np.zeros(2, np.float32), {"name": "sgd", "lr": 1.0}),
     "create: identity 'jobA' has no write role on tensor 'jobB/new'"),
    ("jobA", lambda c: c.create_many({"jobA/new": np.zeros(2, np.float32), "shared2": np.zeros(2, np.float32)},
                                     {"jobA/new": {"name": "sgd", "lr": 1.0}, "shared2": {"name": "sgd", "lr": 1.0}}),
     "create: identity 'jobA' has no write role on tensor 'shared2'"),
    ("jobA", lambda c: c.assign({"jobB/w": np.zeros(4, np.float32)}),
     "assign: identity 'jobA' has no write role on tensor 'jobB/w'"),
    ("evalA", lambda c: c.create("jobA/new", np.zeros(2, np.float32), {"name": "sgd", "lr": 1.0}),
     "create: identity 'evalA' has no write role on tensor 'jobA/new'; it has read on 'jobA/'"),
    ("jobA", lambda c: c.delete(["jobA/w"]), "delete: identity 'jobA' has no admin role on tensor 'jobA/w'"),
    ("jobA", lambda c: c.pull(["jobB/w"]), "pull: identity 'jobA' has no read role on tensor 'jobB/w'"),
    ("jobA", lambda c: c.pull_rows("jobB/w", [0]), "pull_rows: identity 'jobA' has no read role on tensor 'jobB/w'"),
    ("jobA", lambda c: c.push_sync({"jobA/w": np.ones(4, np.float32)}, 0, 1),
     "push_sync: identity 'jobA' has no write role on the default job (\"\")"),
    ("jobA", lambda c: c.push_sync({"jobA/w": np.ones(4, np.float32)}, 0, 1, job="jobB/sync"),
     "push_sync: identity 'jobA' has no write role on job 'jobB/sync'"),
    ("jobA", lambda c: c.close_step(0, job="jobB/sync"),
     "close_step: identity 'jobA' has no write role on job 'jobB/sync'"),
    ("jobA", lambda c: c.sync_applied(), "sync_applied: identity 'jobA' has no read role on the default job"),
    ("jobA", lambda c: c.wait_step(0, 0.1, job="jobB/sync"), "wait_step: identity 'jobA' has no read role on job 'jobB/sync'"),
    ("jobA", lambda c: c.ssp_join("jobB/ssp", "w0", 1), "ssp_join: identity 'jobA' has no write role on SSP group 'jobB/ssp'"),
    ("jobA", lambda c: c.ssp_drop("jobB/ssp", "w0", 0), "ssp_drop: identity 'jobA' has no write role on SSP group"),
    ("jobA", lambda c: c.ssp_leave("jobB/ssp", "w0"), "ssp_leave: identity 'jobA' has no write role on SSP group"),
    ("jobA", lambda c: c.ssp_wait("jobB/ssp", "w0", 0.1), "ssp_wait: identity 'jobA' has no read role on SSP group"),
    ("jobA", lambda c: c.push({"jobA/w": np.ones(4, np.float32)}, ssp={"ssp_group": "jobB/ssp", "worker": "w0"}),
     "push: identity 'jobA' has no write role on SSP group 'jobB/ssp'"),
    ("jobA-admin", lambda c: c.delete(["jobB/w"]), "delete: identity 'jobA-admin' has no admin role on tensor 'jobB/w'"),
    ("jobA-admin", lambda c: c.create("shared2", np.zeros(2, np.float32), {"name": "sgd", "lr": 1.0}),
     "create: identity 'jobA-admin' has no write role on tensor 'shared2'"),
    ("eval", lambda c: c.push({"jobA/w": np.ones(4, np.float32)}),
     "push: identity 'eval' has no write role on tensor 'jobA/w'; it has read on ''"),
    ("eval", lambda c: c.push_sync({"jobA/w": np.ones(4, np.float32)}, 0, 2, job="jobA/sync"),
     "push_sync: identity 'eval' has no write role on tensor 'jobA/w'"),
    ("evalA", lambda c: c.pull(["jobA/w", "shared"]), "pull: identity 'evalA' has no read role on tensor 'shared'"),
]


@pytest.mark.parametrize("who, call, message", REFUSALS, ids=[f"{r[0]}-{r[2].split(':')[0]}-{i}"
                                                              for i, r in enumerate(REFUSALS)])
def test_each_refusal_says_why_and_changes_nothing(rbac_cluster, who, call, message):
    before, raft_before = state(rbac_cluster), raft_state(rbac_cluster)
    with client(rbac_cluster, who, timeout=10) as c:
        with pytest.raises(PermissionDenied) as info:
            call(c)
    assert str(info.value).startswith(message), str(info.value)
    assert TOKENS[who] not in str(info.value)
    assert_nothing_applied(raft_before, raft_state(rbac_cluster))
    assert state(rbac_cluster) == before


def test_a_refused_write_does_not_spend_the_clients_session(rbac_cluster):
    """A write the node refuses before proposing it reaches no log: the client's next write reuses
    its seq, so a fresh client whose first writes were refused is not told SessionExpired."""
    with client(rbac_cluster, "jobA") as c:
        with pytest.raises(PermissionDenied):
            c.push({"jobB/w": np.ones(4, np.float32)})
        with pytest.raises(InvalidRequest):
            c.push({"jobA/w": np.ones(4, np.float32)}, ssp={"ssp_group": "jobA/ssp", "worker": ""})
        v = c.push({"jobA/w": np.zeros(4, np.float32)})
        assert c.push({"jobA/w": np.zeros(4, np.float32)}) > v and c._session._seqs[0] == 2


def test_the_schema_runs_before_the_roles(rbac_cluster):
    with client(rbac_cluster, "eval") as c, pytest.raises(InvalidRequest, match="push: tensors key 'a b'"):
        c.push({"a b": np.ones(2, np.float32)})


def test_two_jobs_share_a_cluster_each_under_its_prefix(rbac_cluster):
    """Job A and job B train at once, each with its own token, tensors and sync group; each sees and
    changes only its own prefix; the evaluator reads both; the cluster token still does anything."""
    with client(rbac_cluster, "jobA") as a, client(rbac_cluster, "jobB") as b, \
            client(rbac_cluster, "eval") as ev, client(rbac_cluster, "evalA") as eva:
        wa, wb = a.pull(["jobA/w"])[0]["jobA/w"], b.pull(["jobB/w"])[0]["jobB/w"]
        for step in range(3):
            a.push({"jobA/w": np.full(4, 1.0, np.float32)})
            b.push_sync({"jobB/w": np.full(4, 2.0, np.float32)}, step, 1, job="jobB/sync", rank=0)
        assert np.array_equal(a.pull(["jobA/w"])[0]["jobA/w"], wa - 3.0)
        assert np.array_equal(b.pull(["jobB/w"])[0]["jobB/w"], wb - 6.0)
        assert b.sync_applied("jobB/sync") == 2
        # an unnamed pull and the listing hold only what the token may read
        assert sorted(a.pull()[0]) == ["jobA/b", "jobA/w"]
        assert sorted(a.pull(linearizable=False)[0]) == ["jobA/b", "jobA/w"]
        assert [t["name"] for t in b.tensors()] == ["jobB/b", "jobB/w"]
        assert b.tensors(prefix="jobA/") == []
        assert [t["name"] for t in ev.tensors(prefix="jobA/")] == ["jobA/b", "jobA/w"]
        assert sorted(ev.pull()[0]) == ["jobA/b", "jobA/w", "jobB/b", "jobB/w", "shared"]
        assert sorted(eva.pull()[0]) == ["jobA/b", "jobA/w"]
        assert [r["role"] != "down" for r in a.status()] == [True] * 3 and "pushes" in ev.stats()
    with rbac_cluster.client(timeout=20) as admin:
        admin.push_sync({"shared": np.ones(2, np.float32)}, 0, 1)      # the default group: cluster token only
        assert admin.sync_applied() == 0
    env = {**os.environ, "RAFTPS_TOKEN": TOKENS["evalA"], "PYTHONPATH": os.getcwd()}
    env.pop("RAFTPS_TOKEN_FILE", None)
    out = subprocess.run([sys.executable, "-m", "raftps", "tensors", "--cluster", rbac_cluster.addresses,
                          "--prefix", "jobA/"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and [line.split("\t")[0] for line in out.stdout.splitlines()] == ["jobA/b", "jobA/w"], out


def _eventually(check, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while True:
        try:
            return check()
        except (AuthenticationFailed, PermissionDenied, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _on_every_node(cl, token: str, check) -> None:
    """``check(client)`` passes, eventually, through each node's own client port."""
    for n in (1, 2, 3):
        with Client([cl.client_address(n)], token=token, timeout=10, tls=False) as c:
            _eventually(lambda: check(c))


def test_rotate_and_revoke_without_a_restart(rbac_cluster):
    cl = rbac_cluster
    pids = [cl.pid(n) for n in (1, 2, 3)]
    old = client(cl, "jobA")
    assert old.pull(["jobA/w"])[0]["jobA/w"].shape == (4,)            # an open connection with the old token
    new_tokens = {**TOKENS, "jobA": secrets.token_hex(16)}
    grants = {k: v for k, v in GRANTS.items() if k != "eval"}          # eval revoked
    grants["jobA2"] = [{"prefix": "jobA/", "role": "read"}]             # a new identity
    write_identities(cl.auth_file, new_tokens, grants)
    for n in (1, 2, 3):
        cl.send_signal(n, signal.SIGHUP)
    with Client(cl.addresses, token=new_tokens["jobA"], timeout=10, tls=False) as c:
        _eventually(lambda: c.push({"jobA/w": np.ones(4, np.float32)}))
    # every node has reloaded (the signals reach them one by one)
    _on_every_node(cl, new_tokens["jobA"], lambda c: c.pull(["jobA/w"], linearizable=False))
    with pytest.raises(AuthenticationFailed, match="revoked or rotated"):
        old.pull(["jobA/w"])                                            # the open connection is refused
    old.close()
    with pytest.raises(AuthenticationFailed, match="wrong client token"):
        client(cl, "jobA", timeout=5).pull(["jobA/w"])                  # the old token, on a new connection
    with pytest.raises(AuthenticationFailed, match="wrong client token"):
        client(cl, "eval", timeout=5).pull(["jobA/w"])                  # revoked
    with client(cl, "jobA2") as c:
        assert sorted(c.pull()[0]) == ["jobA/b", "jobA/w"]
    # A grant changed with no signal: each node sees the new mtime within a second.
    grants["jobA2"] = [{"prefix": "jobA/", "role": "write"}]
    write_identities(cl.auth_file, new_tokens, grants)
    # each node checks roles itself (a follower before it redirects)
    _on_every_node(cl, new_tokens["jobA2"], lambda c: c.push({"jobA/b": np.ones(2, np.float32)}))
    # A broken file: every node keeps the identities it had, and says so without a token.
    with open(cl.auth_file, "w") as f:
        f.write('{"identities": [{"name": "x", "token": "' + "s" * 20 + '", "grants": [{"prefix": "", "role": "god"}]}]}')
    for n in (1, 2, 3):
        cl.send_signal(n, signal.SIGHUP)
    time.sleep(1.5)
    with client(cl, "jobA2") as c:
        c.push({"jobA/b": np.ones(2, np.float32)})
    assert [cl.pid(n) for n in (1, 2, 3)] == pids                      # nothing restarted
    logs = ""
    for n in (1, 2, 3):
        with open(cl.log_file(n), errors="replace") as f:
            logs += f.read()
    assert "identities not reloaded" in logs and "role: expected one of 'read', 'write', 'admin'" in logs
    for token in [*TOKENS.values(), *new_tokens.values(), cl.token, "s" * 20]:
        assert token not in logs
    write_identities(cl.auth_file, TOKENS, GRANTS)                      # as the other tests expect
    for n in (1, 2, 3):
        cl.send_signal(n, signal.SIGHUP)
    with client(cl, "eval") as c:
        _eventually(lambda: c.pull(["jobA/w"]))


def test_a_write_role_starts_seeds_and_trains_a_torch_job_under_its_prefix_only(rbac_cluster):
    """What a training job needs from `write` on its prefix: DistributedOptimizer creates the
    job's tensors, load_state_dict seeds them (assign_state) from a plain torch AdamW, and the
    job trains on as torch does; the same identity starting a job under another prefix is
    refused by name and changes nothing. (After the rotation test: jobB's grant never changed.)"""
    torch = pytest.importorskip("torch")
    import raftps.torch as rpt

    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]

    def train(model, opt, batches):
        for x, y in batches:
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
    torch.manual_seed(0)
    want = torch.nn.Linear(4, 1)
    want_opt = torch.optim.AdamW(want.parameters(), lr=0.05)
    train(want, want_opt, data[:2])
    model = torch.nn.Linear(4, 1)
    model.load_state_dict(want.state_dict())
    with client(rbac_cluster, "jobB") as c:
        with rpt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05), model=model, mode="sync",
                                      cluster=c, prefix="jobB/run") as opt:
            opt.load_state_dict(want_opt.state_dict())
            train(model, opt, data[2:])
        assert {t["name"] for t in c.tensors(prefix="jobB/run/")} >= {"jobB/run/weight", "jobB/run/bias"}
    train(want, want_opt, data[2:])
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), want.parameters())) < 1e-6
    before, raft_before = state(rbac_cluster), raft_state(rbac_cluster)
    other = torch.nn.Linear(4, 1)
    with client(rbac_cluster, "jobB") as c, \
            pytest.raises(PermissionDenied, match="create: identity 'jobB' has no write role on tensor 'jobA/run/"):
        rpt.DistributedOptimizer(torch.optim.AdamW(other.parameters()), model=other, mode="sync", cluster=c,
                                 prefix="jobA/run")
    assert_nothing_applied(raft_before, raft_state(rbac_cluster))
    assert state(rbac_cluster) == before


# ---- no cluster ------------------------------------------------------------------------------------

def test_every_served_op_has_a_role():
    from raftps import ops
    assert set(ops.REQUESTS) == set(rbac.NEEDS)
    assert {role for role, _ in rbac.NEEDS.values()} == {None, "read", "write", "admin"}


def test_an_op_without_an_entry_needs_admin_on_every_name():
    ident = rbac.Identity("jobA", b"x" * 32, (rbac.Grant("jobA/", "admin"),))
    with pytest.raises(PermissionDenied, match="frobnicate: identity 'jobA' needs admin on every name"):
        rbac.authorize(ident, {"op": "frobnicate"})
    rbac.authorize(rbac.OPEN, {"op": "frobnicate"})


def test_backups_and_membership_need_admin_on_every_name():
    ident = rbac.Identity("jobA", b"x" * 32, (rbac.Grant("jobA/", "admin"),))
    for op in ("snapshot", "member"):
        with pytest.raises(PermissionDenied, match=f"{op}: identity 'jobA' has no admin role on every name"):
            rbac.authorize(ident, {"op": op, "action": "list"})
    rbac.authorize(ident, {"op": "export", "prefix": "jobA/"})
    with pytest.raises(PermissionDenied, match="export: identity 'jobA' has no read role on tensor 'jobB/'"):
        rbac.authorize(ident, {"op": "export", "prefix": "jobB/"})


@pytest.mark.parametrize("text, words", [
    ("nope", "not JSON"),
    ('{"identities": [{"name": "a", "grants": []}]}', "give exactly one of token, token_sha256"),
    ('{"identities": [{"name": "a", "token": "short", "grants": []}]}', "identities[0].token: expected a token of 16"),
    ('{"identities": [{"name": "a", "token": "' + "t" * 16 + '", "grants": [{"prefix": "x", "role": "root"}]}]}',
     "identities[0].grants[0].role: expected one of 'read', 'write', 'admin', got a string 'root'"),
    ('{"identities": [{"name": "cluster", "token": "' + "t" * 16 + '", "grants": []}]}', "not 'cluster'"),
    ('{"identities": [{"name": "a", "token": "' + "t" * 16 + '", "grants": []}, '
     '{"name": "b", "token": "' + "t" * 16 + '", "grants": []}]}', "two identities share a token"),
    ('{"identities": [], "extra": 1}', "extra: unknown field (this map takes identities)"),
])
def test_a_bad_identity_file_is_refused_by_name(text, words):
    with pytest.raises(ValueError) as info:
        rbac.parse_identities(text, "ids.json")
    assert words in str(info.value) and "t" * 16 not in str(info.value), str(info.value)


def test_a_node_refuses_to_start_with_a_bad_identity_file(tmp_path):
    bad = tmp_path / "ids.json"
    bad.write_text('{"identities": [{"name": "a"}]}')
    out = subprocess.run([sys.executable, "-m", "raftps", "serve", "--id", "1", "--peers", f"127.0.0.1:{BASE + 50}",
                          "--data-dir", str(tmp_path / "d"), "--insecure", "--auth-file", str(bad)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 2 and "identities[0].grants: expected" in out.stderr, out.stderr
