"""Make the README's report image: the demo preempted once, as ``bridge-report --plot`` draws it.

    python scripts/report_image.py [--out docs/report.png] [--run-dir runs/report-image]

Needs the local cluster (``bridge-cluster up``). It submits the demo (configs/local-tiny.toml) with more
steps than the demo's 40, so that the curves have something to show, waits until the job has trained
past :data:`PREEMPT_AT`, and preempts it the way Slurm warns a job before a preemption or its time
limit: ``scancel --signal=USR1``. The ranks checkpoint, the batch script requeues the job, and the next
run resumes from that checkpoint. The local cluster holds a requeued job for about 120 s
(Reason=BeginTime); the script releases it at once, as the tests do. When the job has completed it writes
the figure with ``bridge-report RUN_DIR --plot OUT`` and prints the report table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from bridge_hpc.contracts.run_folder import RunFolder
from bridge_hpc.local_slurm.cluster import release_requeued
from bridge_hpc.slurm.query import job_finished, job_runs, live_state

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "local-tiny.toml"
TRAIN_ITERS = 300
PREEMPT_AT = 120
#: Overrides of the demo config: more steps, an evaluation and a checkpoint often enough to see.
OVERRIDES = [f"train.train_iters={TRAIN_ITERS}", "train.eval_interval=25", "checkpoint.save_interval=50",
             "logger.log_interval=25"]
TIMEOUT_S = 900


def steps_done(run_dir: Path) -> int:
    """The newest step in the run's metrics.jsonl (0 before the first; a line being written is skipped)."""
    path = Path(RunFolder(str(run_dir)).metrics)
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return max(steps, default=0)


def release_when_held(job_id: str) -> None:
    state = live_state(job_id)
    if state and state[0] == "PENDING" and "BeginTime" in state[1]:
        release_requeued(job_id)


def wait(job_id: str, run_dir: Path, until_step: Optional[int]) -> str:
    """Until the job runs past ``until_step`` (returns "RUNNING"), or, with None, until it has finished
    (returns its final state); prints a line when the state or the step changes."""
    deadline, shown = time.time() + TIMEOUT_S, None
    while time.time() < deadline:
        release_when_held(job_id)
        live = live_state(job_id)
        runs = job_runs(job_id)
        state = live[0] if live else (runs[-1].state if runs else "?")
        step = steps_done(run_dir)
        if (state, step) != shown:
            print(f"  job {job_id}: {state}, step {step}", flush=True)
            shown = (state, step)
        if until_step is not None and state == "RUNNING" and step >= until_step:
            return state
        if live is None and runs and job_finished(runs[-1].state):
            if until_step is not None:
                raise SystemExit(f"job {job_id} ended ({runs[-1].state}) before step {until_step}")
            return runs[-1].state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id])
    raise SystemExit(f"job {job_id} did not finish in {TIMEOUT_S} s: cancelled")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "report.png"), help="the PNG to write")
    parser.add_argument("--run-dir", default=str(ROOT / "runs" / "report-image"), help="a new run folder")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir).absolute()
    if run_dir.exists():
        print(f"error: {run_dir}: exists; remove it or name another --run-dir (the report would include its old runs)",
              file=sys.stderr)
        return 2

    command = [sys.executable, "-m", "bridge_hpc.cli.submit", str(CONFIG), "--set", f"job.run_dir={run_dir}"]
    for item in OVERRIDES:
        command += ["--set", item]
    submitted = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if submitted.returncode != 0:
        sys.stderr.write(submitted.stdout + submitted.stderr)
        return submitted.returncode
    print(submitted.stdout.strip(), flush=True)
    job_id = submitted.stdout.split()[2]

    wait(job_id, run_dir, PREEMPT_AT)
    print(f"preempting job {job_id}: scancel --signal=USR1", flush=True)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    state = wait(job_id, run_dir, None)
    if state != "COMPLETED":
        print(f"error: job {job_id} ended {state}; see {RunFolder(str(run_dir)).stdout(job_id)}", file=sys.stderr)
        return 1

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    report = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.report", str(run_dir), "--plot", args.out])
    if report.returncode == 0:
        print(f"wrote {args.out} ({os.path.getsize(args.out) // 1024} KiB)")
    return report.returncode


if __name__ == "__main__":
    sys.exit(main())
