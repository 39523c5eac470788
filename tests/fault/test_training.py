"""Training under faults: async Downpour on digits while a node is SIGKILLed every few seconds
reaches the same test-accuracy bar as a fault-free run, and the run's events show the kills."""
import json
import os
import random
import subprocess
import sys
import time

from tests.conftest import start_cluster

ARGS = ["--workers", "4", "--mode", "async", "--model", "softmax", "--optimizer", "sgd",
        "--epochs", "40", "--lr", "0.3", "--seed", "3", "--max-time", "150"]


def train(out: str, cluster) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", "train", "--cluster", cluster.addresses, "--out", out,
                             "--prefix", os.path.basename(out), *ARGS],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **cluster.client_env})


def summary(out: str) -> dict:
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def test_async_training_survives_a_node_killed_every_few_seconds(tmp_path) -> None:
    cluster = start_cluster(tmp_path / "run", 8700)
    rng = random.Random(5)
    kills = []
    try:
        calm = train(str(tmp_path / "calm"), cluster)
        assert calm.wait(timeout=180) == 0
        faulty = train(str(tmp_path / "faulty"), cluster)
        deadline = time.monotonic() + 170
        while faulty.poll() is None and time.monotonic() < deadline and len(kills) < 12:
            time.sleep(1.0)
            victim = rng.randint(1, 3)
            if faulty.poll() is not None:
                break
            cluster.kill(victim)
            kills.append(victim)
            time.sleep(1.0)
            cluster.start_node(victim)
        assert faulty.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        for proc in [p for p in (locals().get("calm"), locals().get("faulty")) if p is not None]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        cluster.wipe()
    calm_s, faulty_s = summary(str(tmp_path / "calm")), summary(str(tmp_path / "faulty"))
    print(f"case=training-under-kills kills={len(kills)} calm_acc={calm_s['final_test_acc']:.4f} "
          f"faulty_acc={faulty_s['final_test_acc']:.4f} updates={faulty_s['updates']} "
          f"wall_s={faulty_s['wall_s']:.1f} calm_wall_s={calm_s['wall_s']:.1f} "
          f"node_events={sum(e.startswith('node ') for e in faulty_s['events'])}")
    assert len(kills) >= 3, "the run ended before the nemesis could kill anything"
    assert any(e.endswith(" down") for e in faulty_s["events"]), "the run's events do not show the kills"
    # Exactly once through the kills: the store applied each acknowledged push, and nothing else.
    assert faulty_s["worker_restarts"] == 0 and faulty_s["updates"] == sum(faulty_s["acked_pushes"]), faulty_s
    assert faulty_s["final_test_acc"] >= calm_s["final_test_acc"] - 0.02
    assert faulty_s["final_test_acc"] >= 0.9
