"""DiLoCo with its outer step in the store (raftps/client/diloco.py), on one real 3-node cluster: a round
bit for bit against the outer formula, a rank SIGKILLed mid-round (a real worker process), the
store's leader SIGKILLed while it holds a round, asynchronous rounds, fragments, bad input, and
the trainer's --mode diloco. Each test uses its own prefix, so their round sequences are apart."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from raftps import Client, InvalidOptimizer, jobs
from raftps.client.diloco import DiLoCo, split_fragments
from tests.conftest import start_cluster, wait_converged

BASE_PORT = 22600          # raft 22601-22603, clients 22701-22703, data plane 22801-22803
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = np.float32
NESTEROV = {"name": "momentum", "lr": 0.7, "momentum": 0.9, "nesterov": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("diloco"), BASE_PORT)
    yield cl
    cl.wipe()           # stops every node it started, by PID, and deletes their data


def nesterov(param, velocity, grad, lr=0.7, momentum=0.9):
    """The outer step, transcribed from its definition: v <- mu v + g; p <- p - lr (g + mu v)."""
    velocity = F32(momentum) * velocity + grad
    return param - F32(lr) * (grad + F32(momentum) * velocity), velocity


def in_threads(*calls):
    """Run each call in its own thread at once; their results in order (re-raises a failure)."""
    results, errors = [None] * len(calls), []

    def run(i):
        try:
            results[i] = calls[i]()
        except BaseException as exc:     # reported below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90.0)
    if errors:
        raise errors[0]
    return results


def versions(client, prefix, names):
    reply = client.pull_result([jobs.tensor(prefix, n) for n in names])
    return {n: reply["tensor_versions"][jobs.tensor(prefix, n)] for n in names}


def test_one_round_of_two_ranks_is_the_outer_formula_on_the_mean(cluster):
    rng = np.random.default_rng(1)
    init = {"w": rng.standard_normal((4, 3)).astype(F32), "b": rng.standard_normal(3).astype(F32)}
    with cluster.client() as c0, cluster.client() as c1:
        ranks = [DiLoCo(c, "bits", init, rank=r, world_size=2, sync_every=2, step_timeout=20.0)
                 for r, c in enumerate((c0, c1))]
        assert ranks[0].create() == ["bits/b", "bits/w"] and ranks[1].create() == []
        starts = [d.resume() for d in ranks]
        assert [s for s, _ in starts] == [0, 0]
        want, velocity = dict(init), {k: np.zeros_like(v) for k, v in init.items()}
        for round_ in range(2):          # the second round has a velocity to carry
            local = [{k: v - rng.standard_normal(v.shape).astype(F32) * F32(0.01) for k, v in want.items()}
                     for _ in range(2)]
            assert ranks[0].after_inner_step(2 * round_, local[0]) is None      # mid-round: nothing sent
            got = in_threads(*(lambda d=d, p=p: d.after_inner_step(2 * round_ + 1, p) for d, p in zip(ranks, local)))
            for k in init:
                mean = ((want[k] - local[0][k]) + (want[k] - local[1][k])) / F32(2)
                want[k], velocity[k] = nesterov(want[k], velocity[k], mean)
                for answer in got:
                    assert answer[k].tobytes() == want[k].tobytes(), k
            assert [(r.round, r.count, r.late) for d in ranks for r in d.rounds] == [(round_, 2, False)] * 2
        pulled, _ = c0.pull(["bits/w", "bits/b"])
        assert all(pulled[f"bits/{k}"].tobytes() == want[k].tobytes() for k in init)
        assert c0.sync_applied(jobs.diloco_job("bits", 0, 1)) == 1
        assert versions(c0, "bits", init) == {"w": 2, "b": 2}


def one_round_of_two_ranks(cluster, prefix, init, rng, **options):
    """Two ranks' DiLoCo (H = 1) each send one round from ``init`` moved a little: (the ranks,
    their local values, their answers)."""
    with cluster.client() as c0, cluster.client() as c1:
        ranks = [DiLoCo(c, prefix, init, rank=r, world_size=2, sync_every=1, step_timeout=20.0, **options)
                 for r, c in enumerate((c0, c1))]
        ranks[0].create()
        for d in ranks:
            d.resume()
        local = [{k: v - rng.standard_normal(v.shape).astype(F32) * F32(0.01) for k, v in init.items()}
                 for _ in range(2)]
        got = in_threads(*(lambda d=d, p=p: d.after_inner_step(0, p) for d, p in zip(ranks, local)))
    return ranks, local, got


def test_an_fp16_round_is_the_outer_formula_on_the_mean_of_the_decoded_pseudo_gradients(cluster):
    from raftps.compress import encode_fp16
    rng = np.random.default_rng(2)
    init = {"w": rng.standard_normal((4, 3)).astype(F32), "b": rng.standard_normal(3).astype(F32)}
    ranks, local, got = one_round_of_two_ranks(cluster, "bits16", init, rng, compress="fp16")
    for k in init:
        decoded = []
        for p in local:
            values, enc = encode_fp16(init[k] - p[k])
            decoded.append(values.astype(F32) / F32(enc["scale"]))
        want, _ = nesterov(init[k], np.zeros_like(init[k]), (decoded[0] + decoded[1]) / F32(2))
        for answer in got:
            assert answer[k].tobytes() == want.tobytes(), k
    params = sum(a.size for a in init.values())
    assert [d.bytes_sent for d in ranks] == [2 * params, 2 * params]      # float16: half of float32's


def read_log(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_a_rank_killed_mid_round_is_left_out_and_resumes_at_the_stores_round(cluster, tmp_path):
    h, rounds, timeout = 4, 4, 6.0     # round 1 waits 6 s for the killed rank, then leaves it out
    group = jobs.diloco_job("killrank", 0, 1)
    logs = [str(tmp_path / f"rank{r}.log") for r in range(3)]
    env = {**os.environ, **cluster.client_env}

    def start(rank):
        return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "diloco_worker.py"), cluster.addresses,
                                 "killrank", str(rank), "3", str(h), str(rounds), "0.1", str(timeout), logs[rank]],
                                cwd=ROOT, env=env)
    procs = [start(r) for r in range(3)]
    try:
        wait_until(lambda: any(e.get("round") == 0 for e in read_log(logs[2])), 60, "rank 2's first round")
        procs[2].send_signal(signal.SIGKILL)     # 4 inner steps of 0.1 s before its next round's end
        procs[2].wait(10)
        with cluster.client() as c:
            wait_until(lambda: c.sync_applied(group) >= 1, 60, "round 1 applied without rank 2")
            procs[2] = start(2)
            for p in procs:
                assert p.wait(90) == 0
            assert c.sync_applied(group) == rounds - 1            # every round applied, once each
            assert versions(c, "killrank", ["w", "b"]) == {"w": rounds, "b": rounds}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    survivor = [(e["round"], e["count"]) for e in read_log(logs[0]) if "round" in e]
    # Round 1 left rank 2 out after its timeout, so the store knows it absent: round 2 goes out
    # once ranks 0 and 1 are in, with rank 2's contribution if it came first, else rank 2's is
    # answered late; either way it is present again and round 3 waits for it.
    assert survivor[:2] == [(0, 3), (1, 2)] and survivor[3:] == [(3, 3)] and survivor[2] in ((2, 2), (2, 3)), survivor
    restarted = read_log(logs[2])
    assert [e["start"] for e in restarted if "start" in e] == [0, 2 * h]      # resumed at round 2
    assert [(e["round"], e["late"]) for e in restarted if "round" in e] == [(0, False), (2, survivor[2][1] == 2),
                                                                            (3, False)], restarted


def test_a_late_rank_loses_its_round_and_rejoins_at_the_stores_next(cluster):
    init = {"w": np.zeros(3, F32)}
    with cluster.client() as c0, cluster.client() as c1:
        ranks = [DiLoCo(c, "late", init, rank=r, world_size=2, sync_every=1, step_timeout=0.3,
                        outer={"name": "sgd", "lr": 1.0}) for r, c in enumerate((c0, c1))]
        ranks[0].create()
        for d in ranks:
            d.resume()
        for step in (0, 1):             # two rounds applied without rank 1
            alone = ranks[0].after_inner_step(step, {"w": np.full(3, step + 1.0, F32)})
            assert ranks[0].rounds[0].count == 1 and alone["w"].tolist() == [step + 1.0] * 3
        lost = ranks[1].after_inner_step(0, {"w": np.full(3, 5.0, F32)})
        assert ranks[1].rounds[0].late and lost["w"].tolist() == [2.0] * 3     # its work is not applied
        assert ranks[1].next_round == [2]                                      # the store's next round
        both = in_threads(lambda: ranks[0].after_inner_step(2, {"w": np.full(3, 3.0, F32)}),
                          lambda: ranks[1].after_inner_step(1, {"w": np.full(3, 4.0, F32)}))
        assert [(d.rounds[0].round, d.rounds[0].count) for d in ranks] == [(2, 2), (2, 2)]
        assert both[0]["w"].tolist() == [3.5] * 3 and both[1]["w"].tolist() == [3.5] * 3
        assert versions(c0, "late", ["w"]) == {"w": 3}


def test_a_round_held_by_a_killed_leader_applies_once_with_every_rank(cluster):
    init = {"w": np.linspace(-1, 1, 50_000, dtype=F32)}
    locals_ = [{"w": init["w"] - F32(0.01) * (r + 1)} for r in range(2)]
    with cluster.client(timeout=60) as c0, cluster.client(timeout=60) as c1:
        ranks = [DiLoCo(c, "leaderkill", init, rank=r, world_size=2, sync_every=1, step_timeout=30.0)
                 for r, c in enumerate((c0, c1))]
        ranks[0].create()
        for d in ranks:
            d.resume()
        first: list = []
        held = threading.Thread(target=lambda: first.append(ranks[0].after_inner_step(0, locals_[0])))
        held.start()
        wait_until(lambda: any(row.get("open_steps") for row in c1.status()), 20, "the leader to hold the round")
        leader = cluster.leader()
        cluster.kill(leader)
        try:
            second = ranks[1].after_inner_step(0, locals_[1])
            held.join(90)
            assert first, "rank 0's round never returned"
            mean = ((init["w"] - locals_[0]["w"]) + (init["w"] - locals_[1]["w"])) / F32(2)
            want, _ = nesterov(init["w"], np.zeros_like(init["w"]), mean)
            assert first[0]["w"].tobytes() == want.tobytes() and second["w"].tobytes() == want.tobytes()
            assert [r.count for d in ranks for r in d.rounds] == [2, 2]
            assert c1.sync_applied(jobs.diloco_job("leaderkill", 0, 1)) == 0
            assert versions(c1, "leaderkill", ["w"]) == {"w": 1}      # applied once
        finally:
            cluster.start(timeout=60)
            wait_converged(c1, 3)


def test_asynchronous_rounds_apply_on_arrival_with_staleness_aware_lr(cluster):
    init = {"w": np.linspace(0, 1, 7, dtype=F32)}
    with cluster.client() as c:
        # the paper's outer step, named (asynchronous rounds default to averaging: diloco.ASYNC_DEFAULT_OUTER)
        assert DiLoCo(c, "async", init, asynchronous=True).outer["name"] == "sgd"
        ranks = [DiLoCo(c, "async", init, rank=r, world_size=3, sync_every=1, asynchronous=True, outer=NESTEROV)
                 for r in range(3)]
        assert ranks[0].outer["staleness_aware"] and ranks[0].push_scale == 2 / 3
        for d in ranks:
            d.create()
            assert d.resume()[0] == 0
        want, velocity = init["w"], np.zeros(7, F32)
        for r, d in enumerate(ranks):    # all three started from the same globals: staleness 0, 1, 2
            local = {"w": init["w"] - F32(0.05 * (r + 1))}
            got = d.after_inner_step(0, local)      # returns without waiting for the others
            grad = (init["w"] - local["w"]) * F32(2 / 3)
            want, velocity = nesterov(want, velocity, grad, lr=0.7 / max(1, r))
            assert got["w"].tobytes() == want.tobytes(), r
        again = DiLoCo(c, "async", init, rank=1, world_size=3, sync_every=1, asynchronous=True, outer=NESTEROV)
        start, params = again.resume()
        assert start == 1 and params["w"].tobytes() == want.tobytes()          # rank 1 did one round
        fp16 = DiLoCo(c, "async", init, rank=2, world_size=3, sync_every=1, asynchronous=True, compress="fp16",
                      outer=NESTEROV)
        fp16.resume()
        got = fp16.after_inner_step(1, {"w": params["w"] - F32(0.01)})
        assert fp16.rounds[0].bytes == 7 * 2 and np.all(np.isfinite(got["w"]))
        assert versions(c, "async", ["w"]) == {"w": 4}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_fragments_sync_their_own_tensors_at_their_own_offsets(cluster, asynchronous):
    init = {"a": np.ones(8, F32), "b": np.ones(4, F32), "c": np.ones(4, F32)}
    assert [list(r) for r in split_fragments([32, 16, 16], 2)] == [[0], [1, 2]]
    prefix = "fragasync" if asynchronous else "frag"
    with cluster.client() as c:
        d = DiLoCo(c, prefix, init, sync_every=4, fragments=2, asynchronous=asynchronous)
        assert d.fragments == [["a"], ["b", "c"]]
        d.create()
        start, params = d.resume()
        changed: dict[str, list[int]] = {n: [] for n in init}
        before = versions(c, prefix, init)
        for step in range(start, 12):
            params = {k: v * F32(0.9) for k, v in params.items()}
            new = d.after_inner_step(step, params)
            if new is not None:
                assert sorted(new) in (["a"], ["b", "c"])
                params.update(new)
            now = versions(c, prefix, init)
            for n in init:
                if now[n] != before[n]:
                    changed[n].append(step + 1)       # inner steps taken when it changed
            before = now
        assert changed == {"a": [4, 8, 12], "b": [6, 10], "c": [6, 10]}
        if not asynchronous:
            assert [c.sync_applied(jobs.diloco_job(prefix, f, 2)) for f in (0, 1)] == [2, 1]
        else:           # each rank's own round counters, per fragment
            assert c.pull([jobs.diloco_rounds(prefix, 0, 2)])[0][jobs.diloco_rounds(prefix, 0, 2)].tolist() == [3, 2]
        assert DiLoCo(c, prefix, init, sync_every=4, fragments=2, asynchronous=asynchronous).resume()[0] == 12


def test_warmup_rounds_are_one_step_then_rounds_of_h_at_their_offsets():
    """The schedule alone (no I/O: nothing listens at the address): 3 warm-up rounds of one step,
    then fragment 0 every 4 steps and fragment 1 at offset 2, counted from step 3."""
    init = {"a": np.ones(8, F32), "b": np.ones(8, F32)}
    with Client("127.0.0.1:9", timeout=0.5) as nowhere:
        d = DiLoCo(nowhere, "warm", init, sync_every=4, fragments=2, warmup=3)
        ends = {f: [step + 1 for step in range(20) if f in d.due(step)] for f in (0, 1)}
        assert ends == {0: [1, 2, 3, 7, 11, 15, 19], 1: [1, 2, 3, 9, 13, 17]}
        # a rank resuming before round r of a fragment starts where that round starts
        assert [d.round_start(0, r) for r in range(6)] == [0, 1, 2, 3, 7, 11]
        assert [d.round_start(1, r) for r in range(6)] == [0, 1, 2, 3, 9, 13]
        plain = DiLoCo(nowhere, "warm", init, sync_every=4, fragments=2)
        assert [s + 1 for s in range(12) if plain.due(s)] == [4, 6, 8, 10, 12]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"sync_every": 0}, ValueError, "sync_every"),
    ({"sync_every": 2.0}, ValueError, "sync_every"),
    ({"fragments": 0}, ValueError, "fragments"),
    ({"fragments": 3}, ValueError, "fragments=3 exceeds the 2 tensors"),
    ({"outer": {"name": "momentum"}}, InvalidOptimizer, "needs 'lr'"),
    ({"outer": {"name": "adam", "lr": -1.0}}, InvalidOptimizer, "lr must be > 0"),
    ({"outer": {"name": "elastic"}}, InvalidOptimizer, "cannot be 'elastic'"),
    ({"rank": 2, "world_size": 2}, ValueError, "rank"),
    ({"compress": "topk:0.1"}, ValueError, "compress must be None, 'fp16' or 'int8'"),
    ({"overlap": 1}, ValueError, "overlap must be True or False"),
    ({"step_timeout": float("nan")}, ValueError, "step_timeout"),
    ({"warmup": -1}, ValueError, "warmup"),
    ({"params": {"w": np.zeros(3, np.int64), "b": np.zeros(1, F32)}}, ValueError, "float32 or float64"),
])
def test_bad_input_is_refused_before_any_io(cluster, kwargs, error, match):
    args = {"params": {"w": np.zeros(3, F32), "b": np.zeros(1, F32)}, **kwargs}
    with cluster.client() as c:
        version = c.status()[0]["version"]
        with pytest.raises(error, match=match):
            DiLoCo(c, "bad", **args)
        assert c.status()[0]["version"] == version and c.tensors("bad/") == []
    # nothing listens here: a constructor that sent anything would fail otherwise, and later
    with Client("127.0.0.1:9", timeout=0.5) as nowhere:
        with pytest.raises(error, match=match):
            DiLoCo(nowhere, "bad", **args)


def test_trainer_mode_diloco_trains_the_mlp(cluster, tmp_path):
    from tests.trainer.trainer_helpers import metric_rows, run_trainer
    out = str(tmp_path / "diloco")
    summary = run_trainer(["--cluster", cluster.addresses, "--mode", "diloco", "--workers", "2", "--model", "mlp",
                           "--hidden", "64", "--steps", "40", "--sync-every", "5", "--seed", "3",
                           "--prefix", "trainer"], out, env=cluster.client_env)
    losses = [float(r["test_loss"]) for r in metric_rows(out)]
    assert summary["updates"] == 8 and summary["worker_restarts"] == 0 and summary["sync_short_steps"] == 0
    assert losses[-1] < 0.5 * losses[0] and summary["final_test_acc"] > 0.8, (losses, summary["final_test_acc"])
