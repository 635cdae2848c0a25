"""What a preemption costs, measured on the local cluster (``bridge-cluster up``). Table + JSON.

- signal-to-exit latency: ``scancel --signal=USR1`` -> checkpoint durable (the tracker file names the
  new iteration) -> the job step gone; against one step plus one save, the least it can take;
- steps lost per preemption (target 0): from the progress log, and checked against the metrics;
- restart overhead: start-up seconds to the first step of each requeued run against the first run's;
- goodput of a run preempted every N steps (bridge-report's totals: training over allocated time;
  the requeue hold between allocations is queue time and not counted as allocated).

Figures are ratios within one run; the machine is noisy. Run: ``python benchmarks/preemption.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bridge_test_helpers import drive, steps_done, submit, wait_running_past  # noqa: E402

from bridge_hpc.report.progress import parse_progress  # noqa: E402


def step_gone(job_id: str) -> bool:
    """True once the job's training step (srun) is no longer running."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], capture_output=True, text=True).stdout
    return not any(line.strip().endswith(".0") for line in out.splitlines())


def tracker_iteration(run_dir: Path) -> int:
    try:
        return int((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return -1


def preempt_every(run_dir: Path, iters: int, every: int) -> dict:
    """Train ``iters`` steps, sending USR1 each time ``every`` more steps are done; time each exit."""
    job_id = submit(run_dir, iters)
    exits = []
    target = every
    while target < iters:
        wait_running_past(job_id, run_dir, target)
        before = tracker_iteration(run_dir)
        t0 = time.time()
        subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
        durable = gone = None
        while gone is None and time.time() - t0 < 120:
            if durable is None and tracker_iteration(run_dir) != before:
                durable = time.time() - t0
            if step_gone(job_id):
                gone = time.time() - t0
            time.sleep(0.02)
        exits.append({"at_step": steps_done(run_dir), "durable_s": durable, "gone_s": gone})
        print(f"  preempted at step {exits[-1]['at_step']}: checkpoint durable after {durable:.2f} s, "
              f"ranks gone after {gone:.2f} s", flush=True)
        target = steps_done(run_dir) + every
    state = drive(job_id)
    runs = parse_progress(str(run_dir / "checkpoints" / "progress.txt"))
    report = json.loads(subprocess.run([sys.executable, "-m", "bridge_hpc.cli.report", str(run_dir), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(m["step_time_s"] for m in metrics)
    saves = [float(e.fields["Save seconds"]) for r in runs for e in r.of("Saved checkpoint") if "Save seconds" in e.fields]
    startups = [float(r.last("First step").fields["Start-up seconds"]) for r in runs if r.last("First step")]
    lost = [int(r.last("Ending job").fields["Steps lost"]) for r in runs[:-1] if r.last("Ending job")]
    return {"job_id": job_id, "state": state, "every": every, "iters": iters, "exits": exits,
            "step_s": step_s, "save_s": statistics.median(saves) if saves else None, "startup_s": startups,
            "lost_steps": lost, "steps_logged": sorted(m["step"] for m in metrics) == list(range(1, iters + 1)),
            "goodput": report["totals"]["goodput"], "runs": report["totals"]["runs"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--every", type=int, nargs="+", default=[150, 300])
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "preemption.json"))
    args = p.parse_args()
    results = []
    work = Path(tempfile.mkdtemp(prefix="bridge-preemption-"))
    for every in args.every:
        print(f"preempting every {every} steps of {args.iters} ...", flush=True)
        results.append(preempt_every(work / f"every-{every}", args.iters, every))
    print()
    print(f"{'preempted every':>15} {'runs':>5} {'signal->durable s':>18} {'signal->gone s':>15} "
          f"{'step+save s':>12} {'lost steps':>11} {'first start-up s':>17} {'restart start-up s':>19} {'goodput':>8}")
    for r in results:
        durable = statistics.median(e["durable_s"] for e in r["exits"])
        gone = statistics.median(e["gone_s"] for e in r["exits"])
        restart = statistics.median(r["startup_s"][1:]) if len(r["startup_s"]) > 1 else float("nan")
        print(f"{r['every']:>15} {r['runs']:>5} {durable:>18.2f} {gone:>15.2f} {r['step_s'] + (r['save_s'] or 0):>12.2f} "
              f"{sum(r['lost_steps']):>11} {r['startup_s'][0]:>17.1f} {restart:>19.1f} {r['goodput']:>8.1%}")
        assert r["state"] == "COMPLETED" and r["steps_logged"], r
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
