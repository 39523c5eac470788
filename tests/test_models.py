"""raftps export / import on a real 3-node cluster: one store version per file, round trips
through safetensors and npz (and into a torch module), and bad input refused with nothing changed."""
import json
import os
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from tests.conftest import start_cluster, wait_converged

BASE = 24010
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("models"), BASE)
    yield cl
    cl.wipe()


@pytest.fixture
def client(cluster):
    with cluster.client(timeout=30) as c:
        yield c


def raftps(cluster, *args, timeout=60):
    env = {**os.environ, **cluster.client_env, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "raftps", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_export_is_one_version_of_the_store(cluster, client, tmp_path):
    """Pushes that update m/a and m/b together keep going while we export: every file holds both
    at the same update count, and its metadata names a version and the store's digest there."""
    a = np.zeros(1000, np.float32)
    client.create_many({"m/a": a, "m/b": a, "m/c.bias": np.zeros(3, np.float64)},
                       {n: {"name": "sgd", "lr": 1.0} for n in ("m/a", "m/b", "m/c.bias")})
    stop = threading.Event()

    def pusher():
        with cluster.client() as c:
            for _ in range(2000):
                if stop.is_set():
                    return
                c.push({"m/a": np.ones(1000, np.float32), "m/b": np.ones(1000, np.float32)})

    thread = threading.Thread(target=pusher)
    thread.start()
    try:
        time.sleep(0.3)
        for i, fmt in enumerate(["safetensors", "npz", "safetensors"]):
            path = tmp_path / f"m{i}.{fmt}"
            done = raftps(cluster, "export", "--prefix", "m", "--format", fmt, str(path))
            assert done.returncode == 0, done.stderr
            assert "exported 3 tensors" in done.stdout
            if fmt == "safetensors":
                with safe_open(str(path), "np") as f:
                    meta = f.metadata()
                    tensors = {k: f.get_tensor(k) for k in f.keys()}
            else:
                with np.load(path, allow_pickle=False) as z:
                    tensors = {k: z[k] for k in z.files if k != "__metadata__"}
                    meta = json.loads(str(z["__metadata__"]))
            assert sorted(tensors) == ["a", "b", "c.bias"] and tensors["c.bias"].dtype == np.float64
            versions = json.loads(meta["raftps.tensor_versions"])
            assert versions["a"] == versions["b"] > 0
            assert np.array_equal(tensors["a"], tensors["b"]) and tensors["a"][0] == -versions["a"]
            assert meta["raftps.prefix"] == "m/" and int(meta["raftps.version"]) > 0
            assert json.loads(meta["raftps.optimizers"])["a"]["name"] == "sgd"
    finally:
        stop.set()
        thread.join(60)
    # With the pushes stopped, an export's version is the store's last entry: every replica reports
    # that version with the digest the file names.
    path = tmp_path / "quiet.safetensors"
    assert raftps(cluster, "export", "--prefix", "m/", str(path)).returncode == 0
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    rows = wait_converged(client, 3)
    assert {(r["version"], r["digest"]) for r in rows} == {(int(meta["raftps.version"]), meta["raftps.store_digest"])}


def test_import_round_trip_and_idempotent(cluster, client, tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((20, 30)).astype(np.float32)
    client.create_many({"src/w": w, "src/b": np.arange(5.0), "src10/x": np.ones(2)},
                       {n: {"name": "sgd", "lr": 0.5} for n in ("src/w", "src/b", "src10/x")})
    client.push({"src/w": np.ones_like(w)})
    for fmt in ("safetensors", "npz"):
        path = tmp_path / f"src.{fmt}"
        done = raftps(cluster, "export", "--prefix", "src", "--format", fmt, str(path))
        assert done.returncode == 0 and "exported 2 tensors" in done.stdout, done.stderr   # not src10/x
        dst = f"dst_{fmt}"
        done = raftps(cluster, "import", str(path), "--prefix", dst, "--optimizer", "adam,lr=0.001")
        assert done.returncode == 0, done.stderr
        assert "2 created, 0 already there" in done.stdout
        tensors, _ = client.pull([f"{dst}/w", f"{dst}/b"])
        assert np.array_equal(tensors[f"{dst}/w"], w - np.float32(0.5))
        assert np.array_equal(tensors[f"{dst}/b"], np.arange(5.0))
        meta = {t["name"]: t for t in client.tensors()}
        assert meta[f"{dst}/w"]["optimizer"]["name"] == "adam" and meta[f"{dst}/w"]["optimizer"]["lr"] == 0.001
        again = raftps(cluster, "import", str(path), "--prefix", dst, "--optimizer", '{"name": "adam", "lr": 0.001}')
        assert again.returncode == 0 and "0 created, 2 already there" in again.stdout, again.stderr
        clash = raftps(cluster, "import", str(path), "--prefix", dst, "--optimizer", "sgd,lr=0.1")
        assert clash.returncode == 1 and "TensorExists" in clash.stderr
        assert {t["name"]: t["optimizer"]["name"] for t in client.tensors()}[f"{dst}/w"] == "adam"


def test_torch_load_state_dict_round_trip(cluster, client, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    params = {f"job1/{n}": p.detach().numpy().copy() for n, p in model.named_parameters()}
    params["job1/_raftps/steps.rank0"] = np.zeros(1)                # raftps.torch's counter: not exported
    client.create_many(params, {n: {"name": "sgd", "lr": 0.1} for n in params})
    client.push({"job1/0.weight": np.ones((16, 8), np.float32)})
    path = tmp_path / "job1.safetensors"
    assert raftps(cluster, "export", "--prefix", "job1", str(path)).returncode == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fresh.load_state_dict(load_file(str(path)))                      # strict: the keys match exactly
    stored, _ = client.pull([f"job1/{n}" for n, _ in model.named_parameters()])
    for n, p in fresh.named_parameters():
        assert np.array_equal(p.detach().numpy(), stored[f"job1/{n}"])
    assert torch.allclose(fresh[0].weight, model[0].weight - 0.1)
    # and a torch-written file imports (torch's own save_file, float16 widened to float32)
    from safetensors.torch import save_file as torch_save
    half = tmp_path / "half.safetensors"
    torch_save({"w": torch.full((3,), 0.5, dtype=torch.float16)}, str(half))
    done = raftps(cluster, "import", str(half), "--prefix", "fromtorch", "--optimizer", "sgd,lr=1")
    assert done.returncode == 0, done.stderr
    got, _ = client.pull(["fromtorch/w"])
    assert got["fromtorch/w"].dtype == np.float32 and got["fromtorch/w"].tolist() == [0.5, 0.5, 0.5]


def _bf16_safetensors(path):
    """A valid safetensors file holding one bfloat16 tensor, written by hand (numpy has no bfloat16)."""
    header = json.dumps({"x": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x80\x3f\x00\x40")


def test_bad_input_is_refused_and_changes_nothing(cluster, client, tmp_path):
    client.create("keep/w", np.zeros(4, np.float32), {"name": "sgd", "lr": 1.0})
    before = client.tensors()
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"this is not a model file at all")
    ints = tmp_path / "ints.npz"
    np.savez(ints, w=np.zeros(3, np.float32), steps=np.arange(3))
    objects = tmp_path / "objects.npz"
    np.savez(objects, w=np.array([{"pickled": True}], dtype=object))      # needs pickle to load
    nan = tmp_path / "nan.safetensors"
    save_file({"w": np.array([1.0, np.nan], np.float32)}, str(nan))
    bf16 = tmp_path / "bf16.safetensors"
    _bf16_safetensors(bf16)
    badname = tmp_path / "badname.npz"
    np.savez(badname, **{"w x": np.zeros(2, np.float32)})
    empty = tmp_path / "empty.npz"
    np.savez(empty)
    good = tmp_path / "good.npz"
    np.savez(good, w=np.zeros(2, np.float32))
    cases = [
        (["export", "--prefix", "keep", "--format", "pickle", str(tmp_path / "x")], 2, "invalid choice: 'pickle'"),
        (["export", "--prefix", "nothing_here", str(tmp_path / "x")], 2, "no tensor named nothing_here/"),
        (["export", "--prefix", "", str(tmp_path / "x")], 2, "bad prefix ''"),
        (["import", str(tmp_path / "missing.safetensors"), "--prefix", "n", "--optimizer", "sgd,lr=1"], 2,
         "cannot read"),
        (["import", str(junk), "--prefix", "n", "--optimizer", "sgd,lr=1"], 2, "neither an npz archive nor"),
        (["import", str(ints), "--prefix", "n", "--optimizer", "sgd,lr=1"], 2, "'steps': 'int64'"),
        (["import", str(objects), "--prefix", "n", "--optimizer", "sgd,lr=1"], 2, "not a readable npz"),
        (["import", str(nan), "--prefix", "n", "--optimizer", "sgd,lr=1"], 2, "NaN/Inf"),
        (["import", str(bf16), "--prefix", "n", "--optimizer", "sgd,lr=1"], 2, "bfloat16"),
        (["import", str(badname), "--prefix", "n", "--optimizer", "sgd,lr=1"], 2, "not a valid tensor name"),
        (["import", str(empty), "--prefix", "n", "--optimizer", "sgd,lr=1"], 2, "holds no tensors"),
        (["import", str(good), "--prefix", "n", "--optimizer", "sgd"], 2, "needs 'lr'"),
        (["import", str(good), "--prefix", "n", "--optimizer", "rmsprop,lr=1"], 2, "unknown optimizer 'rmsprop'"),
        (["import", str(good), "--prefix", "n", "--optimizer", "{bad json"], 2, "not valid JSON"),
    ]
    for argv, code, message in cases:
        done = raftps(cluster, *argv)
        assert done.returncode == code and message in done.stderr, (argv, done.returncode, done.stderr)
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob("x.tmp*"))
    assert client.tensors() == before
