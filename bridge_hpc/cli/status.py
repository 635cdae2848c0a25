"""``bridge-status RUN_DIR``: a run's jobs, their Slurm state, restarts and logs.

``--follow`` shows the newest job live (state, restarts, step, loss, tokens/s, ETA, allocation
left; :mod:`bridge_hpc.report.live`) until it ends; ``--logs`` tails its stdout/stderr instead.

The folder named is the one read: its jobs.jsonl names the jobs, its logs/ holds their logs, and the
paths its resolved.toml records are re-rooted to it where it was moved or copied (one line on stderr
says so; :mod:`bridge_hpc.report.run_paths`). A jobs.jsonl line that does not hold a Slurm job id is
passed over, and one line on stderr says how many were: no word from a damaged file reaches Slurm's
tools. A folder that does not exist, or holds no jobs.jsonl, is one ``error:`` line and exit status 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

from bridge_hpc.cli import quiet_stdout
from bridge_hpc.contracts.errors import ConfigError, exits_on_config_error
from bridge_hpc.contracts.run_folder import RunFolder
from bridge_hpc.contracts.text import one_line
from bridge_hpc.launch.submit import submitted_job_ids
from bridge_hpc.report.run_paths import read_run_paths
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


def submitted_jobs(run_dir: Path) -> List[str]:
    """The job ids of the run folder's jobs.jsonl, oldest first; ConfigError (one line) when the folder
    does not exist, is not a folder, or has no jobs.jsonl or none that can be read; a note on stderr
    for lines passed over."""
    shown = str(run_dir)
    if not run_dir.exists():
        raise ConfigError("no such folder", path=shown)
    if not run_dir.is_dir():
        raise ConfigError("not a folder: expected a run folder (job.run_dir)", path=shown)
    jobs_log = RunFolder(shown).jobs_log
    if not os.path.isfile(jobs_log):
        raise ConfigError("no job was submitted into this folder (no jobs.jsonl)", path=shown)
    try:
        with open(jobs_log, "rb"):
            pass
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror or err}", path=jobs_log) from None
    skipped: List[int] = []
    ids = submitted_job_ids(run_dir, skipped)
    if skipped:
        numbers = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        what = f"{len(skipped)} line{'s' if len(skipped) > 1 else ''} ({numbers})"
        if not ids:
            raise ConfigError(f"no Slurm job id in any line: {what} passed over (expected JSON lines with a "
                              "\"job_id\" of digits, or <job>_<task>)", path=jobs_log)
        _note(f"{jobs_log}: skipped {what} without a Slurm job id (expected JSON lines with a \"job_id\" of "
              "digits, or <job>_<task>)")
    elif not ids:
        raise ConfigError("no job was submitted into this folder (jobs.jsonl is empty)", path=shown)
    return ids


def _note(text: str) -> None:
    print(f"note: {one_line(text)}", file=sys.stderr)


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
    ids = submitted_jobs(run_dir)
    paths = read_run_paths(str(run_dir))
    for note in paths.notes():
        _note(note)
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
    live = None  # the newest job's ETA, where it is not over (--follow shows it on its own screen)
    if not args.follow and jobs[-1]["state"] not in TERMINAL_STATES and jobs[-1]["state"] != "UNKNOWN":
        from bridge_hpc.cli.watch import LiveReader

        live = LiveReader(run_dir, ids[-1], paths).poll()
    eta = None if live is None else {"job_id": ids[-1], "seconds": live.eta_s, "note": live.eta_note,
                                     "step": live.step, "train_iters": live.train_iters,
                                     "allocation_left_s": live.allocation_left_s}
    try:
        if args.json:
            print(json.dumps({"run_dir": str(run_dir), "jobs": jobs, "eta": eta}, indent=2))
        else:
            print(f"run folder {one_line(str(run_dir))}")
            print(f"{'job':>8}  {'state':<12} {'restarts':>8}  log")
            for job in jobs:
                print(f"{job['job_id']:>8}  {job['state']:<12} {job['restarts']:>8}  {one_line(job['logs'][0])}")
                for n, r in enumerate(job["runs"]):
                    print(f"{'':>8}    run {n}: {r['state']:<10} start {r['start'] or '-'}  end {r['end'] or '-'}  "
                          f"elapsed {r['elapsed'] or '-'}  exit {r['exit_code'] or '-'}  {r['reason']}")
            if live is not None:
                from bridge_hpc.report.live import eta_text, format_duration

                print(f"job {ids[-1]}: step {live.step if live.step is not None else '-'}/{live.train_iters or '?'}; "
                      f"job ETA (to train_iters, across requeues) {one_line(eta_text(live))}; "
                      f"allocation left {format_duration(live.allocation_left_s)}")
        sys.stdout.flush()
        if args.follow:
            from bridge_hpc.cli.watch import watch

            print()
            status = watch(run_dir, ids[-1], style="screen", paths=paths)
            print(f"job {ids[-1]} ended: {status.state}")
        elif args.logs:
            state = follow(log_paths(run_dir, ids[-1]), ids[-1])
            print(f"job {ids[-1]} ended: {state}")
    except BrokenPipeError:  # the reader went away (| head): nothing more to say, and no traceback
        quiet_stdout()
    return 0


if __name__ == "__main__":
    sys.exit(main())
