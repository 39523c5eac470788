"""DiLoCo's int8 pseudo-gradients and its round overlapped with compute (raftps/client/diloco.py), on one
real 3-node cluster: an int8 round bit for bit against the outer formula on the mean of the
pseudo-gradients as decoded by an independent (torch) quantiser, at about 1/4 of float32's bytes;
bad int8 contributions refused by name, changing nothing; with ``overlap=True`` a rank takes
inner steps while its round waits for a late rank, applies x_g + (progress since the snapshot),
and ends on the store's bits, with every round applied exactly once."""
from __future__ import annotations

import time

import numpy as np
import pytest

from raftps import InvalidRequest, jobs
from raftps.client.diloco import DiLoCo
from tests.conftest import start_cluster
from tests.test_diloco import F32, nesterov, one_round_of_two_ranks, versions

torch = pytest.importorskip("torch")

BASE_PORT = 26800          # raft 26801-26803, clients 26901-26903, data plane 27001-27003
BLOCK = 256


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("diloco8"), BASE_PORT)
    yield cl
    cl.wipe()           # stops every node it started, by PID, and deletes their data


def int8_decoded(g: np.ndarray) -> np.ndarray:
    """Block-wise absmax int8 (blocks of 256 of the flattened tensor, scale = max|x| / 127 in
    float32, codes rounded half to even), quantised and dequantised with torch."""
    flat = torch.from_numpy(g.reshape(-1).copy())
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), BLOCK):
        block = flat[start:start + BLOCK]
        scale = block.abs().max() / torch.tensor(127.0)
        scale = torch.where(scale == 0, torch.tensor(1.0), scale)
        codes = torch.clamp(torch.round(block / scale), -127, 127).to(torch.int8)
        out[start:start + BLOCK] = codes.to(torch.float32) * scale
    return out.numpy().reshape(g.shape)


def test_an_int8_round_is_the_outer_formula_on_the_mean_of_the_decoded_pseudo_gradients(cluster):
    rng = np.random.default_rng(8)
    init = {"w": rng.standard_normal((30, 20)).astype(F32), "b": rng.standard_normal(3).astype(F32)}
    ranks, local, got = one_round_of_two_ranks(cluster, "bits8", init, rng, compress="int8")
    for k in init:
        decoded = [int8_decoded(init[k] - p[k]) for p in local]
        for p, d in zip(local, decoded):       # each within half the largest block step
            assert np.max(np.abs(d - (init[k] - p[k]))) <= np.max(np.abs(init[k] - p[k])) / 127 / 2 * 1.001
        want, _ = nesterov(init[k], np.zeros_like(init[k]), (decoded[0] + decoded[1]) / F32(2))
        for answer in got:
            assert answer[k].tobytes() == want.tobytes(), k
    # w: 600 codes + 3 scales, b: 3 codes + 1 scale (a scale: a float64), against 603 float32s
    assert [d.bytes_sent for d in ranks] == [600 + 3 * 8 + 3 + 8] * 2
    assert ranks[0].bytes_sent / (603 * 4) < 0.27             # about 1/4 (0.258 on large tensors)


def bad_encodings(codes, scales):
    def enc(**change):
        return {"kind": "int8", "block": BLOCK, "scales": scales, **change}
    return [
        (enc(), codes.astype(np.int32), "needs int8 values, got int32"),
        (enc(), codes.astype(np.float16), "needs int8 values, got float16"),
        (enc(), codes.reshape(-1), "int8 values of shape"),
        (enc(scales=scales[:2]), codes, "scales must be a list of 3"),
        (enc(scales=scales + [1.0]), codes, "scales must be a list of 3"),
        (enc(scales=np.array(scales, F32)), codes, "scales: expected a list"),
        (enc(scales=[scales]), codes, r"scales\[0\]: expected a finite number"),
        (enc(block=128), codes, "scales must be a list of 5"),            # a block count not the tensor's
        (enc(block=0), codes, "block: expected an int in"),
        (enc(block=256.0), codes, "block: expected an int in"),
        (enc(block=True), codes, "block: expected an int in"),
        (enc(scales=[1.0, float("nan"), 1.0]), codes, r"scales\[1\]: expected a finite number > 0"),
        (enc(scales=[1.0, float("inf"), 1.0]), codes, r"scales\[1\]: expected a finite number > 0"),
        (enc(scales=[1.0, 0.0, 1.0]), codes, r"scales\[1\]: expected a finite number > 0"),
        (enc(scales=[-1.0, 1.0, 1.0]), codes, r"scales\[0\]: expected a finite number > 0"),
        ({"kind": "int8", "block": BLOCK}, codes, "scales"),
    ]


def test_bad_int8_contributions_are_refused_by_name_and_change_nothing(cluster):
    from raftps.compress import encode_int8
    with cluster.client() as c:
        c.create("bad8/w", np.zeros((30, 20), F32), {"name": "sgd", "lr": 1.0})
        g = np.random.default_rng(3).standard_normal((30, 20)).astype(F32)
        codes, enc = encode_int8(g)
        for encoding, values, match in bad_encodings(codes, enc["scales"]):
            with pytest.raises(InvalidRequest, match=match):
                c.push_step({"bad8/w": values}, 0, 1, job="bad8", rank=0, timeout=5.0, encoding={"bad8/w": encoding})
            with pytest.raises(InvalidRequest, match=match):     # a plain push: decoded by the state machine
                c.push({"bad8/w": values}, encoding={"bad8/w": encoding})
        # a refused plain push may take a log index (the state machine refuses it), never the tensor
        assert c.sync_applied("bad8") == -1 and versions(c, "bad8", ["w"]) == {"w": 0}
        pulled, _ = c.pull(["bad8/w"])
        assert not np.any(pulled["bad8/w"])
        # the good one, pushed plainly: sgd lr 1 subtracts the decoded gradient
        c.push({"bad8/w": codes}, encoding={"bad8/w": enc})
        pulled, _ = c.pull(["bad8/w"])
        assert pulled["bad8/w"].tobytes() == (F32(0) - int8_decoded(g)).tobytes()


def wait_ready(d: DiLoCo, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not d.ready():
        assert time.monotonic() < deadline, f"no round answer within {seconds} s"
        time.sleep(0.02)


def test_overlap_takes_inner_steps_while_its_round_waits_and_applies_the_progress_made(cluster):
    h = 8
    rng = np.random.default_rng(9)
    init = {"w": rng.standard_normal((4, 3)).astype(F32), "b": rng.standard_normal(3).astype(F32)}

    def inner_step(p):
        return {k: v - rng.standard_normal(v.shape).astype(F32) * F32(0.01) for k, v in p.items()}
    with cluster.client() as c0, cluster.client() as c1, cluster.client() as watch:     # c0: the sender's
        early = DiLoCo(c0, "olap", init, rank=0, world_size=2, sync_every=h, step_timeout=30.0, overlap=True)
        late = DiLoCo(c1, "olap", init, rank=1, world_size=2, sync_every=h, step_timeout=30.0)
        early.create()
        late.create()
        early.resume()
        late.resume()
        try:
            mine, theirs = dict(init), dict(init)
            for step in range(h):                       # round 0: the early rank ends it and goes on
                mine = inner_step(mine)
                assert early.after_inner_step(step, mine) is None
            snapshot = mine
            for step in range(h, h + 3):                # three inner steps with its round in flight
                mine = inner_step(mine)
                assert early.after_inner_step(step, mine) is None and not early.ready()
            assert watch.sync_applied(jobs.diloco_job("olap", 0, 1)) == -1   # still waiting for rank 1
            for step in range(h):
                theirs = inner_step(theirs)
            got_late = late.after_inner_step(h - 1, theirs)                  # the round applies now
            x_g, velocity = {}, {}
            for k in init:
                mean = ((init[k] - snapshot[k]) + (init[k] - theirs[k])) / F32(2)
                x_g[k], velocity[k] = nesterov(init[k], np.zeros_like(init[k]), mean)
                assert got_late[k].tobytes() == x_g[k].tobytes()
            wait_ready(early, 20.0)
            mine = inner_step(mine)
            applied = early.after_inner_step(h + 3, mine)
            assert [(r.round, r.count, r.late) for r in early.rounds] == [(0, 2, False)]
            for k in init:      # the new global values plus the four inner steps taken since the snapshot
                assert applied[k].tobytes() == (x_g[k] + (mine[k] - snapshot[k])).tobytes(), k
            mine = applied
            for step in range(h + 4, 2 * h):            # round 1: ends on both ranks
                mine = inner_step(mine)
                assert early.after_inner_step(step, mine) is None
            theirs = got_late
            for step in range(h, 2 * h):
                theirs = inner_step(theirs)
            late.after_inner_step(2 * h - 1, theirs)
            final = early.finish(mine)                  # no inner step since: the store's bits
            pulled, _ = c0.pull(["olap/w", "olap/b"])
            for k in init:
                mean = ((x_g[k] - mine[k]) + (x_g[k] - theirs[k])) / F32(2)
                want, _ = nesterov(x_g[k], velocity[k], mean)
                assert final[k].tobytes() == want.tobytes() == pulled[f"olap/{k}"].tobytes(), k
            assert early.in_flight == {} and [r.round for r in early.rounds] == [1]
            assert c0.sync_applied(jobs.diloco_job("olap", 0, 1)) == 1        # rounds 0 and 1, once each
            assert versions(c0, "olap", init) == {"w": 2, "b": 2}
        finally:
            early.close()


def test_torch_overlap_ends_on_the_stores_parameters(cluster):
    import raftps.torch as rpt
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    x, y = torch.randn(12, 6), torch.randn(12, 2)
    with rpt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model,
                                  cluster=cluster.client(), mode="diloco", sync_every=2, overlap=True,
                                  prefix="tolap", rank=0, world_size=1) as opt:
        for _ in range(6):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    with cluster.client() as c:
        assert c.sync_applied(jobs.diloco_job("tolap", 0, 1)) == 2         # three rounds, none lost
        pulled, _ = c.pull(["tolap/weight", "tolap/bias"])
    assert model.weight.detach().numpy().tobytes() == pulled["tolap/weight"].tobytes()
    assert model.bias.detach().numpy().tobytes() == pulled["tolap/bias"].tobytes()
