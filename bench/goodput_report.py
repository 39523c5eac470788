"""bench/goodput.py's measurements and report: pure functions of rank 0's metrics.csv rows
(examples/common.py's Metrics) and of the fault events, the ratios, goodput*.md/.json/.png. No
torch, no processes: tests/test_bench_goodput.py checks them on made-up curves. The store check
after a raftps run (``store_check_after``, ``unit_applied``) reads the cluster it is given."""
from __future__ import annotations

import csv
import json
import os
import time
from typing import Any

from .common import write_results

WORKERS = 4
BATCH, BLOCK = 32, 64                       # char_gpt.py's global batch and window
TOKENS_PER_BATCH = BATCH * BLOCK
WORKER_KILL_AT, LEADER_KILL_AT, TARGET_AT = 0.3, 0.6, 0.8
CHECKPOINT_COST = 0.05                      # (b)'s checkpoint interval: saving costs about this share
LABELS = {"ddp": "(a) DDP, no faults", "ddp-ckpt": "(b) DDP + checkpoint-restart",
          "torchft-ddp": "(c) torchft DDP", "torchft-diloco": "(c) torchft DiLoCo",
          "raftps-sync": "(d) raftps sync", "raftps-sync-overlap": "(d) raftps sync, overlap",
          "raftps-diloco": "(e) raftps DiLoCo",
          "raftps-diloco-async": "(f) raftps async DiLoCo"}
ACKED_ROUNDS = "rounds_acked.txt"           # raftps DiLoCo workers: "rank fragment round" per acknowledged round



# ---- reading a run: pure functions of metrics.csv rows (tests/test_bench_goodput.py) ----------

def read_rows(path: str) -> list[dict[str, float | None]]:
    """metrics.csv (examples/common.py's Metrics) as dicts: time, step, loss, val (None if not evaluated), unix."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [{"time": float(r["time"]), "step": int(r["step"]), "loss": float(r["loss"]),
                 "val": float(r["val_loss"]) if r["val_loss"] != "" else None, "unix": float(r["unix"])}
                for r in csv.DictReader(f) if r.get("unix")]


def batch_rows(rows: list[dict], completed: bool) -> list[dict]:
    """The rows that are computed batches: a completed run's last row repeats its last step for
    the final evaluation and is no batch."""
    if completed and len(rows) >= 2 and rows[-1]["step"] == rows[-2]["step"]:
        return rows[:-1]
    return rows


def recomputed(rows: list[dict]) -> int:
    """Batches rank 0 computed again: rows whose step it had already passed (a resume from a checkpoint)."""
    done, again = 0, 0
    for r in rows:
        again += r["step"] <= done
        done = max(done, r["step"])
    return again


def target_from(rows: list[dict], budget: int, at: float = TARGET_AT) -> float:
    """The ceiling's validation loss at ``at`` of the budget: its first evaluation at or past that step."""
    step = at * budget
    for r in rows:
        if r["val"] is not None and r["step"] >= step:
            return r["val"]
    raise ValueError(f"no evaluation at or after step {step:g} (of {budget})")


def reached(rows: list[dict], target: float) -> dict | None:
    """The first evaluated row at or below the target, with the batches computed up to it."""
    for i, r in enumerate(rows):
        if r["val"] is not None and r["val"] <= target:
            return {**r, "batches": i + 1}
    return None


def val_at(rows: list[dict], step: int) -> float | None:
    """The first evaluation at or past ``step`` (the budget), else None."""
    return next((r["val"] for r in rows if r["val"] is not None and r["step"] >= step), None)


def step_rate(rows: list[dict], until_unix: float | None) -> float | None:
    """Global batches per second over the rows before ``until_unix`` (the first fault; None: all),
    leaving out the first 10% of them (start-up)."""
    rows = [r for r in rows if until_unix is None or r["unix"] < until_unix]
    if len(rows) < 5:
        return None
    a, b = rows[len(rows) // 10], rows[-1]
    return (b["step"] - a["step"]) / (b["unix"] - a["unix"]) if b["unix"] > a["unix"] else None


def short_steps(kill_step: int | None, resume_step: int | None) -> int | None:
    """Batches the others took without the killed rank's part: from rank 0's step at the kill to the
    batch the restarted rank resumed at (an upper bound by one: the batch in flight at the kill may
    have had its part). None if it never came back."""
    if kill_step is None:
        return 0
    if resume_step is None:
        return None
    return max(0, resume_step - kill_step)


# how a fault's event text starts: the loopback bench's kills, the fleet bench's preemptions and coordinator loss
FAULT_EVENTS = ("SIGKILL", "preempt", "lose the coordinator")


def summarize(name: str, rows: list[dict], completed: bool, launch_unix: float, budget: int, target: float,
              events: list[tuple[float, str]], extra: dict[str, Any]) -> dict[str, Any]:
    """One configuration's report row from its metrics rows and fault events (unix, text)."""
    rows = batch_rows(rows, completed)
    hit = reached(rows, target)
    first_fault = min((u for u, text in events if text.startswith(FAULT_EVENTS)), default=None)
    evals = [r for r in rows if r["val"] is not None]
    out = {"config": name, "label": LABELS.get(name, name), "target": target, "budget": budget,
           "batches": len(rows), "last_step": rows[-1]["step"] if rows else 0,
           "wall_to_target_s": hit["unix"] - launch_unix if hit else None,
           "tokens_to_target": hit["batches"] * TOKENS_PER_BATCH if hit else None,
           "step_at_target": hit["step"] if hit else None,
           "val_at_budget": val_at(rows, budget), "final_val": evals[-1]["val"] if evals else None,
           "recomputed_steps": recomputed(rows), "steps_before_fault_per_s": step_rate(rows, first_fault),
           "first_step_s": rows[0]["unix"] - rows[0]["time"] - launch_unix if rows else None,
           "events": [(u - launch_unix, text) for u, text in events]}
    out.update(extra)
    return out


def store_check(applied: int | dict[str, int], versions: dict[str, int],
                acked: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Synchronous DiLoCo (or sync) through the kills: rounds 0..``applied`` applied, so every
    global tensor must have had exactly ``applied`` + 1 updates (none applied twice, none
    half-applied), and no round acknowledged to a worker (``acked``: rank, fragment, round) may lie
    past ``applied``. ``applied`` per tensor ({name: the last round its unit applied}): a round that
    applies in units (Raft groups, a sync step's chunks) may have applied in some units and not yet
    in others when the workers were stopped; an acknowledgement is checked against the lowest unit."""
    per = applied if isinstance(applied, dict) else {n: applied for n in versions}
    lowest = min(per.values(), default=-1)
    wrong = {n: v for n, v in sorted(versions.items()) if v != per.get(n, lowest) + 1}
    lost = sorted({r for _, _, r in acked if r > lowest})
    ok = bool(versions) and not wrong and not lost
    counts = sorted({per.get(n, lowest) + 1 for n in versions}) or [lowest + 1]
    times = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    verdict = (f"{lowest + 1} rounds applied, each of the {len(versions)} global tensors updated exactly {times} times"
               + ("" if len(counts) == 1 else " (each as often as its unit applied: a round in flight at the stop)")
               + f"; {len(acked)} acknowledgements (rounds up to {max((r for _, _, r in acked), default=-1)}), none "
               "past the store's last applied round" if ok else
               f"FAILED: {lowest + 1} rounds applied; tensors with another update count: {wrong}; acknowledged rounds "
               f"the store has not applied: {lost}" + ("; no global tensors found" if not versions else ""))
    return {"ok": ok, "rounds_applied": lowest + 1, "tensors": len(versions), "acknowledged": len(acked),
            "verdict": verdict}


def unit_applied(cluster: Any, job: str, prefix: str, chunk_bytes: int,
                 units: list | None = None) -> dict[str, int]:
    """{tensor: the last step (round) its unit applied}: a unit is one Raft group's chunk of a
    step (its whole part without chunks), with a step sequence of its own (client/job_steps.py's
    chunk_job). Each unit is read alone: a client told that the unit's job lives in that group.
    ``units``: [(group, chunk, names)] where the worker planned its own (overlap's stream plan)."""
    import numpy as np
    from raftps.client.job_steps import chunk_job, chunks
    if units is not None:
        out_units: dict[str, int] = {}
        for group, index, names in units:
            with cluster.client(timeout=60) as c:
                c.expect_chunks(chunk_job(job, index), {names[0]: ((1,), "float32")}, 0)
                applied = c.sync_applied(chunk_job(job, index))
            out_units.update({n: applied for n in names if "/_raftps" not in n})
        return out_units
    with cluster.client(timeout=60) as c:
        parts: dict[int, dict[str, Any]] = {}
        for row in c.tensors(prefix + "/"):
            if "/_raftps" not in row["name"]:
                parts.setdefault(c.group_of(row["name"]), {})[row["name"]] = \
                    np.broadcast_to(np.zeros((), row["dtype"]), tuple(row["shape"]))
    out: dict[str, int] = {}
    for group, part in sorted(parts.items()):
        with cluster.client(timeout=60) as c:
            for i, names in enumerate(chunks(part, chunk_bytes)):
                unit = chunk_job(job, i)
                c.expect_chunks(unit, {names[0]: (part[names[0]].shape, part[names[0]].dtype.str)}, 0)
                applied = c.sync_applied(unit)
                out.update({n: applied for n in names})
    return out


# ---- report ---------------------------------------------------------------------------------

def store_check_after(name: str, cluster: Any, prefix: str, out: str, rows: list[dict], chunk_bytes: int) -> dict[str, Any]:
    """Nothing acknowledged lost or applied twice: synchronous DiLoCo's rounds (the workers'
    acknowledged rounds against the store's), sync's steps (rank 0's logged steps, each one
    acknowledged to it, against the store's applied steps); every tensor updated once per step
    its unit (Raft group, chunk) applied."""
    from raftps import jobs
    if name == "raftps-diloco":
        job, chunk_bytes = jobs.diloco_job(prefix, 0, 1), 0
        acked_path = os.path.join(out, ACKED_ROUNDS)
        lines = open(acked_path).read().split("\n") if os.path.exists(acked_path) else []
        acked = [tuple(map(int, line.split())) for line in lines if line.strip()]
    else:
        job = jobs.job_name(prefix)
        acked = [(0, 0, int(r["step"]) - 1) for r in rows]
    units_file = os.path.join(out, "stream_units.json")      # overlap: rank 0's stream plan (examples/common.py)
    units = json.load(open(units_file)) if os.path.exists(units_file) else None

    def read() -> tuple[dict[str, int], dict[str, int]]:
        applied = unit_applied(cluster, job, prefix, chunk_bytes, units)
        with cluster.client(timeout=60) as c:
            versions = {n: v for n, v in c.export(prefix + "/")["tensor_versions"].items() if "/_raftps" not in n}
        return applied, versions
    # A sync step the stopped workers left partly sent still applies, unit by unit (a unit once
    # its last contribution is in, or step_timeout after its latest): a read between a unit's
    # applied step and its tensors' versions would see the one before and the other after. So
    # the store is read until two reads STORE_QUIET_S apart agree (bounded), as it is at rest.
    seen = read()
    for _ in range(3):
        time.sleep(STORE_QUIET_S)
        again = read()
        if again == seen:
            break
        seen = again
    return store_check(seen[0], seen[1], acked)


STORE_QUIET_S = 12.0       # a sync step's default step_timeout (10 s), and some


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 30's goodput targets: raftps DiLoCo's wall time to the target against (b) and (c)."""
    by = {r["config"]: r for r in results if "error" not in r and "skipped" not in r}
    out = []
    for ours in ("raftps-diloco", "raftps-diloco-async", "raftps-sync"):
        for theirs, limit in (("ddp-ckpt", 0.7), ("torchft-ddp", 1.0), ("torchft-diloco", 1.0)):
            a, b = by.get(ours), by.get(theirs)
            if a is None or b is None:
                continue
            ta, tb = a["wall_to_target_s"], b["wall_to_target_s"]
            ratio = ta / tb if ta is not None and tb is not None else None
            out.append({"what": f"{LABELS[ours]} / {LABELS[theirs]}, wall time to target", "ratio": ratio,
                        "limit": limit if ours == "raftps-diloco" else None,
                        "met": None if ours != "raftps-diloco" else (ratio is not None and ratio <= limit)})
    return out


def write_report(results: list[dict[str, Any]], meta: dict[str, Any], out: str) -> str:
    """goodput.{md,json,png} (quick: goodput_quick.*)."""
    sfx = ("" if meta["mode"] == "full" else "_quick") + meta.get("suffix", "")
    os.makedirs(out, exist_ok=True)
    png = plot(results, os.path.join(out, f"goodput{sfx}.png"), meta)
    target = next((r["target"] for r in results if "target" in r), None)
    lines = [f"# Goodput under faults: char GPT x{WORKERS}, {meta['budget']} global batches "
             f"({meta['budget'] * TOKENS_PER_BATCH:,} tokens)", "",
             f"`{meta['command']}`, {meta['date']}, commit {meta['commit']}, {meta['machine']}, torch {meta['torch']}, "
             f"torchft {meta['torchft']}. `uptime` at the start: `{meta['uptime_start']}`; at the end: "
             f"`{meta['uptime_end']}`. **Taken on a loaded, shared 2-core machine**: every worker of every "
             "configuration shares those cores with other people's work, so times are noisy; compare within this run.",
             "",
             f"Faults: a worker SIGKILLed at {WORKER_KILL_AT:.0%} of the budget (its launcher starts it again), the "
             f"store's leader SIGKILLed at {LEADER_KILL_AT:.0%} (raftps only). Target: (a)'s validation loss at "
             f"{TARGET_AT:.0%} of the budget = **{_f(target, '.4f')}**. Wall time counts from the launch (process "
             "start, imports, rendezvous included); tokens count every batch computed, recomputed ones too. "
             f"A run stops past the budget once it has reached the target, at the latest at {2 * meta['budget']} batches.",
             "",
             "| configuration | wall s to target | tokens to target | val loss at budget | final val loss "
             "(at batch) | recomputed steps | steps short of the killed worker | bytes/token | steps/s before faults "
             "| launcher |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['label']} | {'skipped' if 'skipped' in r else 'failed'}: {r.get('skipped') or r['error']} "
                         "| | | | | | | | |")
            continue
        tokens = f"{r['tokens_to_target']:,}" if r["tokens_to_target"] is not None else "not reached"
        lines.append(f"| {r['label']} | {_f(r['wall_to_target_s'], '.1f') if r['wall_to_target_s'] else 'not reached'} "
                     f"| {tokens} | {_f(r['val_at_budget'], '.4f')} | {_f(r['final_val'], '.4f')} ({r['last_step']}) | "
                     f"{r['recomputed_steps']} | {_f(r['short_steps'], 'd')} | {_f(r['bytes_per_token'], ',.0f')} "
                     f"({r['bytes_how']}) | {_f(r['steps_before_fault_per_s'])} | {r['launcher']} |")
    lines += ["", "Ratios (issue 30's targets apply to raftps DiLoCo: <= 0.7x of (b), <= 1.0x of (c)):", "",
              "| ratio | value | target |", "|---|---|---|"]
    for t in ratios(results):
        verdict = "" if t["met"] is None else ("met" if t["met"] else "NOT met")
        lines.append(f"| {t['what']} | {_f(t['ratio'])} | {verdict} |")
    lines += ["", "How each ran:", ""] + [f"- {r['label']}: {note(r, meta)}" for r in results
                                           if "skipped" not in r and "error" not in r]
    checks = [f"- {r['label']}: {r['store_check']['verdict']}." for r in results if r.get("store_check")]
    if checks:
        lines += ["", "No acknowledged round lost or applied twice through the kills (the store read after the run):",
                  ""] + checks
    lines += ["", f"![validation loss against wall time]({os.path.basename(png)})", ""]
    return write_results(out, f"goodput{sfx}", {"meta": meta, "results": results, "ratios": ratios(results)},
                        "\n".join(lines))


def note(r: dict[str, Any], meta: dict[str, Any]) -> str:
    """What a configuration's figures mean, in one line."""
    diloco = (f"H = {r.get('sync_every')}, inner Adam (lr {meta.get('lr')}, as DDP's), "
              + ("outer Nesterov momentum SGD (lr 0.7, momentum 0.9)" if r.get("outer") == "nesterov" else
                 "outer plain averaging (SGD lr 1.0)"))
    return {
        "ddp": f"torchrun, gloo all-reduce, torch.optim.Adam (lr {meta.get('lr')}); the target is its validation loss at "
               f"{TARGET_AT:.0%} of the budget.",
        "ddp-ckpt": f"rank 0 torch.saves model, Adam state and step every {r.get('checkpoint_every')} batches "
                    f"(one save took {_f(r.get('checkpoint_save_ms'), '.0f')} ms against (a)'s "
                    f"{_f(r.get('step_ms_of_a'), '.0f')} ms step: about {CHECKPOINT_COST:.0%}); torchrun restarts "
                    "all 4 ranks, which load the checkpoint; the process group is built on a store prefix per "
                    "restart (examples/common.py, init_gloo), without which the restarted group fails in "
                    "init_process_group (Gloo connectFullMesh failed ... Connection refused).",
        "torchft-ddp": "torchft.Optimizer over Adam; one manager.allreduce of the flattened gradients per step, "
                       "waited before the step (bench/goodput_worker.py, flat_allreduce): "
                       "torchft's PureDistributedDataParallel never waits on CPU, so its averaging never ran, and its "
                       "DistributedDataParallel raised AssertionError at ddp.py:76 in the surviving replica groups "
                       "once a peer was SIGKILLed; short steps: steps committed with fewer than 4 participants "
                       "(rank 0's manager.num_participants()).",
        "torchft-diloco": f"torchft.local_sgd.DiLoCo, {diloco}; synchronous quorum (its train_diloco.py); "
                          "short steps: rounds committed with fewer than 4 participants.",
        "raftps-sync": f"raftps.torch sync, Adam in the store (lr {meta.get('lr')}, as DDP's), step_timeout 10 s: a step waits that "
                       "long for a dead rank; short steps: an upper bound by one (from rank 0's step at the kill "
                       "to the restarted rank's first batch).",
        "raftps-diloco": f"raftps.torch mode='diloco', {diloco} in the store.",
        "raftps-diloco-async": f"raftps.torch mode='diloco-async', H = {r.get('sync_every')}, inner Adam (lr "
                               f"{meta.get('lr')}, as DDP's), the asynchronous default outer "
                               "step in the store (averaging: SGD lr 1.0), staleness-aware.",
    }.get(r["config"], "")


def plot(results: list[dict[str, Any]], png: str, meta: dict[str, Any]) -> str:
    """Validation loss against wall time since launch, faults as dotted lines in the run's colour."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 5.5))
    target = next((r["target"] for r in results if "target" in r), None)
    for i, r in enumerate(x for x in results if x.get("curve")):
        colour = f"C{i}"
        ax.plot([t for t, _ in r["curve"]], [v for _, v in r["curve"]], marker=".", color=colour, label=r["label"])
        for t, text in r.get("events", []):
            if text.startswith("SIGKILL"):
                ax.axvline(t, color=colour, linestyle=":" if "worker" in text else "--", linewidth=1)
    starts = [r["curve"][0][1] for r in results if r.get("curve")]
    if starts:     # a diverging run would squash the others: cut the axis a little above the first evaluation
        ax.set_ylim(top=max(starts) + 0.3)
    if target is not None:
        ax.axhline(target, color="black", linewidth=0.8, label=f"target {target:.3f}")
    ax.plot([], [], color="grey", linestyle=":", label="worker SIGKILL")
    ax.plot([], [], color="grey", linestyle="--", label="store leader SIGKILL")
    ax.set(xlabel="seconds since launch", ylabel="validation loss (axis cut above the start)",
           title=f"char GPT x{WORKERS}, {meta['budget']} global batches, faults at "
                 f"{WORKER_KILL_AT:.0%} / {LEADER_KILL_AT:.0%} ({meta['mode']}; loaded machine)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
