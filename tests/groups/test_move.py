"""Moving a tensor to another Raft group online (``raftps move``, raftps/store/moves.py).

The state machine alone first (idempotent steps, typed errors, snapshots old and new), then real
node processes on 127.0.0.1: a move under push load (every acknowledged push applied exactly
once, Adam's state carried bit for bit), moves interrupted by a SIGKILLed mover and a SIGKILLed
source leader and run again, bad input, and a cluster of one group. Base ports 15000-15040
(a cluster at base B with G groups uses B+1.. B+303 + 400 g: bases 10 apart never collide)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from raftps import optim
from raftps.client.client import Client
from raftps.codec import Limits
from raftps.errors import InvalidRequest, LimitExceeded, Moved, RaftpsError, Unavailable, UnknownTensor
from tests.conftest import wait_converged
from raftps.tools.localcluster import LocalCluster, NodeExited
from raftps.store.machine import TensorStore

SGD = {"name": "sgd", "lr": 1.0}
ADAM = {"name": "adam", "lr": 0.01}
WORKTREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- the state machine alone -------------------------------------------------------------------------

class Writer:
    """Writes to several TensorStores as one client would (a seq per store)."""

    def __init__(self) -> None:
        self.seqs: dict[int, int] = {}

    def __call__(self, store: TensorStore, op: str, **fields) -> dict:
        seq = self.seqs[id(store)] = self.seqs.get(id(store), 0) + 1
        return store.apply(store.version + 1, {"op": op, "client": "mover", "seq": seq, **fields})


def install_fields(source: TensorStore, name: str, move: str) -> dict:
    """move_install's fields from a frozen tensor's state, as Client._finish_move builds them."""
    records, arrays = [], {}
    for i, r in enumerate(source.move_state(name, full=True)["records"]):
        arrays[str(i)] = r["data"]
        arrays.update({f"{i}.{k}": a for k, a in r["arrays"].items()})
        records.append({k: r[k] for k in ("name", "version", "optimizer", "scalars")})
    return {"name": name, "move": move, "records": records, "tensors": arrays, "from": 0}


def test_each_step_is_idempotent_and_writes_are_refused_while_frozen() -> None:
    w = Writer()
    src, dst, meta = TensorStore(), TensorStore(), TensorStore()
    w(src, "create", tensors={"x": np.zeros(4, np.float32), "x:indices": np.arange(4.0)},
      optimizer={"x": ADAM, "x:indices": SGD})
    w(src, "push", tensors={"x": np.full(4, 0.5, np.float32)})
    before = src.tensors["x"]
    frozen = w(src, "move_freeze", name="x", to=1)
    assert frozen["names"] == ["x", "x:indices"]
    assert w(src, "move_freeze", name="x", to=1)["move"] == frozen["move"]          # again: the same freeze
    assert w(src, "move_freeze", name="x", to=2)["error"] == "InvalidRequest"      # elsewhere: refused
    refused = w(src, "push", tensors={"x": np.ones(4, np.float32)})
    assert refused["error"] == "Moving" and refused["group"] == 1
    assert w(src, "delete", names=["x:indices"])["error"] == "Moving"
    assert src.tensors["x"] is before                                               # nothing refused was applied
    fields = install_fields(src, "x", "g0." + frozen["move"])
    assert w(dst, "move_install", **fields)["installed"] == ["x", "x:indices"]
    w(dst, "push", tensors={"x": np.ones(4, np.float32)})                          # later pushes at dst
    after = dst.tensors["x"]
    assert w(dst, "move_install", **fields)["installed"] == []                     # a retry: no-op
    assert dst.tensors["x"] is after
    assert w(dst, "move_install", **dict(fields, move="g0.999"))["error"] == "TensorExists"
    w(meta, "place", name="x", to=1)
    assert meta.placement_table() == {"x": 1}
    done = w(src, "move_done", name="x", to=1, move=frozen["move"])
    assert done["names"] == ["x", "x:indices"] and "x" not in src.tensors
    assert w(src, "move_done", name="x", to=1, move=frozen["move"])["names"] == []  # a retry
    moved = w(src, "push", tensors={"x": np.ones(4, np.float32)})
    assert (moved["error"], moved["group"], moved["tensor"]) == ("Moved", 1, "x")
    with pytest.raises(Moved):
        src.read(["x:indices"])
    # the installed state is the source's, bit for bit: data, moments, beta powers, update count
    t = dst.tensors["x"]
    expect_data, expect_state = optim.step(optim.normalize(ADAM), before.data, np.ones(4, np.float32), before.state)
    assert t.version == before.version + 1
    assert t.data.tobytes() == expect_data.tobytes()
    assert all(np.asarray(t.state[k]).tobytes() == np.asarray(expect_state[k]).tobytes() for k in expect_state)


def test_snapshots_carry_moves_and_old_formats_still_restore() -> None:
    w = Writer()
    a, b = TensorStore(), TensorStore()
    for store in (a, b):
        w(store, "create", tensors={"y": np.ones(3)}, optimizer={"y": SGD})
        w(store, "place", name="z", to=2)
        w(store, "move_freeze", name="y", to=2)
        w(store, "push", tensors={"y": np.ones(3)})                 # refused: Moving
    assert a.digest() == b.digest()
    snap = a.snapshot()
    assert snap["format"] == 3
    c = TensorStore()
    c.restore(snap)
    assert c.digest() == a.digest() and c.moves.moving == a.moves.moving and c.moves.placement == {"z": 2}
    old = {k: v for k, v in snap.items() if k != "moves"}
    old["format"] = 2
    d = TensorStore()
    d.restore(old)
    assert d.moves.moving == {} and d.moves.moved == {} and d.moves.placement == {} and set(d.tensors) == {"y"}


def test_a_sync_step_entry_after_the_freeze_applies_nothing_and_tells_every_contributor() -> None:
    """push_step's entry (aggregate.py) may reach the log after a freeze: it is not applied there,
    and each contributor's session records Moving, so each sends its part again after the move."""
    w = Writer()
    store = TensorStore()
    w(store, "create", tensors={"x": np.zeros(2), "y": np.zeros(2)}, optimizer={"x": SGD, "y": SGD})
    w(store, "move_freeze", name="x", to=1)
    before = dict(store.tensors)
    result = store.apply(store.version + 1, {
        "op": "step", "job": "job", "step": 0, "workers": 2, "count": 2,
        "contributors": [["a", 1, 1, True], ["b", 1, 1, True]],
        "tensors": {"x": np.full(2, -2.0), "y": np.full(2, -2.0)}})
    assert result["error"] == "Moving" and [e["error"] for e in result["each"]] == ["Moving", "Moving"]
    assert store.tensors == before and store.sync_step_applied("job") == -1


@pytest.mark.parametrize("command", [
    {"op": "move_freeze", "name": "nope", "to": 1},
    {"op": "move_freeze", "name": "y", "to": 99},
    {"op": "move_freeze", "name": "y", "to": "1"},
    {"op": "move_freeze", "name": "y:indices", "to": 1},
    {"op": "move_freeze", "name": "bad name", "to": 1},
    {"op": "move_freeze", "name": "r", "to": 1},                       # adarevision
    {"op": "move_freeze", "name": "s", "to": 1},                       # in a sync step's buffer
    {"op": "move_done", "name": "y", "to": 1, "move": "7"},
    {"op": "move_done", "name": "y", "to": 1, "move": 7},
    {"op": "move_install", "name": "q", "move": "g1.2", "records": "x", "tensors": {}},
    {"op": "move_install", "name": "q", "move": "g1.2", "records": [{"name": "q"}], "tensors": {"0": np.ones(2)}},
    {"op": "move_install", "name": "q", "move": "g1.2", "records": [
        {"name": "other", "version": 0, "optimizer": SGD, "scalars": {}}], "tensors": {"0": np.ones(2)}},
    {"op": "move_install", "name": "q", "move": "g1.2", "records": [
        {"name": "q", "version": -1, "optimizer": SGD, "scalars": {}}], "tensors": {"0": np.ones(2)}},
    {"op": "move_install", "name": "q", "move": "g1.2", "records": [
        {"name": "q", "version": 0, "optimizer": ADAM, "scalars": {"beta1_t": 1.0}}], "tensors": {"0": np.ones(2)}},
    {"op": "move_install", "name": "q", "move": "g1.2", "records": [
        {"name": "q", "version": 0, "optimizer": SGD, "scalars": {"junk": 1.0}}], "tensors": {"0": np.ones(2)}},
    {"op": "move_install", "name": "q", "move": "g1.2", "records": [
        {"name": "q", "version": 0, "optimizer": SGD, "scalars": {}}], "tensors": {"0": np.array([np.nan])}},
    {"op": "move_install", "name": "q", "move": "g1.2", "records": [
        {"name": "q", "version": 0, "optimizer": SGD, "scalars": {}}], "tensors": {"0": np.arange(3)}},
    {"op": "move_install", "name": "q", "move": "g1.2", "records": [
        {"name": "q", "version": 0, "optimizer": SGD, "scalars": {}}], "tensors": {"0": np.ones(2), "0.m": np.ones(2)}},
    {"op": "place", "name": "y", "to": -1},
])
def test_bad_move_commands_get_typed_errors_and_change_no_tensor(command) -> None:
    w = Writer()
    store = TensorStore()
    w(store, "create", tensors={"y": np.ones(2), "r": np.ones(2), "s": np.ones(2)},
      optimizer={"y": SGD, "r": {"name": "adarevision", "lr": 0.1}, "s": SGD})
    w(store, "push_sync", tensors={"s": np.ones(2)}, step=0, workers=2)
    tensors, moves = dict(store.tensors), store.moves.snapshot()
    result = w(store, command.pop("op"), **command)
    assert result.get("error") in ("InvalidRequest", "UnknownTensor", "InvalidOptimizer", "InvalidGradient"), result
    assert store.tensors == tensors and store.moves.snapshot() == moves


# ---- real clusters -----------------------------------------------------------------------------------

def start(run_dir, base_port: int, groups: int) -> LocalCluster:
    """A started cluster. Should another process hold one of its ports (this machine runs other
    suites, benchmarks and clusters), a node that cannot bind exits, and the cluster is started
    again 5, then 15 ports up."""
    for shift in (0, 5, 15):
        cl = LocalCluster(os.path.join(str(run_dir), f"base{base_port + shift}"), nodes=3,
                          base_port=base_port + shift, groups=groups)
        try:
            cl.start(timeout=60.0)
            return cl
        except NodeExited:
            cl.wipe()
            if shift == 15:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start(tmp_path_factory.mktemp("move3"), 15000, groups=3)
    try:
        yield cl
    finally:
        cl.stop()
        cl.drop_payloads()


def wait_identical(cl: LocalCluster, timeout: float = 30.0) -> dict[int, list[dict]]:
    """Every group's three replicas up, at one version with one digest (or the last rows seen)."""
    deadline = time.monotonic() + timeout
    while True:
        groups: dict[int, list[dict]] = {}
        for row in cl.status():
            if row["role"] != "down":
                groups.setdefault(row["group"], []).append(row)
        same = all(len(rows) == 3 and len({(r["version"], r["digest"]) for r in rows}) == 1
                   for rows in groups.values())
        if same or time.monotonic() > deadline:
            return groups
        time.sleep(0.2)


def assert_replicas_identical(cl: LocalCluster) -> None:
    for g, rows in wait_identical(cl).items():
        assert len(rows) == 3 and len({(r["version"], r["digest"]) for r in rows}) == 1, f"group {g}: {rows}"


def group_state(c: Client, group: int, name: str) -> dict:
    return c._router.request({"op": "move_state", "name": name}, raft_group=group)


def tensor_state(c: Client, group: int, name: str) -> tuple:
    """(data, version, state) of ``name`` in ``group``, from that group's snapshot."""
    snap = c._router.request({"op": "snapshot"}, raft_group=group)["snapshot"]
    for n, data, version, _spec, state in snap["tensors"]:
        if n == name:
            return data, version, dict(state)
    raise AssertionError(f"{name} not in group {group}")


def other_group(c: Client, name: str) -> int:
    return (c.group_of(name) + 1) % c.groups()


class Load:
    """Client threads pushing counters (SGD, lr 1, gradient -1: the value counts applied pushes)
    and one pushing an Adam tensor a constant gradient; each thread's client is created before
    any move, so its placement goes stale. Bounded in count and time."""

    def __init__(self, cl: LocalCluster, hot: str, cold: list[str], adam: str, grad: np.ndarray,
                 max_pushes: int = 2000, seconds: float = 90.0) -> None:
        self.hot, self.cold, self.adam, self.grad = hot, cold, adam, grad
        self.acked = {n: 0 for n in [hot, *cold, adam]}
        self.unknown = {n: 0 for n in self.acked}
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.deadline = time.monotonic() + seconds
        self.max_pushes = max_pushes
        clients = [cl.client(timeout=30.0) for _ in range(len(cold) + 1)]
        for c in clients:
            c.groups()                    # learn the layout and placement now: stale after the move
        self.threads = [threading.Thread(target=self._counters, args=(clients[k], cold[k]), daemon=True)
                        for k in range(len(cold))]
        self.threads.append(threading.Thread(target=self._adam, args=(clients[-1],), daemon=True))
        self.clients = clients

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _push(self, c: Client, grads: dict) -> None:
        try:
            c.push(grads)
        except Unavailable:
            for n in grads:
                self.unknown[n] += 1
        except RaftpsError as exc:
            self.errors.append(repr(exc))
            self.stop.set()
        else:
            for n in grads:
                self.acked[n] += 1

    def _counters(self, c: Client, cold: str) -> None:
        minus_one = np.full(4, -1.0)
        for _ in range(self.max_pushes):
            if self.stop.is_set() or time.monotonic() > self.deadline:
                return
            self._push(c, {self.hot: minus_one, cold: minus_one})

    def _adam(self, c: Client) -> None:
        for _ in range(self.max_pushes):
            if self.stop.is_set() or time.monotonic() > self.deadline:
                return
            self._push(c, {self.adam: self.grad})

    def finish(self) -> dict[str, int]:
        """Stop; the parts the clients sent again because of the moves (waited, re-routed)."""
        self.stop.set()
        for t in self.threads:
            t.join(60.0)
        assert not any(t.is_alive() for t in self.threads)
        for c in self.clients:
            c.close()
        return {k: sum(c.refusals[k] for c in self.clients) for k in ("Moving", "Moved")}


def test_move_under_load_applies_every_acked_push_once(cluster) -> None:
    hot, adam, cold = "load/hot", "load/adam", [f"load/cold{k}" for k in range(3)]
    grad = np.linspace(-1.0, 1.0, 6).astype(np.float32)
    with cluster.client(timeout=30.0) as c:
        c.create_many({**{n: np.zeros(4) for n in [hot, *cold]}, adam: np.zeros(6, np.float32)},
                      {**{n: SGD for n in [hot, *cold]}, adam: ADAM})
        hot_from, adam_from = c.group_of(hot), c.group_of(adam)
        hot_to, adam_to = other_group(c, hot), (adam_from + 2) % 3
        load = Load(cluster, hot, cold, adam, grad)
        load.start()
        time.sleep(2.0)
        started = time.monotonic()
        moved_hot = c.move(hot, hot_to)
        hot_seconds = time.monotonic() - started
        time.sleep(1.0)
        started = time.monotonic()
        moved_adam = c.move(adam, adam_to)
        adam_seconds = time.monotonic() - started
        time.sleep(2.0)
        refusals = load.finish()
        assert not load.errors, load.errors
        tensors, _ = c.pull([hot, *cold, adam])
        print(f"moves: {hot} {hot_from}->{hot_to} in {hot_seconds:.2f} s, {adam} {adam_from}->{adam_to} in "
              f"{adam_seconds:.2f} s; acked {load.acked}, unknown {load.unknown}, "
              f"applied {({n: float(tensors[n][0]) for n in [hot, *cold]})}; parts sent again: {refusals}")
        assert refusals["Moved"] >= 4          # every stale client was re-routed by a tombstone
        assert moved_hot == {"tensor": hot, "from": hot_from, "to": hot_to, "names": [hot]}
        assert moved_adam["to"] == adam_to
        for n in [hot, *cold]:
            applied = float(tensors[n][0])
            assert load.acked[n] <= applied <= load.acked[n] + load.unknown[n], (n, applied, load.acked[n])
        assert load.acked[hot] > 0 and all(load.acked[n] > 0 for n in cold)
        # the sources hold tombstones only; the placement and the listing say where they are
        for name, source, target in [(hot, hot_from, hot_to), (adam, adam_from, adam_to)]:
            st = group_state(c, source, name)
            assert (st["present"], st["moving"], st["moved"]) == (False, None, target)
            with pytest.raises(Moved) as info:
                c._router.request({"op": "pull", "names": [name]}, raft_group=source)
            assert info.value.group == target
            assert c.refresh_placement()[name] == target
        assert {r["name"]: r["group"] for r in c.tensors(prefix="load/")}[hot] == hot_to
        # Adam's state at the destination: exactly n steps of the same gradient from zero
        data, version, state = tensor_state(c, adam_to, adam)
        n = version                   # the tensor's update count moved with it
        assert load.acked[adam] <= n <= load.acked[adam] + load.unknown[adam]
        spec = optim.normalize(ADAM)
        want, want_state = np.zeros(6, np.float32), optim.init_state(spec, np.zeros(6, np.float32))
        for _ in range(n):
            want, want_state = optim.step(spec, want, grad, want_state)
        assert data.tobytes() == want.tobytes()
        for key in ("m", "v"):
            assert state[key].tobytes() == want_state[key].tobytes(), key
        assert (state["beta1_t"], state["beta2_t"]) == (want_state["beta1_t"], want_state["beta2_t"])
    assert_replicas_identical(cluster)


def start_mover(cl: LocalCluster, name: str, target: int, stop_after: str) -> subprocess.Popen:
    """A `raftps move` in its own process that hangs right after step ``stop_after`` (the write
    op), so that the test can SIGKILL it there."""
    code = (
        "import sys, time\n"
        "from raftps.client.router import Router\n"
        "write = Router.write\n"
        "def hang_after(self, op, raft_group=0, **fields):\n"
        "    out = write(self, op, raft_group, **fields)\n"
        f"    if op == {stop_after!r}:\n"
        "        print('stopped after', op, flush=True)\n"
        "        time.sleep(300)\n"
        "    return out\n"
        "Router.write = hang_after\n"
        "from raftps.tools.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, **cl.client_env, "PYTHONPATH": WORKTREE}
    return subprocess.Popen([sys.executable, "-c", code, "move", name, "--to", str(target)], env=env, cwd=WORKTREE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def run_cli(cl: LocalCluster, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = {**os.environ, **cl.client_env, "PYTHONPATH": WORKTREE}
    return subprocess.run([sys.executable, "-m", "raftps", *args], env=env, cwd=WORKTREE, capture_output=True,
                          text=True, timeout=timeout)


def wait_line(proc: subprocess.Popen, want: str, timeout: float = 60.0) -> str:
    """The mover's first line, which must contain ``want`` (bounded: the process is killed after)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    line = box[0] if box else ""
    assert want in line, (line, proc.poll())
    return line


@pytest.mark.parametrize("stop_after,kill_source_leader", [("move_freeze", True), ("move_install", False),
                                                           ("place", False)])
def test_an_interrupted_move_completes_when_run_again(cluster, stop_after, kill_source_leader) -> None:
    name = f"int/{stop_after}"
    with cluster.client(timeout=30.0) as setup, cluster.client(timeout=60.0) as stale:
        setup.create(name, np.zeros(4), SGD)
        stale.push({name: np.full(4, -1.0)})                 # the stale client learns the old placement
        source, target = stale.group_of(name), other_group(stale, name)
        mover = start_mover(cluster, name, target, stop_after)
        victim = None
        try:
            wait_line(mover, f"stopped after {stop_after}")
        finally:
            mover.kill()                                     # SIGKILL, by PID
            mover.wait(10.0)
            mover.stdout.close()
            mover.stderr.close()
        frozen = group_state(setup, source, name)["moving"]
        assert frozen is not None and frozen["to"] == target
        # a push now waits (Moving) and lands once the move is finished
        pushed: list = []
        pusher = threading.Thread(target=lambda: pushed.append(stale.push({name: np.full(4, -1.0)})), daemon=True)
        pusher.start()
        if kill_source_leader:
            victim = cluster.leader(source)
            cluster.kill(victim)
        try:
            time.sleep(0.5)
            assert pusher.is_alive() and not pushed              # still waiting on the frozen tensor
            again = run_cli(cluster, "move", name, "--to", str(target))
            print(f"{stop_after}: rerun: {again.stdout.strip()} {again.stderr.strip()}")
            assert again.returncode == 0, again.stderr
            assert f"moved {name} from Raft group {source} to {target}" in again.stdout
            pusher.join(60.0)
            assert not pusher.is_alive() and pushed and sorted(pushed[0]) == [target]
            stale.push({name: np.full(4, -1.0)})
            tensors, _ = setup.pull([name])
            assert float(tensors[name][0]) == 3.0, tensors[name]     # three pushes, each applied once
            st = group_state(setup, source, name)
            assert (st["present"], st["moving"], st["moved"]) == (False, None, target)
            assert run_cli(cluster, "move", name, "--to", str(target)).returncode == 1   # it is there now
        finally:
            if victim is not None:
                cluster.start_node(victim)
                cluster.wait_ready(60.0)
    assert_replicas_identical(cluster)


def names_in_two_groups(prefix: str) -> tuple[str, str]:
    """Two tensor names, the first in a higher group of three than the second (a client sends a
    request's parts in group order: the second's part goes first, so the first's, re-routed into
    the second's group, comes after that group applied the step)."""
    from raftps.groups import group_of
    a = next(f"{prefix}/a{i}" for i in range(100) if group_of(f"{prefix}/a{i}", 3) > 0)
    b = next(f"{prefix}/b{i}" for i in range(100) if group_of(f"{prefix}/b{i}", 3) < group_of(a, 3))
    return a, b


@pytest.mark.parametrize("layout", ["together", "apart"])
def test_aggregated_sync_steps_go_on_through_a_move(cluster, layout) -> None:
    """Two workers push_step every step of a job while one of its tensors moves. ``together``: the
    job's tensors move together (a tensor and its index tensor): every step is applied once with
    both contributions. ``apart``: the job spans two groups and the tensor moves into the other
    one, which may have applied a step already: the moved tensor's part of that step is answered
    late (not applied, and the worker is told), never applied twice; the other tensor gets every step."""
    if layout == "together":
        hot, stay = "steps/hot", "steps/hot:indices"
    else:
        hot, stay = names_in_two_groups("apart")
    steps, job = 40, f"steps/{layout}"
    with cluster.client(timeout=30.0) as c:
        c.create_many({hot: np.zeros(2), stay: np.zeros(2)}, {hot: SGD, stay: SGD})
        target = c.group_of(stay) if layout == "apart" else other_group(c, hot)
        workers = [cluster.client(timeout=60.0) for _ in range(2)]
        for w in workers:
            w.groups()                                   # placement learned now: stale after the move
        done, late, errors = [0, 0], [set(), set()], []

        def work(rank: int) -> None:
            try:
                for step in range(steps):
                    out = workers[rank].push_step({hot: np.full(2, -1.0), stay: np.full(2, -1.0)}, step, workers=2,
                                                  job=job, rank=rank, timeout=10.0)
                    assert out["applied"] and not out.get("duplicate_rank"), out
                    if out.get("late"):
                        late[rank].add(step)
                    done[rank] += 1
            except BaseException as exc:                 # reported below
                errors.append(repr(exc))
        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30.0
        while min(done) < steps // 3 and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
        moved = c.move(hot, target)
        for t in threads:
            t.join(120.0)
        refusals = {k: sum(w.refusals[k] for w in workers) for k in ("Moving", "Moved")}
        for w in workers:
            w.close()
        assert not any(t.is_alive() for t in threads) and not errors, errors
        tensors, version = c.pull([hot, stay])
        print(f"push_step ({layout}) through a move of {hot} {moved['from']}->{moved['to']}: {done} steps done, "
              f"late {sorted(late[0])} / {sorted(late[1])}, values {float(tensors[hot][0])} / "
              f"{float(tensors[stay][0])}; parts sent again: {refusals}")
        assert done == [steps, steps] and late[0] == late[1]
        assert float(tensors[stay][0]) == steps
        assert float(tensors[hot][0]) == steps - len(late[0])
        if layout == "together":
            assert not late[0] and moved["names"] == [hot, stay] and sorted(version) == [moved["to"]]
    assert_replicas_identical(cluster)


def test_index_tensor_moves_with_its_tensor_and_a_sync_step_blocks_a_move(cluster) -> None:
    with cluster.client(timeout=30.0) as c:
        c.create_many({"emb": np.ones((4, 2)), "emb:indices": np.arange(3.0)}, {"emb": SGD, "emb:indices": SGD})
        source, target = c.group_of("emb"), other_group(c, "emb")
        c.push_sync({"emb": np.ones((4, 2))}, step=0, workers=2, job="movejob")
        with pytest.raises(InvalidRequest, match="sync step 0 of sync job 'movejob'"):
            c.move("emb", target)
        assert group_state(c, source, "emb")["moving"] is None
        c.close_step(0, job="movejob")
        out = c.move("emb", target)
        assert out["names"] == ["emb", "emb:indices"]
        tensors, version = c.pull(["emb", "emb:indices"])
        assert sorted(version) == [target]
        np.testing.assert_array_equal(tensors["emb:indices"], np.arange(3.0))
        assert group_state(c, source, "emb:indices")["moved"] == target
        c.move("emb", source)                                  # and back again
        tensors, version = c.pull(["emb", "emb:indices"])
        assert sorted(version) == [source] and c.refresh_placement()["emb"] == source
        with pytest.raises(InvalidRequest, match="index tensor"):
            c.move("emb:indices", target)
    assert_replicas_identical(cluster)


def test_bad_moves_are_refused_and_change_nothing(cluster) -> None:
    with cluster.client(timeout=30.0) as c:
        c.create("bad/x", np.zeros(2), SGD)
        c.create("bad/ada", np.zeros(2), {"name": "adarevision", "lr": 0.1})
        here = c.group_of("bad/x")
        before = {(r["node"], r["group"]): (r["version"], r["digest"]) for rows in wait_identical(cluster).values()
                  for r in rows}
        cases = [(("bad/none", 1), UnknownTensor, "unknown tensor 'bad/none'"),
                 (("bad/x", 3), InvalidRequest, "Raft group 3 is out of range: this cluster has groups 0..2"),
                 (("bad/x", -1), InvalidRequest, "out of range"),
                 (("bad/x", "1"), InvalidRequest, "out of range"),
                 (("bad/x", here), InvalidRequest, f"already in Raft group {here}"),
                 (("bad x", 1), InvalidRequest, "bad tensor name"),
                 (("bad/x:indices", 1), InvalidRequest, "index tensor")]
        for args, error, message in cases:
            with pytest.raises(error, match=message):
                c.move(*args)
        after = {(r["node"], r["group"]): (r["version"], r["digest"]) for rows in wait_identical(cluster).values()
                 for r in rows}
        assert after == before                                  # nothing was written anywhere
        # the nodes refuse what a client would not send, before it reaches a log
        with pytest.raises(InvalidRequest, match="cannot move to the group it is in"):
            c._router.write("move_freeze", here, name="bad/x", to=here)
        with pytest.raises(InvalidRequest, match="placement table lives in Raft group 0"):
            c._router.write("place", 1, name="bad/x", to=2)
        with pytest.raises(InvalidRequest, match="adarevision"):
            c.move("bad/ada", (c.group_of("bad/ada") + 1) % 3)
        c.create("bad/_raftps/steps.rank0", np.zeros(1), SGD)
        with pytest.raises(InvalidRequest, match="bookkeeping"):
            c.move("bad/_raftps/steps.rank0", (c.group_of("bad/_raftps/steps.rank0") + 1) % 3)
        assert group_state(c, c.group_of("bad/ada"), "bad/ada")["moving"] is None
        c.create("bad/big", np.zeros(300), ADAM)                 # 2,400 bytes of data, 7,200 with its moments
        with cluster.client(timeout=30.0, limits=Limits(max_blob_bytes=4096)) as small:
            with pytest.raises(LimitExceeded, match="7200 bytes"):
                small.move("bad/big", other_group(c, "bad/big"))
        assert group_state(c, c.group_of("bad/big"), "bad/big")["moving"] is None   # refused before the freeze
        c.push({"bad/ada": np.ones(2), "bad/x": np.ones(2)})    # both still writable where they were
    for args, code, message in [(["bad/x", "--to", "7"], 2, "out of range"),
                                (["bad/none", "--to", "1"], 1, "UnknownTensor"),
                                (["bad/x", "--to", str(here)], 1, "already in Raft group")]:
        p = run_cli(cluster, "move", *args)
        assert p.returncode == code and message in p.stderr, (args, p.returncode, p.stderr)


def test_one_group_refuses_moves(tmp_path) -> None:
    cl = start(tmp_path, 15040, groups=1)
    try:
        with cl.client(timeout=30.0) as c:
            c.create("solo", np.zeros(2), SGD)
            wait_converged(c, 3)      # every follower has applied the create before the digests are taken
            digest = {r["node"]: r["digest"] for r in cl.status()}
            with pytest.raises(InvalidRequest, match="one Raft group"):
                c.move("solo", 1)
            with pytest.raises(InvalidRequest, match="one Raft group"):
                c._router.write("move_freeze", 0, name="solo", to=1)
            p = run_cli(cl, "move", "solo", "--to", "0")
            assert p.returncode == 2 and "one Raft group" in p.stderr, p.stderr
            assert {r["node"]: r["digest"] for r in cl.status()} == digest
            c.push({"solo": np.ones(2)})
            assert float(c.pull(["solo"])[0]["solo"][0]) == -1.0
    finally:
        cl.stop()
        cl.drop_payloads()
