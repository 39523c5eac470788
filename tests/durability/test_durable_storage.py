"""raftps.raft.storage (the real file layer) and raftps.chaos.simdisk (SimulatedDisk's power-cut
semantics), on real files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from raftps.chaos.simdisk import SIMDISK_ENV, PowerLost, SimulatedDisk, load_model, power_cut, storage_from_env
from raftps.raft.storage import OSStorage, write_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


@pytest.fixture
def disk(tmp_path):
    d = SimulatedDisk(str(tmp_path / "state"))
    (tmp_path / "data").mkdir()
    yield d
    d.close()


def test_os_storage_round_trip(tmp_path):
    s = OSStorage()
    f = s.open(str(tmp_path / "a"))
    assert f.append(b"hello ") == 0
    assert f.append(b"world") == 6
    f.write(0, b"J")
    f.fsync()
    assert f.read(0, 11) == b"Jello world" and f.size == 11
    f.truncate(5)
    f.close()
    s.rename(str(tmp_path / "a"), str(tmp_path / "b"))
    s.fsync_dir(str(tmp_path))
    assert read(str(tmp_path / "b")) == b"Jello" and not s.exists(str(tmp_path / "a"))
    write_atomic(s, str(tmp_path / "b"), b"new")
    assert s.read_file(str(tmp_path / "b")) == b"new"
    s.remove(str(tmp_path / "b"))
    assert s.listdir(str(tmp_path)) == []


def test_synced_cut_keeps_only_fsynced_content(disk, tmp_path):
    path = str(tmp_path / "data" / "f")
    f = disk.open(path)
    disk.fsync_dir(str(tmp_path / "data"))
    f.append(b"durable")
    f.fsync()
    f.append(b" lost")
    f.write(0, b"X")
    assert read(path) == b"Xurable lost"           # the running process sees every write
    disk.power_cut("synced")
    assert read(path) == b"durable"
    with pytest.raises(PowerLost):
        f.append(b"after the cut")


def test_unsynced_truncate_is_undone(disk, tmp_path):
    path = str(tmp_path / "data" / "f")
    f = disk.open(path)
    disk.fsync_dir(str(tmp_path / "data"))
    f.append(b"0123456789")
    f.fsync()
    f.truncate(3)
    disk.power_cut("synced")
    assert read(path) == b"0123456789"


def test_create_without_directory_fsync_is_undone(disk, tmp_path):
    kept, lost = str(tmp_path / "data" / "kept"), str(tmp_path / "data" / "lost")
    f = disk.open(kept)
    f.append(b"k")
    f.fsync()
    disk.fsync_dir(str(tmp_path / "data"))
    g = disk.open(lost)
    g.append(b"fsynced, but its name is not")
    g.fsync()
    disk.power_cut("synced")
    assert read(kept) == b"k" and read(lost) is None


def test_rename_without_directory_fsync_is_undone(disk, tmp_path):
    data = str(tmp_path / "data")
    target = os.path.join(data, "target")
    with open(target, "wb") as f:                  # existed before the disk saw it: durable as is
        f.write(b"old")
    tmp = disk.open(target + ".tmp")
    tmp.write(0, b"new")
    tmp.fsync()
    tmp.close()
    disk.rename(target + ".tmp", target)
    assert read(target) == b"new"
    disk.power_cut("synced")
    assert read(target) == b"old" and read(target + ".tmp") is None


def test_rename_with_directory_fsync_survives(disk, tmp_path):
    target = str(tmp_path / "data" / "target")
    with open(target, "wb") as f:
        f.write(b"old")
    write_atomic(disk, target, b"new")
    disk.power_cut("synced")
    assert read(target) == b"new" and read(target + ".tmp") is None


def test_remove_without_directory_fsync_is_undone(disk, tmp_path):
    path = str(tmp_path / "data" / "f")
    with open(path, "wb") as f:
        f.write(b"still here")
    disk.remove(path)
    assert read(path) is None
    disk.power_cut("synced")
    assert read(path) == b"still here"


def test_torn_cut_keeps_a_random_prefix_of_unsynced_writes(tmp_path):
    base = b"S" * 10
    writes = [bytes([65 + i]) * 7 for i in range(5)]
    full = base + b"".join(writes)
    seen = set()
    for seed in range(40):
        d = SimulatedDisk(str(tmp_path / f"state{seed}"), seed=seed)
        path = str(tmp_path / f"f{seed}")
        f = d.open(path)
        d.fsync_dir(str(tmp_path))
        f.append(base)
        f.fsync()
        for w in writes:
            f.append(w)
        d.power_cut("torn")
        got = read(path)
        assert got == full[:len(got)] and len(got) >= len(base), (seed, got)
        seen.add(len(got))
        d.close()
    # All of them, a prefix of whole writes, and cuts inside a write all happen.
    assert len(full) in seen, sorted(seen)
    assert any(n < len(full) and (n - len(base)) % 7 == 0 for n in seen), sorted(seen)
    assert any((n - len(base)) % 7 for n in seen), sorted(seen)


def test_torn_cut_is_reproducible(tmp_path):
    results = []
    for attempt in range(2):
        d = SimulatedDisk(str(tmp_path / f"state{attempt}"), seed=7)
        path = str(tmp_path / f"f{attempt}")
        f = d.open(path)
        d.fsync_dir(str(tmp_path))
        for i in range(20):
            f.append(os.urandom(0) + bytes([i]) * 13)
        d.power_cut("torn")
        results.append(read(path))
        d.close()
    assert results[0] == results[1]


def test_torn_write_atomic_is_old_or_new_never_mixed(tmp_path):
    """With fsync, write_atomic gives old or new content under any torn cut; without, not."""
    def run(fsync: bool) -> set:
        outcomes = set()
        for seed in range(30):
            d = SimulatedDisk(str(tmp_path / f"st{fsync}{seed}"), seed=seed)
            target = str(tmp_path / f"t{fsync}{seed}")
            with open(target, "wb") as f:
                f.write(b"old-old-old")
            write_atomic(d, target, b"new-new-new", fsync=fsync)
            d.power_cut("torn")
            outcomes.add(read(target))
            d.close()
        return outcomes
    assert run(True) == {b"new-new-new"}
    assert not run(False) <= {b"old-old-old", b"new-new-new"}   # torn files: the check can fail


def test_cut_mode_is_checked(disk):
    with pytest.raises(ValueError):
        disk.power_cut("lightning")


def test_operation_log_torn_tail_is_ignored(disk, tmp_path):
    path = str(tmp_path / "data" / "f")
    f = disk.open(path)
    disk.fsync_dir(str(tmp_path / "data"))
    f.append(b"abc")
    f.fsync()
    log = os.path.join(disk.state_dir, "ops.log")
    whole = os.path.getsize(log)
    f.append(b"def")
    with open(log, "r+b") as fh:
        fh.truncate(os.path.getsize(log) - 2)    # the writer died inside its last record
    model = load_model(disk.state_dir)
    assert model.cut("torn", 0)[path] == b"abc"
    assert whole < os.path.getsize(log)


CHILD = textwrap.dedent("""
    import os, signal, sys
    from raftps.chaos.simdisk import storage_from_env
    from raftps.raft.storage import write_atomic
    data = sys.argv[1]
    s = storage_from_env()
    f = s.open(os.path.join(data, "log"))
    s.fsync_dir(data)
    f.append(b"synced;")
    f.fsync()
    f.append(b"unsynced;")
    write_atomic(s, os.path.join(data, "meta"), b"meta-" + sys.argv[2].encode())
    g = s.open(os.path.join(data, "fresh"))
    g.append(b"x")
    g.fsync()
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_cross_process_power_cut(tmp_path):
    """A SIGKILLed process's writes, cut from its operation log by the harness; twice in a row."""
    data, state = str(tmp_path / "data"), str(tmp_path / "state")
    os.mkdir(data)
    env = dict(os.environ, PYTHONPATH=ROOT, **{SIMDISK_ENV: state})
    for round_ in ("1", "2"):
        proc = subprocess.run([sys.executable, "-c", CHILD, data, round_], env=env)
        assert proc.returncode == -signal.SIGKILL
        assert read(os.path.join(data, "log")).endswith(b"unsynced;")
        if round_ == "1":
            continue                              # a crash without a power cut: the log carries on
        power_cut(state, "synced")
    # Round 2's fsync made round 1's unsynced append durable too (an fsync covers the whole
    # file); round 2's own unsynced append is lost.
    assert read(os.path.join(data, "log")) == b"synced;unsynced;synced;"
    assert read(os.path.join(data, "meta")) == b"meta-2"
    assert read(os.path.join(data, "fresh")) == b"xx"    # its name made durable by the meta rename
    assert os.path.getsize(os.path.join(state, "ops.log")) == 0


def test_storage_from_env(tmp_path):
    assert isinstance(storage_from_env({}), OSStorage)
    d = storage_from_env({SIMDISK_ENV: str(tmp_path / "s")})
    assert isinstance(d, SimulatedDisk)
    d.close()


def test_failed_operations_are_not_logged(disk, tmp_path):
    with pytest.raises(FileNotFoundError):
        disk.open(str(tmp_path / "no-such-dir" / "f"))
    with pytest.raises(FileNotFoundError):
        disk.rename(str(tmp_path / "data" / "missing"), str(tmp_path / "data" / "x"))
    with pytest.raises(FileNotFoundError):
        disk.remove(str(tmp_path / "data" / "missing"))
    with pytest.raises(FileNotFoundError):
        disk.open(str(tmp_path / "data" / "missing"), create=False)
    assert list(load_model(disk.state_dir).known) == []
    disk.power_cut("torn")                        # and the log still replays


def test_a_new_process_appends_after_a_torn_log_record(tmp_path):
    """A writer killed mid-record leaves a torn tail; the next one must cut it off, or every
    record it logs would sit behind it, unreadable."""
    state = str(tmp_path / "state")
    path = str(tmp_path / "f")
    d = SimulatedDisk(state)
    f = d.open(path)
    d.fsync_dir(str(tmp_path))
    f.append(b"one;")
    f.fsync()
    d.close()
    with open(os.path.join(state, "ops.log"), "ab") as log:
        log.write(b"\x07\x00\x00")                  # half a record header
    d = SimulatedDisk(state)
    f = d.open(path)
    f.append(b"two;")
    f.fsync()
    f.append(b"three;")
    d.close()
    power_cut(state, "synced")
    assert read(path) == b"one;two;"


def test_offsets_past_4_gib(tmp_path):
    """64-bit offsets through the file layer (a sparse file: nothing near 4 GiB is written)."""
    s = OSStorage()
    f = s.open(str(tmp_path / "sparse"))
    far = (5 << 30) + 123
    f.write(far, b"beyond 4 GiB")
    assert f.size == far + 12
    assert f.append(b"!") == far + 12
    f.fsync()
    assert f.read(far, 13) == b"beyond 4 GiB!"
    f.truncate(far + 6)
    assert f.read(far, 100) == b"beyond" and os.path.getsize(str(tmp_path / "sparse")) == far + 6
    f.close()
    s.remove(str(tmp_path / "sparse"))          # pytest keeps tmp dirs: leave no 5 GiB file behind


def test_storage_from_env_gives_one_disk_per_state_dir(tmp_path):
    """The journal, payloads and snapshots of a node (and of every group it hosts) log to one disk."""
    env = {SIMDISK_ENV: str(tmp_path / "s")}
    d = storage_from_env(env)
    assert storage_from_env(env) is d
    d.close()
    assert storage_from_env(env) is not d
    storage_from_env(env).close()


@pytest.mark.parametrize("fsync", [True, False])
def test_snapshots_written_and_received_survive_a_cut_only_when_fsynced(tmp_path, fsync):
    """install_durable_snapshots on pysyncobj's Serializer: the node's own snapshot and one
    streamed in chunks by a leader are on the disk after a "synced" cut, or gone without fsync."""
    from pysyncobj.config import SERIALIZER_STATE
    from pysyncobj.serializer import Serializer

    from raftps.raft.journal_hook import install_durable_snapshots
    disk = SimulatedDisk(str(tmp_path / "state"))
    path = str(tmp_path / "raft.snapshot")

    def write(filename, data):
        f = disk.open(filename)
        f.write(0, data[0])
        f.close()

    class Node:                                   # what install_durable_snapshots reads of a SyncObj
        _SyncObj__serializer = Serializer(path, 1 << 20, False, write, None, None)
    serializer = Node._SyncObj__serializer
    install_durable_snapshots(Node, disk, fsync=fsync)
    serializer.serialize((None, b"own snapshot"), 7)
    assert serializer.checkSerializing() == (SERIALIZER_STATE.SUCCESS, 7)
    disk.power_cut("synced")
    assert read(path) == (b"own snapshot" if fsync else None)

    chunks = [(b"rec", True, False), (b"eiv", False, False), (b"ed", False, False), (b"", False, True)]
    assert [serializer.setTransmissionData(c) for c in chunks] == [False, False, False, True]
    assert read(path) == b"received"
    disk.power_cut("synced")
    assert read(path) == (b"received" if fsync else None)
    assert not os.path.exists(path + ".1.tmp")
    disk.close()


def test_seeded_snapshot_survives_a_power_cut(disk, tmp_path):
    """`raftps snapshot restore` seeds a data dir with snapshot_file.seed: it must be on the disk,
    whole, when seed returns (it was renamed into place unsynced before)."""
    import numpy as np

    from raftps.server import snapshot_file
    from raftps.store.machine import TensorStore

    data = str(tmp_path / "data")
    store = TensorStore()
    store.apply(1, {"op": "create", "name": "w", "value": np.arange(4, dtype=np.float32),
                    "optimizer": {"name": "sgd", "lr": 0.1}})
    snapshot_file.seed(data, store.version, store.snapshot(), ["127.0.0.1:1"], storage=disk)
    disk.power_cut("synced")
    meta, machine = snapshot_file.read(snapshot_file.path(data))
    assert meta.index == 2 and meta.members == ["127.0.0.1:1"]
    assert not os.path.exists(snapshot_file.path(data) + ".tmp")


def test_the_product_never_imports_the_disk_simulator():
    """The simulator is a test tool (raftps/chaos/): no module of raftps outside raftps/chaos/
    imports it, and a node's process gets it only from simdisk_node.py, through use_storage."""
    import ast
    package = os.path.join(ROOT, "raftps")
    importers = []
    for folder, _, files in os.walk(package):
        if os.path.relpath(folder, package).split(os.sep)[0] == "chaos":
            continue
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] + [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
                if any("chaos" in m or "simdisk" in m for m in modules):
                    importers.append(os.path.relpath(path, ROOT))
    assert importers == []
    code = ("import sys, raftps.tools.cli, raftps.server.node, raftps.server.server, raftps.raft.pysyncobj_log; "
            "print(sorted(m for m in sys.modules if 'chaos' in m or 'simdisk' in m))")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_simdisk_node_runs_the_command_line_on_the_simulated_disk(tmp_path):
    """python -m raftps.chaos.simdisk_node takes raftps's arguments; without a state dir it refuses."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop(SIMDISK_ENV, None)
    refused = subprocess.run([sys.executable, "-m", "raftps.chaos.simdisk_node", "token-hash"], env=env,
                             capture_output=True, text=True, timeout=60, input="x\n")
    assert refused.returncode != 0 and SIMDISK_ENV in refused.stderr
    env[SIMDISK_ENV] = str(tmp_path / "state")
    done = subprocess.run([sys.executable, "-m", "raftps.chaos.simdisk_node", "token-hash"], env=env,
                          capture_output=True, text=True, timeout=60, input="x\n")
    assert done.returncode == 0 and len(done.stdout.strip()) == 64
    assert os.path.exists(tmp_path / "state" / "ops.log")    # the disk was made and handed in


def test_use_storage_hands_the_process_storage_to_durable_writers(tmp_path):
    from raftps.raft import storage
    before = storage.process_storage()
    assert isinstance(before, OSStorage)
    disk = SimulatedDisk(str(tmp_path / "state"))
    try:
        storage.use_storage(disk)
        assert storage.process_storage() is disk
    finally:
        storage.use_storage(before)
        disk.close()
