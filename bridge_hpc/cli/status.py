"""``bridge-status RUN_DIR``: a run's jobs, their Slurm state, restarts and logs.

``--follow`` shows the newest job live (state, restarts, step, loss, tokens/s, ETA, allocation
left; :mod:`bridge_hpc.report.live`) until it ends; ``--logs`` tails its stdout/stderr instead."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

from bridge_hpc.contracts.errors import ConfigError, exits_on_config_error
from bridge_hpc.contracts.run_folder import RunFolder
from bridge_hpc.launch.submit import submitted_job_ids
from bridge_hpc.slurm.query import TERMINAL_STATES, job_runs


def log_paths(run_dir: Path, job_id: str) -> List[Path]:
    folder = RunFolder(str(run_dir))
    return [Path(folder.stdout(job_id)), Path(folder.stderr(job_id))]


def follow(paths: List[Path], job_id: str, poll_s: float = 1.0) -> str:
    """Print what the logs gain until the job reaches a terminal state (a requeue is not one)."""
    offsets = {p: 0 for p in paths}
    state = ""
    while True:
        for path in paths:
            if path.exists():
                with path.open("rb") as f:
                    f.seek(offsets[path])
                    chunk = f.read()
                    offsets[path] += len(chunk)
                if chunk:
                    sys.stdout.write(chunk.decode(errors="replace"))
                    sys.stdout.flush()
        if state in TERMINAL_STATES:
            return state
        runs = job_runs(job_id)
        state = runs[-1].state if runs else "UNKNOWN"
        time.sleep(poll_s)


@exits_on_config_error
def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="bridge-status", description="Show a run's Slurm jobs, restarts and logs.")
    p.add_argument("run_dir", help="the job's run folder (job.run_dir)")
    p.add_argument("--follow", "-f", action="store_true",
                   help="show the newest job live (step, loss, tokens/s, ETA, allocation left) until it ends: one "
                        "screen redrawn in place on a terminal, plain lines otherwise")
    p.add_argument("--logs", action="store_true", help="tail the newest job's stdout/stderr until it ends")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    ids = submitted_job_ids(run_dir)
    if not ids:
        raise ConfigError("no job was submitted into this folder (no jobs.jsonl)", path=str(run_dir))
    jobs = []
    for job_id in ids:
        runs = job_runs(job_id)
        jobs.append({
            "job_id": job_id,
            "state": runs[-1].state if runs else "UNKNOWN",
            "restarts": max(0, len(runs) - 1),
            "runs": [r.__dict__ for r in runs],
            "logs": [str(p) for p in log_paths(run_dir, job_id)],
        })
    if args.json:
        print(json.dumps({"run_dir": str(run_dir), "jobs": jobs}, indent=2))
    else:
        print(f"run folder {run_dir}")
        print(f"{'job':>8}  {'state':<12} {'restarts':>8}  log")
        for job in jobs:
            print(f"{job['job_id']:>8}  {job['state']:<12} {job['restarts']:>8}  {job['logs'][0]}")
            for n, r in enumerate(job["runs"]):
                print(f"{'':>8}    run {n}: {r['state']:<10} start {r['start'] or '-'}  end {r['end'] or '-'}  "
                      f"elapsed {r['elapsed'] or '-'}  exit {r['exit_code'] or '-'}  {r['reason']}")
    if args.follow:
        from bridge_hpc.cli.watch import watch

        print()
        status = watch(run_dir, ids[-1], style="screen")
        print(f"job {ids[-1]} ended: {status.state}")
    elif args.logs:
        state = follow(log_paths(run_dir, ids[-1]), ids[-1])
        print(f"job {ids[-1]} ended: {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
