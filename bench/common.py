"""Helpers shared by the benchmarks: child processes (and running N client workers in step),
statistics, RSS sampling, progress, the machine's description."""
from __future__ import annotations

import json
import os
import platform
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

KiB = 1024
MiB = 1024 * 1024
MB = 1e6


def log(msg: str) -> None:
    """Progress line on stderr, time-stamped, so long runs show where they are."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def seconds_for(duration: float | dict[int, float], size: int) -> float:
    """A point's length: one for every size, or per size (``{size: seconds}``, 0 the default)."""
    return duration.get(size, duration[0]) if isinstance(duration, dict) else duration


def size_label(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for an empty list."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def stop_pid(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop one child we started: SIGTERM, wait ``grace`` s, then SIGKILL; always reaped."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=grace)


def read_status_kb(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM and the RSS split (RssAnon, RssFile: e.g. the mmapped Raft journal, RssShmem)
    of a process from /proc/PID/status, in KiB ({} if it is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:", "RssShmem:")):
                    key, val = line.split(":", 1)
                    out[key] = int(val.split()[0])
    except OSError:
        pass
    return out


@dataclass
class RssSampler:
    """Samples VmRSS (and VmHWM) of some PIDs every ``period`` s in a thread; keeps the maximum."""
    pids: list[int]
    period: float = 0.2
    peak_rss_kb: dict[int, int] = field(default_factory=dict)
    hwm_kb: dict[int, int] = field(default_factory=dict)
    split_kb: dict[int, dict[str, int]] = field(default_factory=dict)   # the split at each PID's peak
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> "RssSampler":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sample()

    def _sample(self) -> None:
        for pid in self.pids:
            st = read_status_kb(pid)
            if "VmRSS" in st and st["VmRSS"] >= self.peak_rss_kb.get(pid, 0):
                self.peak_rss_kb[pid] = st["VmRSS"]
                self.split_kb[pid] = {k: v for k, v in st.items() if k.startswith("Rss")}
            if "VmHWM" in st:
                self.hwm_kb[pid] = st["VmHWM"]

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process from /proc/PID/stat ((0, 0) if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tck = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tck, int(fields[12]) / tck
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    return sum(cpu_times(pid))


def worker_cmd(args: dict[str, Any]) -> list[str]:
    """Command line of one client worker process (bench/worker.py) with its JSON arguments."""
    return [sys.executable, "-m", "bench.worker", json.dumps(args)]


def write_results(out: str, name: str, data: Any, md: str | Callable[[], str]) -> str:
    """A bench's two result files in ``out`` (made if missing): NAME.json (``data``) first, so a
    bug in the report (``md``, text or a function making it) loses no run, then NAME.md; returns
    the text."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    text = md() if callable(md) else md
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text)
    return text


def machine() -> str:
    """The machine a result was measured on, for a report's meta."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, {platform.platform()}"


def _readline(proc: subprocess.Popen, deadline: float) -> str:
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
        if r:
            return proc.stdout.readline().decode()
        if proc.poll() is not None:
            return proc.stdout.readline().decode()
    return ""


def run_workers(arg_list: list[dict[str, Any]], setup_timeout: float = 60.0) -> dict[str, Any]:
    """Start one process per args, release them together, collect and merge their results.

    Throughput counts operations that completed; the window runs from GO to the last completion.
    """
    procs = [subprocess.Popen(worker_cmd(a), stdin=subprocess.PIPE, stdout=subprocess.PIPE) for a in arg_list]
    try:
        deadline = time.monotonic() + setup_timeout
        for p in procs:
            if _readline(p, deadline).strip() != "READY":
                raise RuntimeError(f"worker {p.pid} did not get ready (exit {p.poll()})")
        for p in procs:
            p.stdin.write(b"GO\n")
            p.stdin.flush()
        results = []
        for p, a in zip(procs, arg_list):
            line = _readline(p, time.monotonic() + a["duration"] + a["timeout"] + 10)
            if not line:
                raise RuntimeError(f"worker {p.pid} gave no result")
            results.append(json.loads(line))
    finally:
        for p in procs:
            stop_pid(p)
    lat = [x for r in results for x in r["lat"]]
    ok = sum(r["ok"] for r in results)
    window = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
    return {"ok": ok, "errors": sum(r["errors"] for r in results), "seconds": window,
            "ops_per_s": ok / window if window > 0 else 0.0, "lat": lat,
            "client_cpu_s": sum(r.get("cpu", 0.0) for r in results)}


def summarize(res: dict[str, Any], size: int) -> dict[str, Any]:
    """Throughput and latency figures of one merged worker run (see run_workers)."""
    return {"ok": res["ok"], "errors": res["errors"], "seconds": round(res["seconds"], 3),
            "ops_per_s": res["ops_per_s"], "MB_per_s": res["ops_per_s"] * size / 1e6,
            "p50_ms": percentile(res["lat"], 50) * 1e3, "p99_ms": percentile(res["lat"], 99) * 1e3}
