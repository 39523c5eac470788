"""The PyTorch demo: a character GPT trained by 4 workers against a 3-node raftps cluster while
the store's leader is SIGKILLed and then one worker is SIGKILLed. Prints the final validation
loss and the plot's path.

    python examples/torchrun_demo.py [--workers 4] [--steps 300] [--mode sync] [--launch per-rank]

Launches (``--launch``): ``per-rank`` starts one process per worker and restarts a dead one
alone, while the others keep training (they share no process group); ``torchrun`` is one
``torchrun --max-restarts 3``, which stops every worker when one dies and starts the whole group
again. Either way every worker resumes from the store.
"""
from __future__ import annotations

import csv
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))          # raftps from this checkout when run as a script

from raftps.chaos.torchrun import TorchrunJob, train_through_kills  # noqa: E402
from raftps.cli import OneLineParser  # noqa: E402
from raftps.launch import PerRankJob  # noqa: E402
from raftps.localcluster import LocalCluster  # noqa: E402


def main() -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])       # cluster/demo-torch.sh's flags
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300, help="global batches (char_gpt.py --steps)")
    ap.add_argument("--mode", default="sync", choices=["sync", "async", "ssp", "easgd", "diloco", "diloco-async"],
                    help="raftps mode (default sync: the best validation loss at 300 batches here)")
    ap.add_argument("--sync-every", type=int, default=20, help="diloco: inner steps per round")
    ap.add_argument("--launch", default="per-rank", choices=["per-rank", "torchrun"],
                    help="per-rank: a dead worker restarts alone; torchrun: the whole group restarts")
    ap.add_argument("--out", default="runs/torch-demo")
    ap.add_argument("--base-port", type=int, default=7700)
    ap.add_argument("--timeout", type=float, default=1200.0, help="give up after this many seconds")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    for stale in ("metrics.csv", "summary.json"):          # a new job: not a resumed one
        if os.path.exists(os.path.join(out, stale)):
            os.remove(os.path.join(out, stale))
    prefix = "gpt-demo"
    script_args = ["--backend", "raftps", "--mode", args.mode, "--prefix", prefix, "--steps", str(args.steps),
                   "--out", out, "--sync-every", str(args.sync_every)]
    diloco = args.sync_every if args.mode.startswith("diloco") else None
    run_dir = tempfile.mkdtemp(prefix="raftps-torch-demo.")
    cluster = LocalCluster(run_dir, nodes=3, base_port=args.base_port)
    print(f"== starting a 3-node cluster in {run_dir}", flush=True)
    cluster.start()
    try:
        script = os.path.join(HERE, "char_gpt.py")
        if args.launch == "torchrun":
            print(f"== torchrun --nproc-per-node {args.workers} --max-restarts 3 examples/char_gpt.py "
                  f"{' '.join(script_args)}  (log: {out}/torchrun.log)", flush=True)
            job = TorchrunJob(script, script_args, args.workers, 3, cluster.client_env,
                              os.path.join(out, "torchrun.log"), args.base_port + 290)
        else:
            print(f"== {args.workers} worker processes, each restarted alone if it dies: examples/char_gpt.py "
                  f"{' '.join(script_args)}  (logs: {out}/rank*.log)", flush=True)
            job = PerRankJob([sys.executable, script, *script_args], args.workers, cluster.client_env, out)
        try:
            run = train_through_kills(cluster, job, prefix, args.workers, args.steps, timeout=args.timeout,
                                      sync_every=diloco)
        finally:
            job.stop()
    finally:
        cluster.stop()
        cluster.wipe()
    if run.exit_code != 0:
        raise SystemExit(f"the job failed (exit {run.exit_code}); see the logs in {out}")
    with open(os.path.join(out, "events.json"), "w") as f:
        json.dump(run.events, f)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "metrics.csv"), newline="") as f:
        first = next(csv.DictReader(f))
    t0 = float(first["unix"]) - float(first["time"])          # the job's first training step
    kills = [(unix - t0, text.split(" at ")[0].replace("SIGKILL ", "kill ")) for unix, text in run.events
             if text.startswith("SIGKILL")]
    sys.path.insert(0, HERE)
    from plot import plot_runs
    png = plot_runs(os.path.join(out, "plot.png"), [out], events=kills,
                    title=f"char GPT, raftps {args.mode} x{args.workers} ({args.launch})")
    restarted = ("the killed worker alone was restarted" if args.launch == "per-rank"
                 else "torchrun restarted the whole worker group")
    print(f"== final validation loss {summary['final_val_loss']:.4f} after {args.steps} global batches "
          f"({restarted}; rank 0 last started at step {summary['start_step']}); plot: {png}")


if __name__ == "__main__":
    main()
