"""The state machine's optimizer step against the textbook expressions it must equal, bit for bit.

``python -m bench.optim_apply [--mib 4] [--reps 7]``: for each optimizer, the time of one
``raftps.optim.step`` on a float32 tensor of ``--mib`` MiB, against ``textbook_step`` (each formula
as one numpy expression, a new array per operation: what the store computed before it wrote into
fewer arrays), both measured in this run (best of ``--reps`` batches). Writes
bench/results/optim_apply.md and .json. ``tests/test_optim.py`` checks that the two give the same
bits, so the baseline is the same computation done the plain way.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import numpy as np

from raftps import optim

from .common import log, write_results

SPECS = [{"name": "sgd", "lr": 0.01}, {"name": "momentum", "lr": 0.01, "nesterov": True},
         {"name": "adagrad", "lr": 0.01}, {"name": "adam", "lr": 1e-3},
         {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1}]


def textbook_step(spec: dict, param: np.ndarray, grad: np.ndarray, state: dict,
                  ctx: optim.Context = optim.NO_CONTEXT) -> tuple[np.ndarray, dict]:
    """The optimizers of raftps.optim (not adarevision or elastic) as one expression each."""
    t = param.dtype.type
    lr_float = spec["lr"] / max(1, ctx.staleness) if spec["staleness_aware"] else spec["lr"]
    lr = t(lr_float)
    name = spec["name"]
    steps = state.get("step", 0) + 1
    if spec.get("maximize"):
        grad = -grad
    if name == "adamw":
        if spec["weight_decay"]:
            param = param * t(1.0 - lr_float * spec["weight_decay"])
    elif spec["weight_decay"]:
        grad = grad + t(spec["weight_decay"]) * param
    if name == "sgd":
        return param - lr * grad, state
    if name == "momentum":
        mu, dampening = t(spec["momentum"]), spec.get("dampening", 0.0)
        if dampening and steps == 1:
            velocity = grad
        elif dampening:
            velocity = mu * state["velocity"] + t(1.0 - dampening) * grad
        else:
            velocity = mu * state["velocity"] + grad
        direction = grad + mu * velocity if spec["nesterov"] else velocity
        return param - lr * direction, {"velocity": velocity, "step": steps}
    if name == "adagrad":
        acc = state["accumulator"] + grad * grad
        return param - lr * grad / (np.sqrt(acc) + t(spec["eps"])), {"accumulator": acc, "step": steps}
    if name not in ("adam", "adamw"):
        raise ValueError(f"no textbook form here for {name!r}")
    b1, b2 = spec["beta1"], spec["beta2"]
    m = t(b1) * state["m"] + t(1.0 - b1) * grad
    v = t(b2) * state["v"] + t(1.0 - b2) * (grad * grad)
    beta1_t, beta2_t = state["beta1_t"] * b1, state["beta2_t"] * b2
    out = {"m": m, "v": v, "beta1_t": beta1_t, "beta2_t": beta2_t, "step": steps}
    second = v
    if spec.get("amsgrad"):
        second = out["v_max"] = np.maximum(state["v_max"], v)
    m_hat, v_hat = m / t(1.0 - beta1_t), second / t(1.0 - beta2_t)
    return param - lr * m_hat / (np.sqrt(v_hat) + t(spec["eps"])), out


def _best(fn: Callable[[], Any], reps: int, batch: int) -> float:
    """Seconds per call: the best of ``reps`` batches of ``batch`` calls."""
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        best = min(best, (time.perf_counter() - start) / batch)
    return best


def measure(mib: int = 4, reps: int = 7, batch: int = 10) -> list[dict]:
    rng = np.random.default_rng(0)
    n = (mib << 20) // 4
    param = rng.standard_normal(n).astype(np.float32)
    grad = rng.standard_normal(n).astype(np.float32)
    rows = []
    for raw in SPECS:
        spec = optim.normalize(raw)
        state = optim.init_state(spec, param)
        store_s = _best(lambda: optim.step(spec, param, grad, state), reps, batch)
        textbook_s = _best(lambda: textbook_step(spec, param, grad, state), reps, batch)
        rows.append({"optimizer": spec["name"], "mib": mib, "store_ms": 1e3 * store_s,
                     "textbook_ms": 1e3 * textbook_s, "speedup": textbook_s / store_s})
        log(f"optim {spec['name']}: {1e3 * store_s:.2f} ms per {mib} MiB step, textbook {1e3 * textbook_s:.2f} ms "
            f"({textbook_s / store_s:.2f}x)")
    return rows


def report(rows: list[dict]) -> str:
    lines = ["# Optimizer step: the state machine's against the textbook expressions", "",
             f"One step on a float32 tensor of {rows[0]['mib']} MiB, best of the batches of one run "
             "(`python -m bench.optim_apply`); the same bits either way (tests/test_optim.py).", "",
             "| optimizer | store ms | textbook ms | textbook / store |", "|---|---|---|---|"]
    lines += [f"| {r['optimizer']} | {r['store_ms']:.2f} | {r['textbook_ms']:.2f} | {r['speedup']:.2f}x |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.optim_apply", description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args()
    rows = measure(a.mib, a.reps)
    print(write_results(a.out, "optim_apply", {"time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows},
                       lambda: report(rows)))


if __name__ == "__main__":
    main()
